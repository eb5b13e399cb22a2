//! Host copies into buffers the CPU will not read again: staging buffers
//! and pinned masters, which only the copy engine reads (CONTRACT §7c).
//!
//! A plain `memcpy` of a staging fill writes through the cache: each line
//! it writes is first read from memory (a read for ownership), and the
//! copy engine's DMA then reads lines the cache still holds. A staged
//! stream shares the host's memory bandwidth with the DMA of every block,
//! so those extra reads slow the link itself (the H200 host measured the
//! copy engine at 47.8 GB/s beside staged fills against 54.6 without).
//! [`copy_streaming`] writes with non-temporal stores instead: the bytes go
//! to memory without being read first or kept in the cache.

/// Copies below this stay plain `copy_from_slice`: a streaming copy's
/// fence and its unaligned ends cost more than it saves there.
pub const STREAMING_MIN_BYTES: usize = 256 << 10;

/// Copies `src` into `dst` (the same length, as `copy_from_slice`): with
/// non-temporal stores where the CPU has them (x86-64, whose baseline SSE2
/// has `movntdq`) and the copy is at least [`STREAMING_MIN_BYTES`]; a
/// plain copy otherwise. The stores are fenced before it returns, so what
/// follows it on this thread (a lock released, an event, a DMA started
/// after a join) sees every byte. For a buffer the CPU does not read back
/// soon: a staging buffer or a pinned master, which the copy engine reads.
///
/// # Panics
///
/// If the lengths differ (as `copy_from_slice`).
pub fn copy_streaming(dst: &mut [u8], src: &[u8]) {
    assert_eq!(
        dst.len(),
        src.len(),
        "copy_streaming: destination and source lengths differ"
    );
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if dst.len() >= STREAMING_MIN_BYTES {
        x86::copy(dst, src);
        return;
    }
    dst.copy_from_slice(src);
}

#[cfg(all(target_arch = "x86_64", not(miri)))]
mod x86 {
    use core::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};

    /// 64 bytes (a cache line) a step.
    const LINE: usize = 64;

    pub(super) fn copy(dst: &mut [u8], src: &[u8]) {
        debug_assert_eq!(dst.len(), src.len());
        // The unaligned head and the tail with plain copies; the body, a
        // whole number of lines from a line-aligned destination, streamed.
        let head = dst.as_ptr().align_offset(LINE).min(dst.len());
        let body = (dst.len() - head) / LINE * LINE;
        let (d_head, rest) = dst.split_at_mut(head);
        let (d_body, d_tail) = rest.split_at_mut(body);
        let (s_head, rest) = src.split_at(head);
        let (s_body, s_tail) = rest.split_at(body);
        d_head.copy_from_slice(s_head);
        let d = d_body.as_mut_ptr();
        let s = s_body.as_ptr();
        let mut i = 0;
        while i < body {
            // SAFETY: `i + 64 <= body`, so the four 16-byte loads read
            // within `s_body` and the four stores write within `d_body`
            // (both `body` bytes, distinct memory: one borrowed mutably,
            // one shared); the loads are unaligned loads; each store's
            // address is 16-byte aligned (`d` is 64-byte aligned by `head`,
            // `i` a multiple of 64), as `movntdq` requires; SSE2 is part of
            // every x86-64 CPU.
            unsafe {
                let a = _mm_loadu_si128(s.add(i).cast::<__m128i>());
                let b = _mm_loadu_si128(s.add(i + 16).cast::<__m128i>());
                let c = _mm_loadu_si128(s.add(i + 32).cast::<__m128i>());
                let e = _mm_loadu_si128(s.add(i + 48).cast::<__m128i>());
                _mm_stream_si128(d.add(i).cast::<__m128i>(), a);
                _mm_stream_si128(d.add(i + 16).cast::<__m128i>(), b);
                _mm_stream_si128(d.add(i + 32).cast::<__m128i>(), c);
                _mm_stream_si128(d.add(i + 48).cast::<__m128i>(), e);
            }
            i += LINE;
        }
        // Non-temporal stores are weakly ordered: fence them before any
        // later store (the lock or flag that says the fill is done).
        // SAFETY: `sfence` has no operands; SSE is part of every x86-64 CPU.
        unsafe { _mm_sfence() };
        d_tail.copy_from_slice(s_tail);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The streaming copy writes exactly what `copy_from_slice` writes, for
    /// destinations at every alignment within a line, lengths on both
    /// sides of the streaming threshold and of a line, and nothing outside
    /// the destination. Seen red (2026-12-03) with the tail left uncopied
    /// and with the body's loads read from the head's end.
    #[test]
    fn a_streaming_copy_writes_what_a_plain_copy_writes() {
        let src: Vec<u8> = (0..(STREAMING_MIN_BYTES * 3) as u64)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for len in [
            0,
            1,
            63,
            64,
            STREAMING_MIN_BYTES - 1,
            STREAMING_MIN_BYTES,
            STREAMING_MIN_BYTES + 1,
            STREAMING_MIN_BYTES + 63,
            2 * STREAMING_MIN_BYTES + 17,
        ] {
            for at in [0usize, 1, 15, 16, 33, 63] {
                for from in [0usize, 3] {
                    let mut out = vec![0xA5u8; len + at + 64];
                    copy_streaming(&mut out[at..at + len], &src[from..from + len]);
                    assert!(
                        out[at..at + len] == src[from..from + len],
                        "{len} bytes at {at} from {from}"
                    );
                    assert!(
                        out[..at].iter().chain(&out[at + len..]).all(|&b| b == 0xA5),
                        "{len} bytes at {at}: outside the destination"
                    );
                }
            }
        }
    }

    #[test]
    #[should_panic(expected = "lengths differ")]
    fn lengths_that_differ_panic_as_copy_from_slice_does() {
        copy_streaming(&mut [0u8; 4], &[0u8; 5]);
    }
}
