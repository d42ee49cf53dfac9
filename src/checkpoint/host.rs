//! `HostTensor`: a tensor in host memory, f32, with its shape. The common currency between
//! safetensors files, models and optimizers.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

#[derive(Debug, Clone, PartialEq)]
pub struct HostTensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

impl HostTensor {
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), data.len());
        Self { shape, data }
    }

    pub fn to_tensor<B: Backend, const D: usize>(&self, device: &B::Device) -> Tensor<B, D> {
        Tensor::from_data(
            TensorData::new(self.data.clone(), self.shape.clone()),
            device,
        )
    }

    pub fn from_tensor<B: Backend, const D: usize>(t: &Tensor<B, D>) -> Self {
        let shape = t.dims().to_vec();
        let data = t
            .to_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .unwrap_or_default();
        Self { shape, data }
    }

    pub fn numel(&self) -> usize {
        self.data.len()
    }

    /// Rows `[start, start + len)` along the first dimension (splitting fused projections).
    pub fn rows(&self, start: usize, len: usize) -> Self {
        let row: usize = self.shape[1..].iter().product();
        let mut shape = self.shape.clone();
        shape[0] = len;
        Self {
            shape,
            data: self.data[start * row..(start + len) * row].to_vec(),
        }
    }

    /// The same values as `shape` (of as many elements).
    pub fn reshaped(self, shape: Vec<usize>) -> Self {
        debug_assert_eq!(shape.iter().product::<usize>(), self.data.len());
        Self {
            shape,
            data: self.data,
        }
    }

    /// Stacks tensors along the first dimension (fusing projections back).
    pub fn concat_rows(parts: &[HostTensor]) -> Self {
        let mut shape = parts[0].shape.clone();
        shape[0] = parts.iter().map(|p| p.shape[0]).sum();
        Self {
            shape,
            data: parts.iter().flat_map(|p| p.data.iter().copied()).collect(),
        }
    }
}
