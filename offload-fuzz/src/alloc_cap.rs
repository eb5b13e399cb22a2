//! An allocation cap for the fuzz binaries and the bounded test: a
//! global allocator that aborts the process, naming the size, on any
//! single allocation above [`CAP_BYTES`]. The inputs are a few kilobytes,
//! so an allocation that large means a parser believed a length the
//! input claimed (a header length of 2^63, a shape whose product
//! overflows) instead of returning an error.

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Write;

/// The largest single allocation a harness may make: 64 MiB.
pub const CAP_BYTES: usize = 64 << 20;

/// The system allocator, refusing (by aborting) allocations above
/// [`CAP_BYTES`]. Install it with `#[global_allocator]`.
#[derive(Debug, Default)]
pub struct CappedAlloc;

fn check(layout: Layout) {
    if layout.size() > CAP_BYTES {
        // No allocation here: stderr is unbuffered.
        let _ = std::io::stderr().write_all(
            b"offload-fuzz: an allocation above the 64 MiB cap (a parser believed a claimed length)\n",
        );
        std::process::abort();
    }
}

// SAFETY: every method checks the size, then forwards to `System` with
// the caller's own arguments, so `System`'s guarantees are this
// allocator's.
unsafe impl GlobalAlloc for CappedAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        check(layout);
        // SAFETY: the caller's contract for `alloc` is `System`'s.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        check(layout);
        // SAFETY: as `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from `System` with this layout (every
        // allocation above went there).
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if new_size > CAP_BYTES {
            check(Layout::from_size_align(new_size, layout.align()).unwrap_or(layout));
        }
        // SAFETY: as `dealloc`; the caller's contract for `realloc` is
        // `System`'s.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}
