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
