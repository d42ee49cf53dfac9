//! The binary's allocator: mimalloc (main.rs says why), and when memory runs out a clear error
//! naming the request, what the process holds, its memory limit and the ways out, instead of
//! Rust's bare "memory allocation of N bytes failed" and an abort (SIGABRT, a core dump).
//!
//! Invariants: nothing on the failure path allocates. The message is formatted into a buffer
//! on the stack, what the process holds is read from `/proc/self/status` into another, the
//! text goes out in one `write(2)`, and the process ends with `_exit(1)` (no destructors, no
//! at-exit handlers, which could allocate). Every worker thread of the process ends with it;
//! the other nodes of a multi-node run see a lost peer and stop naming it.

use std::alloc::{GlobalAlloc, Layout};
use std::fmt::Write;

use mimalloc::MiMalloc;

/// mimalloc, ending the process with [`out_of_memory`]'s error when it has no memory to give.
pub struct Allocator;

// SAFETY: every call is mimalloc's own with the caller's arguments; a null result (the only
// case changed) never returns to the caller.
unsafe impl GlobalAlloc for Allocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        checked(unsafe { MiMalloc.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        checked(unsafe { MiMalloc.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `alloc`.
        checked(unsafe { MiMalloc.realloc(ptr, layout, new_size) }, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `alloc`.
        unsafe { MiMalloc.dealloc(ptr, layout) }
    }
}

fn checked(ptr: *mut u8, size: usize) -> *mut u8 {
    if ptr.is_null() {
        out_of_memory(size);
    }
    ptr
}

/// A `fmt::Write` into a fixed buffer on the stack; what does not fit is dropped.
struct StackText<const N: usize> {
    buf: [u8; N],
    len: usize,
}

impl<const N: usize> StackText<N> {
    fn new() -> Self {
        Self {
            buf: [0; N],
            len: 0,
        }
    }

    fn as_bytes(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl<const N: usize> Write for StackText<N> {
    fn write_str(&mut self, s: &str) -> std::fmt::Result {
        let n = s.len().min(N - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&s.as_bytes()[..n]);
        self.len += n;
        Ok(())
    }
}

/// What the process holds and may hold, in bytes, where the system says.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
struct Held {
    resident: Option<u64>,
    peak: Option<u64>,
    /// The address-space limit (`RLIMIT_AS`, `ulimit -v`, `prlimit --as`), when there is one.
    limit: Option<u64>,
}

/// The error for a failed request of `size` bytes.
fn message(size: usize, held: Held) -> StackText<1536> {
    let mb = |b: u64| b as f64 / 1e6;
    let mut text = StackText::new();
    let _ = write!(
        text,
        "error: out of memory: a request for {:.1} MB failed",
        mb(size as u64)
    );
    if let (Some(resident), Some(peak)) = (held.resident, held.peak) {
        let _ = write!(
            text,
            " with {:.0} MB resident (peak {:.0} MB)",
            mb(resident),
            mb(peak)
        );
    }
    if let Some(limit) = held.limit {
        let _ = write!(
            text,
            ", under this process's address-space limit of {:.0} MB (RLIMIT_AS: ulimit -v, prlimit --as)",
            mb(limit)
        );
    }
    let _ = write!(
        text,
        ".\n  The run's weights, gradients, optimizer state and activations do not fit: shard them over more \
         ranks (`tune run --nproc_per_node N <recipe>_distributed`: FSDP keeps about 1/N of each per rank), \
         train LoRA or QLoRA instead of every weight, or lower batch_size or max_seq_len \
         (enable_activation_checkpointing: True keeps fewer activations).\n"
    );
    text
}

/// Reads `/proc/self/status` into a stack buffer (Linux; `None` elsewhere) and the
/// address-space limit, without allocating.
fn held() -> Held {
    let mut held = Held::default();
    // SAFETY: plain system calls on a NUL-terminated path and buffers owned here.
    unsafe {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_AS, &mut limit) == 0
            && limit.rlim_cur != libc::RLIM_INFINITY
        {
            held.limit = Some(limit.rlim_cur);
        }
        let fd = libc::open(c"/proc/self/status".as_ptr(), libc::O_RDONLY);
        if fd < 0 {
            return held;
        }
        let mut buf = [0u8; 4096];
        let n = libc::read(fd, buf.as_mut_ptr().cast(), buf.len());
        libc::close(fd);
        if n > 0 {
            let status = &buf[..n as usize];
            held.resident = status_kb(status, b"VmRSS:").map(|kb| kb * 1024);
            held.peak = status_kb(status, b"VmHWM:").map(|kb| kb * 1024);
        }
    }
    held
}

/// The kB figure of the `/proc/self/status` line starting with `key`.
fn status_kb(status: &[u8], key: &[u8]) -> Option<u64> {
    let line = status
        .split(|&b| b == b'\n')
        .find(|line| line.starts_with(key))?;
    let digits = line[key.len()..]
        .iter()
        .skip_while(|b| !b.is_ascii_digit())
        .take_while(|b| b.is_ascii_digit());
    let mut kb = 0u64;
    let mut any = false;
    for d in digits {
        kb = kb.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
        any = true;
    }
    any.then_some(kb)
}

#[cold]
fn out_of_memory(size: usize) -> ! {
    let text = message(size, held());
    let bytes = text.as_bytes();
    // SAFETY: writes a buffer owned here, then ends the process.
    unsafe {
        libc::write(2, bytes.as_ptr().cast(), bytes.len());
        libc::_exit(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_names_the_request_what_is_held_the_limit_and_the_ways_out() {
        let held = Held {
            resident: Some(3_000_000_000),
            peak: Some(3_400_000_000),
            limit: Some(3_500_000_000),
        };
        let text = message(512_000_000, held);
        let text = std::str::from_utf8(text.as_bytes()).unwrap();
        for part in [
            "out of memory: a request for 512.0 MB failed",
            "3000 MB resident (peak 3400 MB)",
            "address-space limit of 3500 MB",
            "--nproc_per_node N",
            "LoRA or QLoRA",
            "batch_size",
        ] {
            assert!(text.contains(part), "{part}: {text}");
        }
        let unlimited = message(1, Held::default());
        let unlimited = std::str::from_utf8(unlimited.as_bytes()).unwrap();
        assert!(!unlimited.contains("limit of"), "{unlimited}");
    }

    #[test]
    fn what_the_process_holds_is_read_from_its_status() {
        let status = b"Name:\ttune\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(status_kb(status, b"VmRSS:"), Some(102_400));
        assert_eq!(status_kb(status, b"VmHWM:"), Some(204_800));
        assert_eq!(status_kb(status, b"VmSwap:"), None);
        let now = held();
        assert!(now.resident.is_some_and(|r| r > 0), "{now:?}");
    }

    #[test]
    fn text_that_does_not_fit_is_cut_not_overflowed() {
        let mut t = StackText::<4>::new();
        let _ = write!(t, "abcdef");
        assert_eq!(t.as_bytes(), b"abcd");
    }
}
