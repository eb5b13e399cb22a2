//! The ring engine's schedule as a recurrence: what a stack's forwards take
//! with some blocks resident and the rest streamed through `depth + 1`
//! slots (the engine of `runtime/layerwise.rs`, on the copy and compute
//! streams).
//!
//! Fills run in order on one copy stream; the fill of streamed block j
//! starts after the fill before it and after the compute of streamed block
//! j − depth − 1 (whose slot it takes); block i computes after block i − 1
//! and, if streamed, after its fill; the part of it a running fill overlaps
//! takes `1 + interference` times longer. A phase starts cold (its slots
//! are filled on demand: the planned backend allocates a phase's slots when
//! it begins), so its first forward pays the first fill.

/// How many forwards the recurrence runs: the first (cold) and two more,
/// whose difference is the steady state.
const FORWARDS: usize = 3;

/// The end times of the first three forwards of one stack, starting cold at
/// time 0 (seconds): `compute_s[i]` and `copy_s[i]` of block i, which
/// blocks are `resident`, the prefetch `depth`, the stack's compute outside
/// its blocks `other_s` (run before block 0 of each forward), and the copy
/// `interference`.
pub fn forward_ends(
    compute_s: &[f64],
    copy_s: &[f64],
    resident: &[bool],
    depth: usize,
    other_s: f64,
    interference: f64,
) -> [f64; FORWARDS] {
    let n = compute_s.len();
    let streamed: Vec<usize> = (0..n).filter(|&i| !resident[i]).collect();
    let m = streamed.len();
    let mut t_compute = 0.0f64; // end of the last compute
    let mut t_copy = 0.0f64; // end of the last fill
    // End of compute of each streamed block, in fill order.
    let mut done: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let mut filled: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let mut starts: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let mut ends = [0.0f64; FORWARDS];
    let depth = depth.min(m.saturating_sub(1)).max(1);
    // Fills are computed lazily in order: fill k needs only the compute of
    // streamed block k − depth − 1, always known by the time it is asked.
    let fill = |g: usize,
                done: &Vec<f64>,
                filled: &mut Vec<f64>,
                starts: &mut Vec<f64>,
                t_copy: &mut f64| {
        while filled.len() <= g {
            let k = filled.len();
            let slot_free = if k > depth {
                done.get(k - depth - 1).copied().unwrap_or(f64::INFINITY)
            } else {
                0.0
            };
            let start = t_copy.max(slot_free);
            starts.push(start);
            *t_copy = start + copy_s[streamed[k % m]];
            filled.push(*t_copy);
        }
        filled[g]
    };
    for end in ends.iter_mut() {
        t_compute += other_s;
        for i in 0..n {
            let start = if resident[i] {
                t_compute
            } else {
                let g = done.len();
                let ready = fill(g, &done, &mut filled, &mut starts, &mut t_copy);
                t_compute.max(ready)
            };
            // Fills are issued up to `depth` streamed blocks ahead; one
            // still running slows this block's kernels.
            if m > 0 {
                let ahead = done.len() + usize::from(!resident[i]) + depth - 1;
                fill(ahead, &done, &mut filled, &mut starts, &mut t_copy);
            }
            let copying = filled
                .iter()
                .zip(&starts)
                .rev()
                .take(depth + 2)
                .find(|(end, s)| **s <= start && start < **end)
                .map_or(0.0, |(end, _)| (end - start).min(compute_s[i]));
            t_compute = start + compute_s[i] + copying * interference;
            if !resident[i] {
                done.push(t_compute);
            }
        }
        *end = t_compute;
    }
    ends
}

/// The steady-state time of one forward (seconds): what a forward takes
/// once the ring wraps around from the forward before.
pub fn predict_step(
    compute_s: &[f64],
    copy_s: &[f64],
    resident: &[bool],
    depth: usize,
    other_s: f64,
    interference: f64,
) -> f64 {
    let ends = forward_ends(compute_s, copy_s, resident, depth, other_s, interference);
    ends[FORWARDS - 1] - ends[FORWARDS - 2]
}

/// The time of `forwards` consecutive forwards starting cold (seconds):
/// the first forward as the recurrence runs it, then the steady state for
/// the rest; fewer than one forward scales the first.
pub fn forwards_s(ends: &[f64; FORWARDS], forwards: f64) -> f64 {
    if forwards <= 0.0 {
        0.0
    } else if forwards < 1.0 {
        ends[0] * forwards
    } else {
        ends[0] + (forwards - 1.0) * (ends[2] - ends[1])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Transfer-bound, uniform blocks, depth 1: the step is the copies.
    #[test]
    fn transfer_bound_ring_is_the_copies() {
        let n = 10;
        let t = predict_step(&vec![1.0; n], &vec![2.0; n], &vec![false; n], 1, 0.0, 0.0);
        assert!((t - 20.0).abs() < 1e-9, "{t}");
    }

    /// Compute-bound: the step is the compute.
    #[test]
    fn compute_bound_ring_is_the_compute() {
        let n = 10;
        let t = predict_step(&vec![2.0; n], &vec![1.0; n], &vec![false; n], 1, 0.0, 0.0);
        assert!((t - 20.0).abs() < 1e-9, "{t}");
    }

    /// A long compute followed by a short copy idles the copy engine at
    /// depth 1; depth 2 hides it.
    #[test]
    fn heterogeneous_blocks_idle_the_link_at_depth_one() {
        let compute = [3.0, 3.0, 0.8, 0.8, 0.8, 0.8];
        let copy = [3.0, 3.0, 1.0, 1.0, 1.0, 1.0];
        let res = [false; 6];
        let d1 = predict_step(&compute, &copy, &res, 1, 0.0, 0.0);
        let d2 = predict_step(&compute, &copy, &res, 2, 0.0, 0.0);
        assert!(d1 > 10.0 + 1e-9, "depth 1: {d1}");
        assert!(d2 < d1, "depth 2 {d2} vs depth 1 {d1}");
    }

    /// A kernel that starts beside a running fill is slowed for the part
    /// the fill overlaps.
    #[test]
    fn copies_slow_the_kernels_they_overlap() {
        let t = predict_step(&[10.0; 2], &[1.0; 2], &[false; 2], 1, 0.0, 0.5);
        assert!((t - 21.0).abs() < 1e-9, "{t}");
        let none = predict_step(&[10.0; 2], &[1.0; 2], &[false; 2], 1, 0.0, 0.0);
        assert!((none - 20.0).abs() < 1e-9, "{none}");
    }

    /// Resident blocks take their compute but no copy.
    #[test]
    fn resident_blocks_cost_compute_only() {
        let t = predict_step(&[1.0; 4], &[5.0; 4], &[true; 4], 1, 0.5, 0.0);
        assert!((t - 4.5).abs() < 1e-9, "{t}");
    }

    /// A cold phase pays its first fill once: n transfer-bound forwards of
    /// copies c and computes k take one k more than n copies.
    #[test]
    fn a_cold_phase_pays_the_first_fill_once() {
        let ends = forward_ends(&[1.0; 4], &[2.0; 4], &[false; 4], 1, 0.0, 0.0);
        // First forward: 4 copies back to back, the last block computes after its copy.
        assert!((ends[0] - 9.0).abs() < 1e-9, "{ends:?}");
        let t = forwards_s(&ends, 5.0);
        assert!((t - (9.0 + 4.0 * 8.0)).abs() < 1e-9, "{t}");
        assert!((forwards_s(&ends, 0.5) - 4.5).abs() < 1e-9);
    }
}
