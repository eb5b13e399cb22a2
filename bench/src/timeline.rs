//! One traced step of a run, read back from the GPU's own events
//! (`offload_cuda` timeline: an event pair around every host→device copy
//! and around every block's compute): written as the Chrome/Perfetto trace
//! the simulator writes, and summarised as where compute waited and where
//! the copy engine idled.

use std::collections::BTreeMap;

use offload_cuda::TimelineSpan;
use offload_sim::trace::{Trace, TraceOp};
use serde::Serialize;

/// The compute track's label.
pub(crate) const COMPUTE: &str = "compute";
/// Every other track carries the engine's copies.
pub(crate) const COPY: &str = "copy";

/// Where one traced step spent its time, seconds.
#[derive(Clone, Debug, Default, Serialize)]
pub(crate) struct Analysis {
    /// First block compute start to last block compute end.
    pub window_s: f64,
    /// Sum of block compute spans.
    pub compute_busy_s: f64,
    /// Window less compute busy: compute waiting (for copies, or for the
    /// host to launch).
    pub compute_idle_s: f64,
    /// Of which: gaps before a block whose copy ended less than 20 µs
    /// before it began (waiting for its copy).
    pub compute_wait_copy_s: f64,
    /// Copies within the window.
    pub copy_busy_s: f64,
    /// Window less copy busy: the copy engine idle.
    pub copy_idle_s: f64,
    /// Bytes the step copied.
    pub copied_bytes: u64,
    /// Copy bandwidth while copying, GB/s.
    pub copy_gbps: f64,
    /// Mean compute of blocks by kind (the path's container), seconds.
    pub block_compute_s: BTreeMap<String, f64>,
    /// Mean copy of blocks by size class (bytes → seconds).
    pub copy_s_by_bytes: BTreeMap<u64, f64>,
    /// Each block's compute, seconds, by path.
    #[serde(skip)]
    pub per_block_s: BTreeMap<String, f64>,
}

/// The bytes a copy span's name states (`h2d 680.0 MB …`), in bytes.
fn copy_bytes(name: &str) -> Option<u64> {
    let mb: f64 = name.strip_prefix("h2d ")?.split(' ').next()?.parse().ok()?;
    Some((mb * 1e6).round() as u64)
}

/// The spans as a trace, copy tracks named `copy`.
pub(crate) fn to_trace(spans: &[TimelineSpan]) -> Trace {
    let mut t = Trace::default();
    for s in spans {
        t.push(TraceOp {
            track: if s.track == COMPUTE { COMPUTE } else { COPY }.to_owned(),
            name: s.name.clone(),
            start_ns: s.start_ns,
            duration_ns: s.duration_ns,
        });
    }
    t
}

/// Reads a traced step: block spans are the compute track's spans whose
/// name is a block path (`transformer.…blocks.N`).
pub(crate) fn analyse(spans: &[TimelineSpan]) -> Analysis {
    let blocks: Vec<&TimelineSpan> = spans
        .iter()
        .filter(|s| s.track == COMPUTE && s.name.contains("blocks."))
        .collect();
    let copies: Vec<&TimelineSpan> = spans
        .iter()
        .filter(|s| s.track != COMPUTE && s.name.starts_with("h2d"))
        .collect();
    let (Some(first), Some(last)) = (blocks.first(), blocks.last()) else {
        return Analysis::default();
    };
    let (w0, w1) = (first.start_ns, last.start_ns + last.duration_ns);
    let ns = |v: u64| v as f64 / 1e9;
    let busy: u64 = blocks.iter().map(|s| s.duration_ns).sum();
    let mut wait_copy = 0u64;
    let mut prev_end = w0;
    for b in &blocks {
        let gap = b.start_ns.saturating_sub(prev_end);
        if gap > 0
            && copies.iter().any(|c| {
                let end = c.start_ns + c.duration_ns;
                end <= b.start_ns && b.start_ns - end < 20_000
            })
        {
            wait_copy += gap;
        }
        prev_end = b.start_ns + b.duration_ns;
    }
    let clip = |s: &TimelineSpan| {
        let a = s.start_ns.max(w0);
        let b = (s.start_ns + s.duration_ns).min(w1);
        b.saturating_sub(a)
    };
    let copy_busy: u64 = copies.iter().map(|s| clip(s)).sum();
    let copy_total: u64 = copies.iter().map(|s| s.duration_ns).sum();
    let copied: u64 = copies.iter().filter_map(|s| copy_bytes(&s.name)).sum();
    let mut kinds: BTreeMap<String, (f64, u32)> = BTreeMap::new();
    let mut per_block = BTreeMap::new();
    for b in &blocks {
        let kind = b
            .name
            .rsplit_once('.')
            .map_or(b.name.as_str(), |(k, _)| k)
            .rsplit('.')
            .next()
            .unwrap_or("")
            .to_owned();
        let e = kinds.entry(kind).or_default();
        e.0 += ns(b.duration_ns);
        e.1 += 1;
        per_block.insert(b.name.clone(), ns(b.duration_ns));
    }
    let mut sizes: BTreeMap<u64, (f64, u32)> = BTreeMap::new();
    for c in &copies {
        if let Some(bytes) = copy_bytes(&c.name) {
            let e = sizes.entry(bytes).or_default();
            e.0 += ns(c.duration_ns);
            e.1 += 1;
        }
    }
    let window = w1 - w0;
    Analysis {
        window_s: ns(window),
        compute_busy_s: ns(busy),
        compute_idle_s: ns(window.saturating_sub(busy)),
        compute_wait_copy_s: ns(wait_copy),
        copy_busy_s: ns(copy_busy),
        copy_idle_s: ns(window.saturating_sub(copy_busy)),
        copied_bytes: copied,
        copy_gbps: if copy_total > 0 {
            copied as f64 / copy_total as f64
        } else {
            0.0
        },
        block_compute_s: kinds
            .into_iter()
            .map(|(k, (s, n))| (k, s / f64::from(n)))
            .collect(),
        copy_s_by_bytes: sizes
            .into_iter()
            .map(|(k, (s, n))| (k, s / f64::from(n)))
            .collect(),
        per_block_s: per_block,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(track: &str, name: &str, start: u64, dur: u64) -> TimelineSpan {
        TimelineSpan {
            track: track.to_owned(),
            name: name.to_owned(),
            start_ns: start,
            duration_ns: dur,
        }
    }

    /// Two blocks; the second waits 5 µs for its copy; the copy engine is
    /// busy 10 of the 25 µs window.
    #[test]
    fn waits_and_idles_are_read_from_the_spans() {
        let spans = [
            span(COMPUTE, "t.transformer_blocks.0", 0, 10_000),
            span("stream 0x1", "h2d 1.0 MB pinned → dev 0x0+0", 5_000, 10_000),
            span(COMPUTE, "t.single_transformer_blocks.0", 15_000, 10_000),
        ];
        let a = analyse(&spans);
        assert!((a.window_s - 25e-6).abs() < 1e-12, "{a:?}");
        assert!((a.compute_idle_s - 5e-6).abs() < 1e-12, "{a:?}");
        assert!((a.compute_wait_copy_s - 5e-6).abs() < 1e-12, "{a:?}");
        assert!((a.copy_idle_s - 15e-6).abs() < 1e-12, "{a:?}");
        assert_eq!(a.copied_bytes, 1_000_000);
        assert!((a.copy_gbps - 100.0).abs() < 1e-9, "{a:?}");
        assert_eq!(a.block_compute_s.len(), 2);
        assert_eq!(a.per_block_s.len(), 2);
    }
}
