//! Process memory around the training loop: the allocator's mode for the steady state of
//! training, and the peak resident memory a benchmark reports.

/// `mi_option_purge_delay` in mimalloc v2's `mi_option_t` (not in libmimalloc-sys's bindings).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Call once setup (model load, data) is done and the training loop starts.
///
/// 1. Returns the memory setup freed (checkpoint decode buffers, a built-then-saved model) to
///    the kernel, so it does not count against training.
/// 2. From then on asks mimalloc (the `tune` binary's allocator) to keep freed pages mapped:
///    every step frees and re-allocates the same large buffers (logits, attention scores),
///    and handing them back made the kernel zero fresh pages each step (13% of a
///    SmolLM2-135M 4x256 forward). Resident memory then stays at the step's peak, which it
///    reaches every step anyway. `MIMALLOC_PURGE_DELAY` in the environment takes precedence.
///
/// Both are no-ops in a process whose allocator is not mimalloc (the library's tests).
pub fn enter_training_steady_state() {
    // SAFETY: process-wide allocator requests with no pointers involved.
    unsafe {
        libmimalloc_sys::mi_collect(true);
        if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
            libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1);
        }
    }
}

/// Restarts the peak-resident-memory count (Linux: writing 5 to `/proc/self/clear_refs`
/// resets VmHWM), so a benchmark reports the training phase's peak rather than a checkpoint
/// load's. Returns whether the platform allowed it.
pub fn reset_peak_memory() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}
