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

/// The largest buffer the device allocates at once (cubecl's largest memory page: on wgpu the
/// adapter's `max_storage_buffer_binding_size`, 128 MiB on lavapipe); `None` for the CPU.
pub fn largest_buffer<D: burn::tensor::backend::DeviceOps>(device: &D) -> Option<u64> {
    let any = device as &dyn std::any::Any;
    #[cfg(feature = "wgpu")]
    if let Some(device) = any.downcast_ref::<burn::backend::wgpu::WgpuDevice>() {
        return Some(largest_page::<burn::backend::wgpu::WgpuRuntime>(device));
    }
    #[cfg(feature = "cuda")]
    if let Some(device) = any.downcast_ref::<burn::backend::cuda::CudaDevice>() {
        return Some(largest_page::<cubecl::cuda::CudaRuntime>(device));
    }
    let _ = any;
    None
}

#[cfg(any(feature = "wgpu", feature = "cuda"))]
fn largest_page<R: cubecl::Runtime>(device: &R::Device) -> u64 {
    R::client(device).properties().memory.max_page_size
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

/// A failure on the device's own thread: cubecl runs each device's work on a thread of its own
/// and, when a task there panics (a buffer the driver cannot allocate, an out-of-memory), logs
/// "Task failed" and goes on; the tensor whose buffer was never made then reads as whatever
/// memory it lands on. burn returns nothing to the caller (cubecl 0.10's `initialize_memory`
/// unwraps the allocation on that thread), so a run would go on with wrong losses and weights:
/// on lavapipe, composed attention at 2048 tokens came out with an infinite gradient norm and at
/// 4096 with plausible but wrong losses. [`watch_device_faults`] records such a panic, and the
/// trainer takes it ([`take_device_fault`]) after each step's read and before each save, and
/// stops the run naming it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the device failed ({message}){more}; {hint}",
    more = if *.count > 1 { format!(", {} times", .count) } else { String::new() },
    hint = fault_hint(.message)
)]
pub struct DeviceFault {
    /// The first failure's panic message.
    pub message: String,
    /// How many tasks failed since the last [`take_device_fault`].
    pub count: usize,
}

/// What to change after a fault: an allocation the device refused is the run's memory.
fn fault_hint(message: &str) -> &'static str {
    if message.contains("allocate") || message.to_lowercase().contains("out of memory") {
        "the step needs a buffer larger than the device gives: lower batch_size or tokenizer.max_seq_len, keep attention: fused (the default: composed attention keeps a heads x seq x seq buffer per layer), or set enable_activation_checkpointing: True"
    } else {
        "the device's results from here on cannot be trusted; rerun with RUST_LOG=warn for cubecl's log, or use device=cpu"
    }
}

/// cubecl 0.10 names its device threads `DS{U|D}-{type}-{index}` (cubecl-common's
/// `device::handle::channel`).
fn on_device_thread() -> bool {
    std::thread::current()
        .name()
        .is_some_and(|n| n.starts_with("DSD-") || n.starts_with("DSU-"))
}

static FAULT: std::sync::Mutex<Option<DeviceFault>> = std::sync::Mutex::new(None);

/// Records every panic on a device thread for [`take_device_fault`], printing the first one's
/// message in one line (cubecl's log adds "Task failed" for each); panics elsewhere go to the
/// hook that was there before. Installed once per process; the CPU has no device thread, so
/// there it never fires.
pub fn watch_device_faults() {
    static INSTALLED: std::sync::Once = std::sync::Once::new();
    INSTALLED.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !on_device_thread() {
                return previous(info);
            }
            let message = info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| info.payload().downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "a task panicked".into());
            let message = cause(&message).to_string();
            let mut fault = FAULT.lock().unwrap_or_else(|e| e.into_inner());
            match fault.as_mut() {
                Some(f) => f.count += 1,
                None => {
                    eprintln!("tune: the device failed: {message}");
                    *fault = Some(DeviceFault { message, count: 1 });
                }
            }
        }));
    });
}

/// The cause in a panic message: its first line, without the `unwrap` it came through
/// ("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 268435456").
fn cause(message: &str) -> &str {
    let first = message.lines().next().unwrap_or_default();
    first
        .strip_prefix("called `Result::unwrap()` on an `Err` value: ")
        .unwrap_or(first)
}

/// The device failures recorded since the last call, if any (see [`DeviceFault`]).
pub fn take_device_fault() -> Option<DeviceFault> {
    FAULT.lock().unwrap_or_else(|e| e.into_inner()).take()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_has_no_device_memory_of_its_own() {
        let cpu = burn::backend::flex::FlexDevice;
        assert_eq!(device_memory(&cpu), None);
        assert_eq!(largest_buffer(&cpu), None);
        sample_device_memory(&cpu);
        assert_eq!(take_device_peak(), None);
    }

    #[test]
    fn a_panic_on_a_device_thread_is_recorded_and_others_are_not() {
        watch_device_faults();
        let panics_on = |name: &str| {
            std::thread::Builder::new()
                .name(name.into())
                .spawn(|| {
                    panic!("called `Result::unwrap()` on an `Err` value: can't allocate buffer of size: 268435456\nNo backtrace available")
                })
                .unwrap()
                .join()
                .expect_err("the thread panicked");
        };
        panics_on("a-worker");
        assert_eq!(take_device_fault(), None, "not a device thread");
        panics_on("DSD-4-0");
        panics_on("DSD-4-0");
        let fault = take_device_fault().expect("recorded");
        assert_eq!(fault.count, 2);
        let text = fault.to_string();
        assert_eq!(fault.message, "can't allocate buffer of size: 268435456");
        assert!(
            text.contains("can't allocate buffer of size: 268435456")
                && text.contains(", 2 times")
                && text.contains("attention: fused"),
            "{text}"
        );
        assert_eq!(take_device_fault(), None, "taken once");
    }
}
