//! An allocation cap for the fuzz binaries and the bounded test: a
//! global allocator that aborts the process, naming the size, on any
//! single allocation above [`CAP_BYTES`]. The inputs are a few kilobytes,
//! so an allocation that large means a parser believed a length the
//! input claimed (a header length of 2^63, a shape whose product
//! overflows) instead of returning an error.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::io::Write;

/// The largest single allocation a harness may make: 64 MiB.
pub const CAP_BYTES: usize = 64 << 20;

/// The system allocator, refusing (by aborting) allocations above
/// [`CAP_BYTES`]. Install it with `#[global_allocator]`.
#[derive(Debug, Default)]
pub struct CappedAlloc;

thread_local! {
    /// The input this thread's harness is running on, for the report.
    static CURRENT: Cell<(*const u8, usize)> = const { Cell::new((std::ptr::null(), 0)) };
}

/// Runs `f` with `input` named as this thread's current input: an
/// allocation above the cap during `f` prints it (hex, its first 2 KiB)
/// before aborting, since an abort cannot unwind to the caller's report.
pub fn with_input<R>(input: &[u8], f: impl FnOnce() -> R) -> R {
    struct Clear;
    impl Drop for Clear {
        fn drop(&mut self) {
            CURRENT.with(|c| c.set((std::ptr::null(), 0)));
        }
    }
    CURRENT.with(|c| c.set((input.as_ptr(), input.len())));
    let _clear = Clear;
    f()
}

fn check(layout: Layout) {
    if layout.size() > CAP_BYTES {
        // No allocation here: stderr is unbuffered, the hex goes through a
        // buffer on the stack.
        let mut err = std::io::stderr();
        let _ = err.write_all(
            b"offload-fuzz: an allocation above the 64 MiB cap (a parser believed a claimed length)\n",
        );
        let (ptr, len) = CURRENT.try_with(Cell::get).unwrap_or((std::ptr::null(), 0));
        if !ptr.is_null() {
            // SAFETY: `with_input` set these from a live slice and clears
            // them before its borrow ends; this runs inside that borrow (on
            // the same thread, during `f`).
            let input = unsafe { std::slice::from_raw_parts(ptr, len) };
            let _ = err.write_all(b"input (hex, first 2 KiB): ");
            const HEX: &[u8; 16] = b"0123456789abcdef";
            for chunk in input[..len.min(2048)].chunks(64) {
                let mut buf = [0u8; 128];
                for (i, b) in chunk.iter().enumerate() {
                    buf[2 * i] = HEX[usize::from(b >> 4)];
                    buf[2 * i + 1] = HEX[usize::from(b & 15)];
                }
                let _ = err.write_all(&buf[..2 * chunk.len()]);
            }
            let _ = err.write_all(b"\n");
        }
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
