//! The float precision a run computes in (the config's `dtype`), and the few places that stay
//! in fp32 whatever it is.
//!
//! A bf16 run makes bf16 the device's default float dtype before the first tensor exists, so
//! everything created on it (loaded weights, new adapters, RoPE tables, masks, optimizer state)
//! is bf16 without each builder being told. As torchtune and transformers do, the numerically
//! sensitive reductions upcast: RMSNorm's variance, attention's softmax, the losses' log-softmax
//! and the gradient norm run in fp32 and cast back where the result feeds the model again.

use burn::tensor::backend::Backend;
use burn::tensor::backend::{DeviceError, set_default_float_dtype};
use burn::tensor::{
    DType, FloatDType, Tensor, TensorCreationOptions, TensorData, get_device_settings,
};

/// A run's float precision (the config's `dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum Dtype {
    #[default]
    #[serde(rename = "fp32", alias = "float32")]
    Fp32,
    #[serde(rename = "bf16", alias = "bfloat16")]
    Bf16,
    #[serde(rename = "fp16", alias = "float16")]
    Fp16,
}

#[derive(Debug, thiserror::Error)]
pub enum PrecisionError {
    #[error(
        "dtype: fp16 training is not supported (its range overflows without loss scaling); use bf16 or fp32"
    )]
    Fp16Training,
    #[error(
        "dtype: {requested} asked for, but this process already created {current} tensors on the device (burn fixes a device's float dtype once per process); run it in a new process"
    )]
    AlreadyFixed {
        requested: &'static str,
        current: &'static str,
    },
    #[error("dtype: {dtype} is not supported on this device ({source}); use fp32")]
    Unsupported {
        dtype: &'static str,
        source: DeviceError,
    },
}

/// Whether a run trains (fp16 is refused, as torchtune's recipes refuse it) or only generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Use {
    Training,
    Generation,
}

fn float_dtype(dtype: Dtype) -> FloatDType {
    match dtype {
        Dtype::Fp32 => FloatDType::F32,
        Dtype::Bf16 => FloatDType::BF16,
        Dtype::Fp16 => FloatDType::F16,
    }
}

pub fn name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::Fp32 => "fp32",
        Dtype::Bf16 => "bf16",
        Dtype::Fp16 => "fp16",
    }
}

/// Makes `dtype` the float dtype of every tensor later created on `device`. Call it before the
/// first tensor: burn fixes a device's defaults once per process, so a second run in the same
/// process may only ask for the dtype the first one fixed. fp32 is the backends' own default.
pub fn set_device_dtype<B: Backend>(
    device: &B::Device,
    dtype: Dtype,
    usage: Use,
) -> Result<(), PrecisionError> {
    if dtype == Dtype::Fp16 && usage == Use::Training {
        return Err(PrecisionError::Fp16Training);
    }
    let result = if dtype == Dtype::Fp32 {
        Ok(())
    } else {
        set_default_float_dtype::<B>(device, float_dtype(dtype))
    };
    match result {
        Err(DeviceError::AlreadyInitialized { .. }) | Ok(()) => {
            let current = device_dtype::<B>(device);
            if current == dtype {
                Ok(())
            } else {
                Err(PrecisionError::AlreadyFixed {
                    requested: name(dtype),
                    current: name(current),
                })
            }
        }
        Err(source) => Err(PrecisionError::Unsupported {
            dtype: name(dtype),
            source,
        }),
    }
}

/// The float dtype new tensors on `device` get.
pub fn device_dtype<B: Backend>(device: &B::Device) -> Dtype {
    match get_device_settings::<B>(device).float_dtype {
        FloatDType::BF16 => Dtype::Bf16,
        FloatDType::F16 => Dtype::Fp16,
        _ => Dtype::Fp32,
    }
}

/// Whether `t` is a half-precision float (bf16 or fp16).
pub fn is_half<B: Backend, const D: usize>(t: &Tensor<B, D>) -> bool {
    matches!(t.dtype(), DType::BF16 | DType::F16)
}

/// `t` in fp32 (no operation when it already is).
pub fn to_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Tensor<B, D> {
    to_dtype(t, DType::F32)
}

/// `t` cast to `dtype` (no operation when it already is; a parallel pass on the CPU).
pub fn to_dtype<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: DType) -> Tensor<B, D> {
    crate::kernels::cast(t, dtype)
}

/// An fp32 tensor from host values, whatever the device's default float dtype (loss masks,
/// which meet fp32 log-probabilities).
pub fn f32_tensor<B: Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(
        TensorData::new(values, shape),
        TensorCreationOptions::new(device.clone()).with_dtype(DType::F32),
    )
}

/// The dtype generation computes in on `B`. On the CPU backend (Flex) bf16 has tune's own
/// kernels (a bf16 product that reads the weight in place for decoding, fp32 row kernels
/// between roundings) and decodes faster than fp32; fp16 has none, and every fp16 op there
/// converts through fp32 one element at a time (about 10x slower than fp32), so fp16
/// generation computes in fp32, which represents fp16 weights exactly, and says so. Other
/// backends compute in the dtype asked for.
pub fn generation_dtype<B: Backend + 'static>(requested: Dtype) -> Dtype {
    let on_flex = std::any::TypeId::of::<B>() == std::any::TypeId::of::<burn::backend::Flex>();
    if on_flex && requested == Dtype::Fp16 {
        crate::say_warn!(
            "dtype: generation on the CPU computes in fp32, not fp16 (the CPU backend converts fp16 through fp32 on every op, about 10x slower); the fp16 weights are upcast exactly. Set dtype=bf16 or dtype=fp32 to silence this"
        );
        return Dtype::Fp32;
    }
    requested
}
