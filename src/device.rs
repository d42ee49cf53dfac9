//! The accelerators a run can use besides the CPU, and what tune can tell about them before the
//! first tensor exists.
//!
//! `device: wgpu` runs burn's cubecl backend through wgpu: Vulkan on Linux and Windows, Metal on
//! macOS, DX12 on Windows, and Mesa's software Vulkan (lavapipe) where there is no GPU at all,
//! which is how CI runs the GPU code path. cubecl panics when it finds no adapter, so the run
//! probes for one first and refuses by name instead.

/// The adapter `device: wgpu` runs on: the one cubecl's default device picks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WgpuAdapter {
    /// As the driver reports it, e.g. "llvmpipe (LLVM 15.0.6, 256 bits)".
    pub name: String,
    /// The graphics API: Vulkan, Metal, Dx12.
    pub api: String,
    /// A CPU implementation (lavapipe, SwiftShader, WARP): correct, but no speed figure.
    pub software: bool,
}

impl std::fmt::Display for WgpuAdapter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({}", self.name, self.api)?;
        if self.software {
            write!(f, ", software rendering on the CPU")?;
        }
        write!(f, ")")
    }
}

#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    #[error(
        "device: wgpu, but this tune was built without wgpu support; rebuild with `cargo install --path . --features wgpu` (or set device=cpu)"
    )]
    WgpuNotBuilt,
    #[error(
        "device: wgpu, but no {api} adapter was found ({reason}); install the GPU's Vulkan driver (on Debian/Ubuntu without a GPU, Mesa's software one: `apt-get install mesa-vulkan-drivers`), or set device=cpu"
    )]
    NoWgpuAdapter { api: String, reason: String },
}

/// The adapter cubecl's `WgpuDevice::DefaultDevice` will use (the high-performance one of the
/// platform's graphics API), or why there is none.
#[cfg(feature = "wgpu")]
pub fn wgpu_adapter() -> Result<WgpuAdapter, DeviceError> {
    use burn::backend::wgpu::graphics::{AutoGraphicsApi, GraphicsApi};

    let backend = AutoGraphicsApi::backend();
    let api = format!("{backend:?}");
    let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
        backends: backend.into(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    });
    let request = instance.request_adapter(&wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        force_fallback_adapter: false,
        compatible_surface: None,
    });
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| DeviceError::NoWgpuAdapter {
            api: api.clone(),
            reason: e.to_string(),
        })?;
    let adapter = runtime
        .block_on(request)
        .map_err(|e| DeviceError::NoWgpuAdapter {
            api: api.clone(),
            reason: e.to_string(),
        })?;
    let info = adapter.get_info();
    Ok(WgpuAdapter {
        name: info.name,
        api,
        software: info.device_type == wgpu::DeviceType::Cpu,
    })
}

#[cfg(not(feature = "wgpu"))]
pub fn wgpu_adapter() -> Result<WgpuAdapter, DeviceError> {
    Err(DeviceError::WgpuNotBuilt)
}

/// Device memory as cubecl's memory manager counts it, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DeviceMemory {
    /// Held by live tensors (torch's "active").
    pub in_use: u64,
    /// Taken from the driver by the memory pools (torch's "reserved").
    pub reserved: u64,
}

impl DeviceMemory {
    /// The larger of each figure.
    pub fn max(self, other: Self) -> Self {
        Self {
            in_use: self.in_use.max(other.in_use),
            reserved: self.reserved.max(other.reserved),
        }
    }
}

/// What the device `device` holds now: `None` for the CPU (whose memory is the process's, in
/// `peak_memory_bytes`) and for a build without the device's backend.
pub fn device_memory<D: burn::tensor::backend::DeviceOps>(device: &D) -> Option<DeviceMemory> {
    let any = device as &dyn std::any::Any;
    #[cfg(feature = "wgpu")]
    if let Some(device) = any.downcast_ref::<burn::backend::wgpu::WgpuDevice>() {
        return usage::<burn::backend::wgpu::WgpuRuntime>(device);
    }
    #[cfg(feature = "cuda")]
    if let Some(device) = any.downcast_ref::<burn::backend::cuda::CudaDevice>() {
        return usage::<cubecl::cuda::CudaRuntime>(device);
    }
    let _ = any;
    None
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn usage<R: cubecl::Runtime>(device: &R::Device) -> Option<DeviceMemory> {
    let usage = R::client(device).memory_usage().ok()?;
    Some(DeviceMemory {
        in_use: usage.bytes_in_use,
        reserved: usage.bytes_reserved,
    })
}

thread_local! {
    /// The most device memory this thread (a rank's worker) saw at its samples since
    /// [`take_device_peak`] last read it.
    static PEAK: std::cell::Cell<Option<DeviceMemory>> = const { std::cell::Cell::new(None) };
}

/// Samples what `device` holds into this thread's peak (a no-op on the CPU). The trainer
/// samples after each micro-batch's forward and backward and after the update; activation
/// checkpointing after the forward and each layer's backward: the peak is the largest of
/// those samples, not every allocation's.
pub fn sample_device_memory<D: burn::tensor::backend::DeviceOps>(device: &D) {
    if let Some(now) = device_memory(device) {
        PEAK.with(|peak| peak.set(Some(peak.get().map_or(now, |p| p.max(now)))));
    }
}

/// This thread's sampled peak since the last call (`None` on the CPU).
pub fn take_device_peak() -> Option<DeviceMemory> {
    PEAK.with(|peak| peak.take())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_device_memory_of_its_own() {
        let cpu = burn::backend::flex::FlexDevice;
        assert_eq!(device_memory(&cpu), None);
        sample_device_memory(&cpu);
        assert_eq!(take_device_peak(), None);
    }
}
