//! The ring engine's schedule as a recurrence: what a stack's forwards take
//! with some blocks resident and the rest streamed through `depth + 1`
//! slots (the engine of `runtime/layerwise.rs`, on the copy and compute
//! streams).
//!
//! Fills run in order on one copy stream; the fill of streamed block j
//! starts after the fill before it and after the compute of streamed block
//! j − depth − 1 (whose slot it takes); block i computes after block i − 1
//! and, if streamed, after its fill; the part of it that fills overlap
//! takes `1 + interference` times longer. A phase starts cold (its slots
//! are filled on demand: the planned backend allocates a phase's slots when
//! it begins), so its first forward pays the first fill.

use super::types::BudgetError;

/// Relative difference below which two predicted times are equal (the
/// planner's tie, and the chooser's knee).
pub(super) const TIE: f64 = 1e-3;

/// How much of its overlap with a running decode a kernel loses, as the
/// planner assumes where its inputs carry no measured figure
/// (`PlannerInputs::decode_interference`, CONTRACT §7b): fitted on the
/// H200's timeline of 2026-12-02 (BENCHMARKS.md, "Lossless weight
/// compression"), where a block's compute grew by 0.79–1.08 of the decodes
/// beside it (Flux's double and single blocks at 12,288 and 16,896
/// tokens, coded against uncoded: the decode takes the SMs and a third of
/// the memory bandwidth while it runs); the simulator's profiles use it
/// too. The H100's coded forwards at 16 GiB (2026-12-05) ran 6.5–9.1 ms
/// over predictions that charged their 8.7–8.9 ms of decodes next to
/// nothing (the recurrence then counted only the decode running when a
/// block started): about 0.75–1.06 of each decode, not the 1.7–2 first
/// read from them. The planned backend measures the card's own figure
/// where a plan streams coded blocks.
pub const DECODE_INTERFERENCE: f64 = 0.9;

/// The largest decode interference the planner accepts: a decode costing
/// the kernels beside it four times its own duration. (Above it, a
/// measurement is noise or another process's work, and coding would not
/// pay anyway.)
pub const MAX_DECODE_INTERFERENCE: f64 = 4.0;

/// The deepest prefetch the planner and the chooser accept.
pub(super) const MAX_DEPTH: usize = 64;

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
    staged_ends(
        compute_s,
        copy_s,
        None,
        resident,
        depth,
        other_s,
        interference,
    )
}

/// The decode stage of a coded ring (CONTRACT §7b): each streamed block's
/// decode, seconds, and how much of a decode's overlap a kernel beside it
/// loses.
#[derive(Clone, Copy, Debug)]
pub struct DecodeStage<'a> {
    /// Decode of each block, seconds (forward order; resident blocks'
    /// entries unused).
    pub decode_s: &'a [f64],
    /// How much of the overlap with a running decode a kernel loses (0 to
    /// [`MAX_DECODE_INTERFERENCE`]: above 1 where a decode costs the
    /// kernels beside it more than its own duration).
    pub interference: f64,
}

/// The host stage of a ring whose masters are partly staged (CONTRACT
/// §7c): which blocks stream staged, and each one's host fill into a
/// pinned staging buffer, seconds (its bytes over the host's fill rate, as
/// the warm-up measures it). The schedule is the filler thread's, part by
/// part (a block within a staging buffer is one part): one fill at a
/// time, in ring order; part q's fill starts once the fill before it has
/// ended and once the copy out of its buffer, part q − `buffers`'s, has
/// ended; its copy starts after its fill, the copy before it and (its
/// block's first) the slot's last use. A raw block's prefetch is queued
/// and its parts issued as they fill; only its own pre-forward waits for
/// them, so a block's kernels launch once its own fills are in, never
/// waiting for a later block's; a coded block's are all issued by the prefetching
/// hook (its decode follows), so that block's kernels wait for its fills.
#[derive(Clone, Copy, Debug)]
pub struct HostStage<'a> {
    /// Whether each block (forward order) streams staged.
    pub staged: &'a [bool],
    /// Host fill of each block, seconds (entries of blocks not staged
    /// unused).
    pub fill_s: &'a [f64],
    /// Staging buffers the fills cycle through, each of `part_bytes`
    /// ([`crate::budget::host::staging_layout`]; one where the device
    /// refused the rest, so each fill waits for the copy before it).
    pub buffers: usize,
    /// Each block's staged bytes (entries of blocks not staged unused).
    pub bytes: &'a [u64],
    /// The most bytes one staging buffer holds: a staged block larger
    /// than it is filled and copied in parts of it, in order, each part's
    /// copy after its own fill (the last part the rest).
    pub part_bytes: u64,
    /// The host→device rate of a staged stream, bytes per second, where
    /// measured ([`crate::budget::PlannerInputs::staged_stream_bytes_per_s`]):
    /// a fill and the DMA beside it share the host's memory, so a staged
    /// block's copy runs at it (never faster than its copy at the link).
    /// `None`: at the link.
    pub stream_bytes_per_s: Option<f64>,
}

/// A staged block's whole copy beside the host's fills, seconds: `copy_s`
/// (its copy at the link), or its staged `bytes` at the staged stream's
/// rate where one is given and that is longer. The one pricing of a copy
/// beside the fills: the recurrence's host stage and the request
/// planner's reasons both take it.
pub(crate) fn copy_beside_fills(copy_s: f64, bytes: u64, stream_bytes_per_s: Option<f64>) -> f64 {
    match stream_bytes_per_s {
        Some(rate) if rate > 0.0 => copy_s.max(bytes as f64 / rate),
        _ => copy_s,
    }
}

impl HostStage<'_> {
    /// Staged block `block`'s whole copy, seconds: `copy_s` (at the link),
    /// or its staged bytes at the staged stream's rate where that is
    /// slower (the DMA beside the fills).
    fn staged_copy_s(&self, block: usize, copy_s: f64) -> f64 {
        copy_beside_fills(
            copy_s,
            self.bytes.get(block).copied().unwrap_or(0),
            self.stream_bytes_per_s,
        )
    }

    /// The share of block `block`'s bytes each of its parts holds, in
    /// order (one part of 1.0 for a block within a staging buffer).
    fn part_fractions(&self, block: usize) -> impl Iterator<Item = f64> + use<> {
        let bytes = self.bytes.get(block).copied().unwrap_or(0);
        let part = self.part_bytes.max(1);
        let parts = bytes.div_ceil(part).max(1);
        (0..parts).map(move |p| {
            if bytes == 0 {
                1.0
            } else {
                (bytes - p * part).min(part) as f64 / bytes as f64
            }
        })
    }
}

/// The fills of [`staged_ends`], computed lazily in order: fill k needs
/// only the compute of streamed block k − depth − 1, always known by the
/// time it is asked.
#[derive(Default)]
struct Fills {
    depth: usize,
    /// End of the last copy, of the last decode and of the last host fill.
    t_copy: f64,
    t_decode: f64,
    t_host: f64,
    /// When each fill's block is ready.
    filled: Vec<f64>,
    /// When each fill's host stage (staged blocks) ended; 0 for the rest.
    hosted: Vec<f64>,
    /// Each fill's copy window, and (coded) its decode's.
    copies: Vec<(f64, f64)>,
    decodes: Vec<(f64, f64)>,
    /// The copy windows of staged fills, in order (their buffers' reuse).
    staged_copies: Vec<(f64, f64)>,
}

impl Fills {
    /// Room for `fills` fills (no reallocation while the recurrence runs,
    /// the planner's search runs it a million times a plan, except where a
    /// staged block's parts push more copy windows than fills).
    fn new(depth: usize, fills: usize) -> Self {
        Self {
            depth,
            filled: Vec::with_capacity(fills),
            hosted: Vec::with_capacity(fills),
            copies: Vec::with_capacity(fills),
            decodes: Vec::with_capacity(fills),
            staged_copies: Vec::with_capacity(fills),
            ..Self::default()
        }
    }

    /// When fill `g` (of streamed block `streamed[g % m]`) is ready.
    fn fill(
        &mut self,
        g: usize,
        done: &[f64],
        streamed: &[usize],
        copy_s: &[f64],
        (decode, host): (Option<DecodeStage<'_>>, Option<HostStage<'_>>),
    ) -> f64 {
        let m = streamed.len();
        while self.filled.len() <= g {
            let k = self.filled.len();
            let slot_free = if k > self.depth {
                done.get(k - self.depth - 1)
                    .copied()
                    .unwrap_or(f64::INFINITY)
            } else {
                0.0
            };
            let block = streamed[k % m];
            // What the copy into its destination waits for besides the
            // copy before it: the slot's last use, or (coded) the decode
            // that last read the device staging buffer (two of them).
            let gate = match decode {
                None => slot_free,
                Some(_) if k >= 2 => self.decodes[k - 2].1,
                Some(_) => 0.0,
            };
            // The host stage: each part's fill after the fill before it and
            // after the copy out of its staging buffer (`buffers` staged
            // parts back); each part's copy after its fill.
            let staged = host.is_some_and(|h| h.staged[block]);
            let hosted = match host {
                Some(h) if staged => {
                    let buffers = h.buffers.max(1);
                    let whole = h.staged_copy_s(block, copy_s[block]);
                    for frac in h.part_fractions(block) {
                        let q = self.staged_copies.len();
                        let buffer_free = if q >= buffers {
                            self.staged_copies[q - buffers].1
                        } else {
                            0.0
                        };
                        self.t_host = self.t_host.max(buffer_free) + h.fill_s[block] * frac;
                        let start = self.t_copy.max(gate).max(self.t_host);
                        self.t_copy = start + whole * frac;
                        self.staged_copies.push((start, self.t_copy));
                        // Each part's own window: between parts the copy
                        // engine waits for the host, slowing no kernel.
                        self.copies.push((start, self.t_copy));
                    }
                    self.t_host
                }
                _ => {
                    let start = self.t_copy.max(gate);
                    self.t_copy = start + copy_s[block];
                    self.copies.push((start, self.t_copy));
                    0.0
                }
            };
            self.hosted.push(hosted);
            match decode {
                None => self.filled.push(self.t_copy),
                Some(d) => {
                    let d_start = self.t_copy.max(slot_free).max(self.t_decode);
                    self.t_decode = d_start + d.decode_s[block];
                    self.decodes.push((d_start, self.t_decode));
                    self.filled.push(self.t_decode);
                }
            }
        }
        self.filled[g]
    }
}

/// [`forward_ends`] with the fills of a coded ring when `decode` is given:
/// the copy of streamed block k (its coded bytes, `copy_s`) starts after
/// the copy before it and after the decode of block k − 2 (which read the
/// staging buffer it overwrites: two staging buffers); its decode starts
/// after that copy, after the decode before it and after the compute of
/// streamed block k − depth − 1 (whose slot it writes); the block is ready
/// when its decode ends. A kernel loses `interference` of its overlap with
/// a running copy and `decode.interference` of its overlap with a running
/// decode.
pub fn staged_ends(
    compute_s: &[f64],
    copy_s: &[f64],
    decode: Option<DecodeStage<'_>>,
    resident: &[bool],
    depth: usize,
    other_s: f64,
    interference: f64,
) -> [f64; FORWARDS] {
    hosted_ends(
        compute_s,
        copy_s,
        (decode, None),
        resident,
        depth,
        other_s,
        interference,
    )
}

/// [`staged_ends`] with the host stage of staged masters (`host`, CONTRACT
/// §7c; [`HostStage`] gives its schedule) where given.
pub fn hosted_ends(
    compute_s: &[f64],
    copy_s: &[f64],
    stages: (Option<DecodeStage<'_>>, Option<HostStage<'_>>),
    resident: &[bool],
    depth: usize,
    other_s: f64,
    interference: f64,
) -> [f64; FORWARDS] {
    let decode = stages.0;
    let n = compute_s.len();
    let streamed: Vec<usize> = (0..n).filter(|&i| !resident[i]).collect();
    let m = streamed.len();
    let mut t_compute = 0.0f64; // end of the last compute
    // End of compute of each streamed block, in fill order.
    let mut done: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let depth = depth.min(m.saturating_sub(1)).max(1);
    let mut fills = Fills::new(depth, m * FORWARDS + depth + 1);
    let mut ends = [0.0f64; FORWARDS];
    // Every issued fill's window within the kernel's own time, not only
    // the one running when it starts: a coded ring's decodes are short
    // beside a block and, where the copy (not a slot) paces them, start
    // anywhere within it; counted at the start only, a compute-bound
    // ring's decodes were charged almost nothing (Flux.1-dev at 16 GiB
    // on the H100's inputs: about 0.16 ms of 8.9 ms of decodes per
    // forward). Issued means up to `ahead` below, as the simulated device
    // charges a kernel for the fills enqueued before it; a fill the
    // recurrence starts before its hook issues it (its slot freed early)
    // is not charged to the kernels it overlaps before then (on that
    // plan about 0.17 ms of 8.7 ms of decode overlap a forward), where a
    // GPU would slow them. Windows are in order and never overlap each
    // other (one copy stream, one decode stream).
    // A staged block's copy is one window per part: as many more recent
    // windows as the most parts a block takes.
    let most_parts = stages.1.map_or(1, |h| {
        (0..n)
            .filter(|&i| h.staged.get(i).copied().unwrap_or(false))
            .map(|i| h.part_fractions(i).count())
            .max()
            .unwrap_or(1)
    });
    let overlap = |windows: &[(f64, f64)], start: f64, compute: f64| {
        overlap_s(windows, (depth + 3) * most_parts, start, compute)
    };
    let decode_k = decode.map_or(0.0, |d| d.interference);
    // Fills issued so far (by the pre-forwards before this block).
    let mut issued = 0usize;
    for end in ends.iter_mut() {
        t_compute += other_s;
        for i in 0..n {
            let mut start = if resident[i] {
                t_compute
            } else {
                let g = done.len();
                t_compute.max(fills.fill(g, &done, &streamed, copy_s, stages))
            };
            // Fills are issued up to `depth` streamed blocks ahead; those
            // running within this block's kernels slow them. A staged one's
            // hook waits for its host fill before this block launches.
            let (copying, decoding) = if m > 0 {
                let ahead = done.len() + usize::from(!resident[i]) + depth - 1;
                fills.fill(ahead, &done, &streamed, copy_s, stages);
                if stages.1.is_some() {
                    if decode.is_some() {
                        // A coded staged block's parts are all issued at its
                        // prefetch: that hook waits for their fills.
                        for k in issued..=ahead {
                            start = start.max(fills.hosted[k]);
                        }
                    } else {
                        // A raw one is queued: its parts are issued as
                        // they fill, and only the hook of the block itself
                        // waits for them (its fill is in before its copy,
                        // above).
                        if !resident[i] {
                            start = start.max(fills.hosted[done.len()]);
                        }
                    }
                }
                issued = issued.max(ahead + 1);
                (
                    overlap(&fills.copies, start, compute_s[i]),
                    overlap(&fills.decodes, start, compute_s[i]),
                )
            } else {
                (0.0, 0.0)
            };
            t_compute = start + compute_s[i] + copying * interference + decoding * decode_k;
            if !resident[i] {
                done.push(t_compute);
            }
        }
        *end = t_compute;
    }
    ends
}

/// How long the last `recent` of `windows` (one stream's, in order and
/// apart: each starts at or after the one before ends) overlap a kernel
/// running from `start` for `compute` seconds, at most `compute`. The
/// windows that start before the kernel ends are a prefix, and before the
/// last of them that ends by `start` none overlaps it: the sum runs
/// between the two, newest first, and equals the sum over all `recent`
/// (each clamped at 0) to the bit (a zero perhaps signed) wherever the
/// windows' times are neither negative nor NaN, which every caller in
/// this crate checks
/// (`tests::the_overlap_walk_sums_what_every_window_adds`).
fn overlap_s(windows: &[(f64, f64)], recent: usize, start: f64, compute: f64) -> f64 {
    let end = start + compute;
    let recent = &windows[windows.len().saturating_sub(recent)..];
    recent[..recent.partition_point(|(s, _)| *s < end)]
        .iter()
        .rev()
        .take_while(|(_, e)| *e > start)
        .map(|(s, e)| (e.min(end) - s.max(start)).max(0.0))
        .sum::<f64>()
        .min(compute)
}

/// The steady state of [`hosted_ends`]' (or [`forward_ends`]') three
/// forwards: what one forward takes once the ring wraps around, seconds.
pub fn steady_s(ends: &[f64; FORWARDS]) -> f64 {
    ends[FORWARDS - 1] - ends[FORWARDS - 2]
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

/// One stack's ring as the look-ahead chooser sees it: per block (forward
/// order) its compute and its copy (seconds), whether it stays resident,
/// the stack's compute outside its blocks and the copy interference.
#[derive(Clone, Copy, Debug)]
pub struct RingShape<'a> {
    /// Compute of each block, seconds.
    pub compute_s: &'a [f64],
    /// Copy of each block from its host master, seconds.
    pub copy_s: &'a [f64],
    /// Which blocks stay resident (never streamed).
    pub resident: &'a [bool],
    /// Compute of one forward outside the blocks, seconds.
    pub other_s: f64,
    /// How much a running copy slows the kernels it overlaps (0 to 1).
    pub interference: f64,
}

impl RingShape<'_> {
    /// `max(compute, streamed copies)` of one forward (seconds): what no
    /// schedule beats (docs/PERFORMANCE.md, "The limit").
    pub fn limit_s(&self) -> f64 {
        let compute: f64 = self.compute_s.iter().sum::<f64>() + self.other_s;
        let copy: f64 = self
            .copy_s
            .iter()
            .zip(self.resident)
            .filter(|(_, r)| !**r)
            .map(|(c, _)| c)
            .sum();
        compute.max(copy)
    }
}

/// The look-ahead a ring runs at, chosen by [`choose_lookahead`]: how many
/// blocks the copy engine may run ahead of compute (`depth`, through
/// `depth + 1` slots of `slot_bytes`), the device memory the slots take,
/// and what the recurrence predicts of one steady-state forward.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct Lookahead {
    /// Blocks prefetched ahead of the computing one (wrapping into the next
    /// forward's first blocks).
    pub depth: usize,
    /// Slots: `depth + 1`.
    pub slots: usize,
    /// Bytes of one slot (the largest streamed block).
    pub slot_bytes: u64,
    /// Device memory the slots take: `slots × slot_bytes`.
    pub slot_memory_bytes: u64,
    /// The recurrence's steady-state forward at this depth, seconds.
    pub predicted_step_s: f64,
    /// `max(compute, streamed copies)`, seconds; with staged masters
    /// ([`choose_staged_lookahead`]) the host's fills too.
    pub limit_s: f64,
}

/// The look-ahead of a ring measured in time and bytes rather than a fixed
/// count of blocks: one deeper than the shallowest depth (1 to
/// `max_depth`, its slots within `max_slot_memory_bytes` when given) whose
/// steady-state forward, by the recurrence, is as short as any depth
/// allowed gives (within the planner's tie, a thousandth); the one slot
/// beyond that knee is the margin for a block that lands late. Where copies longer than compute follow
/// one another (Flux's double blocks near the crossover), the copy engine
/// must have run that far ahead during the compute-bound stretch before
/// (the single blocks, wrapping into the next forward), and only the
/// recurrence knows how far that is.
///
/// Fails (typed) on unusable input: lengths that differ, a time that is
/// not a finite number ≥ 0, an interference above 1, a `max_depth`
/// outside 1 to 64, or a memory cap below two slots.
pub fn choose_lookahead(
    shape: &RingShape<'_>,
    slot_bytes: u64,
    max_depth: usize,
    max_slot_memory_bytes: Option<u64>,
) -> Result<Lookahead, BudgetError> {
    let n = shape.compute_s.len();
    if shape.copy_s.len() != n || shape.resident.len() != n {
        return bad(
            "ring shape",
            format!(
                "{n} computes, {} copies, {} residency flags",
                shape.copy_s.len(),
                shape.resident.len()
            ),
            "one compute, one copy and one residency flag per block",
        );
    }
    let finite = |v: f64| v.is_finite() && v >= 0.0;
    if !shape
        .compute_s
        .iter()
        .chain(shape.copy_s)
        .all(|v| finite(*v))
        || !finite(shape.other_s)
    {
        return bad(
            "ring shape",
            "a time that is negative or not finite".to_owned(),
            "finite times ≥ 0, seconds",
        );
    }
    if !finite(shape.interference) || shape.interference > 1.0 {
        return bad(
            "copy_interference",
            shape.interference.to_string(),
            "a finite number from 0 to 1",
        );
    }
    let depths = allowed_depths(slot_bytes, max_depth, max_slot_memory_bytes)?;
    let predicted: Vec<f64> = (1..=depths)
        .map(|d| {
            predict_step(
                shape.compute_s,
                shape.copy_s,
                shape.resident,
                d,
                shape.other_s,
                shape.interference,
            )
        })
        .collect();
    Ok(knee(&predicted, slot_bytes, shape.limit_s()))
}

/// A chooser's typed error: `input` was `value`; `allowed` is what it takes.
fn bad<T>(input: &str, value: String, allowed: &str) -> Result<T, BudgetError> {
    Err(BudgetError::Input {
        input: input.to_owned(),
        value,
        allowed: allowed.to_owned(),
    })
}

/// A chooser's `max_depth`: 1 to 64, else a typed error naming it.
pub(crate) fn check_max_depth(max_depth: usize) -> Result<(), BudgetError> {
    if !(1..=MAX_DEPTH).contains(&max_depth) {
        return bad("max_depth", max_depth.to_string(), "1 to 64");
    }
    Ok(())
}

/// The deepest look-ahead a chooser may price: `max_depth` (1 to 64), and
/// where `max_slot_memory_bytes` is given, one fewer than the slots of
/// `slot_bytes` it holds (at least two). Typed errors otherwise.
fn allowed_depths(
    slot_bytes: u64,
    max_depth: usize,
    max_slot_memory_bytes: Option<u64>,
) -> Result<usize, BudgetError> {
    check_max_depth(max_depth)?;
    match max_slot_memory_bytes {
        None => Ok(max_depth),
        Some(cap) => {
            let fit = usize::try_from(cap / slot_bytes.max(1)).unwrap_or(usize::MAX);
            if fit < 2 {
                return bad(
                    "max_slot_memory_bytes",
                    cap.to_string(),
                    "at least two slots of the largest streamed block",
                );
            }
            Ok(max_depth.min(fit - 1))
        }
    }
}

/// The chooser's rule over `predicted[d − 1]`, the recurrence's forward at
/// each depth d from 1: one deeper than the knee, the shallowest depth as
/// short as the best (within [`TIE`]), where allowed.
fn knee(predicted: &[f64], slot_bytes: u64, limit_s: f64) -> Lookahead {
    let depths = predicted.len().max(1);
    let best = predicted.iter().copied().fold(f64::INFINITY, f64::min);
    // The knee: the shallowest depth as short as the best. One slot more
    // than the knee, where allowed: the recurrence knows no jitter, and a
    // block that lands late at the knee stalls compute (on the H200 at
    // 4,608 tokens, depth 1 ran at 1.043× the limit and depth 2 at 1.019×
    // where the recurrence predicts both alike).
    let knee = predicted
        .iter()
        .position(|t| *t <= best * (1.0 + TIE))
        .unwrap_or(0);
    let i = (knee + 1).min(depths - 1);
    let predicted_step_s = predicted.get(i).copied().unwrap_or(f64::NAN);
    let depth = i + 1;
    Lookahead {
        depth,
        slots: depth + 1,
        slot_bytes,
        slot_memory_bytes: (depth as u64 + 1).saturating_mul(slot_bytes),
        predicted_step_s,
        limit_s,
    }
}

/// What the recurrence forecasts of one ring whose masters are partly
/// staged (CONTRACT §7c), at the host fill rate its own fills ran at (and
/// its staged copies at the staged stream's rate, where measured): the
/// steady-state forward with the host stage ([`HostStage`]) and the
/// bounds beside it.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct StagedForecast {
    /// Blocks that stream staged.
    pub staged_blocks: usize,
    /// Bytes the host fills per forward (coded bytes for coded blocks).
    pub staged_bytes: u64,
    /// The host's fill rate the forecast assumes, bytes per second.
    pub fill_bytes_per_s: f64,
    /// The look-ahead it was forecast at (the depth asked, within 1 and the
    /// ring's streamed blocks − 1, as the recurrence runs it).
    pub depth: usize,
    /// The host staging buffers it was forecast with.
    pub buffers: usize,
    /// Bytes of each staging buffer (a larger block goes in parts).
    pub part_bytes: u64,
    /// The steady-state forward, seconds.
    pub forward_s: f64,
    /// Compute of one forward, seconds.
    pub compute_s: f64,
    /// Every streamed block's copy, seconds (the link).
    pub link_s: f64,
    /// The host's fills of one forward, seconds.
    pub fills_s: f64,
    /// The staged stream's rate the forecast priced staged copies at,
    /// bytes per second (`None`: at the link).
    pub stream_bytes_per_s: Option<f64>,
    /// Every streamed block's copy as the forecast priced it, seconds: a
    /// staged block's at the staged stream's rate where that is given and
    /// slower than the link (its DMA beside the fills, sharing the host's
    /// memory), the rest at the link. `link_s` where no rate is given.
    pub copies_s: f64,
}

impl StagedForecast {
    /// The staged path's own limit, seconds: the largest of compute, its
    /// copies as priced (`copies_s`) and the host's fills.
    pub fn limit_s(&self) -> f64 {
        self.compute_s.max(self.copies_s).max(self.fills_s)
    }

    /// The bound the forecast sits on: the largest of compute, the copies
    /// and the host's fills; the copies are "the host's memory" where the
    /// staged stream's rate made them longer than the link's.
    pub fn bound(&self) -> &'static str {
        if self.fills_s >= self.copies_s && self.fills_s >= self.compute_s {
            "the host's fills"
        } else if self.copies_s >= self.compute_s {
            if self.copies_s > self.link_s * (1.0 + TIE) {
                "the host's memory (the DMA beside the fills)"
            } else {
                "the link"
            }
        } else {
            "compute"
        }
    }
}

/// [`StagedForecast`] of `shape` with `host`'s staged blocks, each filled
/// at `fill_bytes_per_s` (`staged_bytes[i]` bytes for block i), at
/// `depth`, their copies at the link. Typed errors on unusable input, as
/// [`choose_lookahead`]'s, and on a fill rate that is not a finite number
/// above 0. [`StagedRing::forecast`] prices the copies beside the fills
/// where the staged stream's rate is given.
pub fn forecast_staged(
    shape: &RingShape<'_>,
    staged: &[bool],
    staged_bytes: &[u64],
    fill_bytes_per_s: f64,
    (depth, buffers, part_bytes): (usize, usize, u64),
) -> Result<StagedForecast, BudgetError> {
    forecast_beside(
        shape,
        staged,
        staged_bytes,
        (fill_bytes_per_s, None),
        (depth, buffers, part_bytes),
    )
}

/// [`forecast_staged`] with each staged block's copy at
/// `stream_bytes_per_s` where given ([`HostStage::stream_bytes_per_s`]); a
/// typed error where that is not a finite number above 0.
fn forecast_beside(
    shape: &RingShape<'_>,
    staged: &[bool],
    staged_bytes: &[u64],
    (fill_bytes_per_s, stream_bytes_per_s): (f64, Option<f64>),
    (depth, buffers, part_bytes): (usize, usize, u64),
) -> Result<StagedForecast, BudgetError> {
    let n = shape.compute_s.len();
    if staged.len() != n || staged_bytes.len() != n {
        return Err(BudgetError::Input {
            input: "staged ring shape".to_owned(),
            value: format!(
                "{n} computes, {} staged flags, {} staged sizes",
                staged.len(),
                staged_bytes.len()
            ),
            allowed: "one staged flag and one staged size per block".to_owned(),
        });
    }
    if !(fill_bytes_per_s.is_finite() && fill_bytes_per_s > 0.0) {
        return Err(BudgetError::Input {
            input: "host fill rate".to_owned(),
            value: fill_bytes_per_s.to_string(),
            allowed: "a finite number of bytes per second above 0".to_owned(),
        });
    }
    if let Some(rate) = stream_bytes_per_s
        && !(rate.is_finite() && rate > 0.0)
    {
        return Err(BudgetError::Input {
            input: "staged stream rate".to_owned(),
            value: rate.to_string(),
            allowed:
                "a finite number of bytes per second above 0, or none (staged copies at the link)"
                    .to_owned(),
        });
    }
    if buffers == 0 || part_bytes == 0 {
        return Err(BudgetError::Input {
            input: "host staging ring".to_owned(),
            value: format!("{buffers} buffers of {part_bytes} bytes"),
            allowed: "at least one buffer of at least one byte".to_owned(),
        });
    }
    // The shape's own checks (its depth plays no part in them).
    choose_lookahead(shape, 1, 1, None)?;
    // The look-ahead the recurrence runs (a ring of m streamed blocks looks
    // at most m − 1 ahead).
    let streamed_n = shape.resident.iter().filter(|r| !**r).count();
    let depth = depth
        .clamp(1, MAX_DEPTH)
        .min(streamed_n.saturating_sub(1))
        .max(1);
    let fill_s: Vec<f64> = staged_bytes
        .iter()
        .map(|&b| b as f64 / fill_bytes_per_s)
        .collect();
    let host = HostStage {
        staged,
        fill_s: &fill_s,
        buffers,
        bytes: staged_bytes,
        part_bytes,
        stream_bytes_per_s,
    };
    let ends = hosted_ends(
        shape.compute_s,
        shape.copy_s,
        (None, Some(host)),
        shape.resident,
        depth,
        shape.other_s,
        shape.interference,
    );
    let streamed = |i: usize| !shape.resident[i];
    Ok(StagedForecast {
        staged_blocks: (0..n).filter(|&i| staged[i] && streamed(i)).count(),
        staged_bytes: (0..n)
            .filter(|&i| staged[i] && streamed(i))
            .map(|i| staged_bytes[i])
            .sum(),
        fill_bytes_per_s,
        depth,
        buffers,
        part_bytes,
        forward_s: steady_s(&ends),
        compute_s: shape.compute_s.iter().sum::<f64>() + shape.other_s,
        link_s: (0..n)
            .filter(|&i| streamed(i))
            .map(|i| shape.copy_s[i])
            .sum(),
        stream_bytes_per_s,
        copies_s: (0..n)
            .filter(|&i| streamed(i))
            .map(|i| {
                if staged[i] {
                    host.staged_copy_s(i, shape.copy_s[i])
                } else {
                    shape.copy_s[i]
                }
            })
            .sum(),
        // The fills of the streamed staged blocks (a resident block is
        // never filled, whatever its flag).
        fills_s: (0..n)
            .filter(|&i| staged[i] && streamed(i))
            .map(|i| fill_s[i])
            .sum(),
    })
}

/// The host stage of a ring with staged masters (CONTRACT §7c) as
/// [`choose_staged_lookahead`] sees it: which blocks stream staged and
/// their staged bytes, the host's fill rate, and the staging ring (its
/// buffers and their bytes).
#[derive(Clone, Copy, Debug)]
pub struct StagedRing<'a> {
    /// Per block (forward order): whether it streams staged.
    pub staged: &'a [bool],
    /// Per block: the bytes its fill copies (coded bytes for a coded block).
    pub staged_bytes: &'a [u64],
    /// The host's fill rate, bytes per second.
    pub fill_bytes_per_s: f64,
    /// The host staging ring's buffers.
    pub buffers: usize,
    /// Bytes of each staging buffer (a larger block goes in parts).
    pub part_bytes: u64,
    /// The staged stream's host→device rate, bytes per second, where
    /// measured ([`HostStage::stream_bytes_per_s`]); `None`: staged
    /// copies at the link.
    pub stream_bytes_per_s: Option<f64>,
}

impl StagedRing<'_> {
    /// [`forecast_staged`] of `shape` with this host stage at `depth`, its
    /// staged copies at the staged stream's rate where given.
    pub fn forecast(
        &self,
        shape: &RingShape<'_>,
        depth: usize,
    ) -> Result<StagedForecast, BudgetError> {
        forecast_beside(
            shape,
            self.staged,
            self.staged_bytes,
            (self.fill_bytes_per_s, self.stream_bytes_per_s),
            (depth, self.buffers, self.part_bytes),
        )
    }
}

/// [`choose_lookahead`] for a ring whose masters are partly or wholly
/// staged: the same rule (one deeper than the shallowest depth whose
/// steady-state forward is as short as any allowed, within a thousandth)
/// over the forward [`forecast_staged`] gives at each depth, so the host's
/// fills count as the copies do. Where a staged block's fill outlasts the
/// compute before it (Flux's double blocks at the crossover), the host must
/// run its fills ahead through the compute-bound stretch, and the depth
/// that lets it can be deeper than the pinned ring's (on the simulator,
/// every master staged filling at 35 GB/s, the pinned chooser's depth ran
/// 1.08–1.12 of the limit at 14,336–16,384 tokens; an H100 at 10,752
/// tokens under an 8 GiB host budget ran 1.108 at depth 2 and 1.010–1.017
/// at depth 8). The `limit_s` it returns is the staged path's
/// ([`StagedForecast::limit_s`]: `max(compute, streamed copies as priced,
/// the host's fills)`). Typed errors as
/// [`choose_lookahead`]'s and [`forecast_staged`]'s.
pub fn choose_staged_lookahead(
    shape: &RingShape<'_>,
    host: StagedRing<'_>,
    slot_bytes: u64,
    max_depth: usize,
    max_slot_memory_bytes: Option<u64>,
) -> Result<Lookahead, BudgetError> {
    let depths = allowed_depths(slot_bytes, max_depth, max_slot_memory_bytes)?;
    let first = host.forecast(shape, 1)?;
    let limit_s = first.limit_s();
    let mut predicted = vec![first.forward_s];
    for d in 2..=depths {
        predicted.push(host.forecast(shape, d)?.forward_s);
    }
    Ok(knee(&predicted, slot_bytes, limit_s))
}

/// What [`choose_compression`] chose for one ring: whether it streams
/// coded, and the recurrence's steady-state forward either way.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CompressionChoice {
    /// Whether the ring streams its blocks coded.
    pub lossless: bool,
    /// Its forward uncoded, seconds.
    pub none_s: f64,
    /// Its forward coded, seconds.
    pub lossless_s: f64,
    /// `max(compute, streamed bf16 copies)`, seconds: today's limit.
    pub limit_s: f64,
    /// Whether its uncoded copies are exposed ([`copies_exposed`]). Where
    /// they are not, the ring stays uncoded and, decided by
    /// [`hidden_choice`] before anything is encoded, `lossless_s` is
    /// `none_s` (no coded forward predicted).
    pub exposed: bool,
}

/// Whether a ring's uncoded copies are exposed at `depth`: its forward by
/// the recurrence, with copies slowing no kernel, outlasts its compute (and
/// `other_s`) by more than the planner's tie. Where they are not, coding can
/// only add decodes ([`choose_compression`]); `"auto"` then leaves the
/// ring raw without encoding it. Unusable input (lengths that differ):
/// not exposed, for [`choose_compression`]'s typed error to name.
pub fn copies_exposed(shape: &RingShape<'_>, depth: usize) -> bool {
    let n = shape.compute_s.len();
    if shape.copy_s.len() != n || shape.resident.len() != n || n == 0 {
        return false;
    }
    hosted_copies_exposed(
        shape.compute_s,
        shape.copy_s,
        None,
        shape.resident,
        depth,
        shape.other_s,
    )
}

/// [`copies_exposed`]'s rule with the host stage of staged masters (`host`,
/// where given): the ring's steady-state forward by the recurrence, its
/// copies (and fills) slowing no kernel, outlasts the same forward with
/// free copies (and no fills) by more than the planner's tie. The one
/// statement of the rule: layerwise's rings and the request planner's
/// stacks (`"auto"`'s veto, CONTRACT §7b) both ask it.
pub(crate) fn hosted_copies_exposed(
    compute_s: &[f64],
    copy_s: &[f64],
    host: Option<HostStage<'_>>,
    resident: &[bool],
    depth: usize,
    other_s: f64,
) -> bool {
    let depth = depth.clamp(1, MAX_DEPTH);
    let raw = hosted_ends(
        compute_s,
        copy_s,
        (None, host),
        resident,
        depth,
        other_s,
        0.0,
    );
    let free = hosted_ends(
        compute_s,
        &vec![0.0; copy_s.len()],
        (None, None),
        resident,
        depth,
        other_s,
        0.0,
    );
    steady_s(&raw) > steady_s(&free) * (1.0 + TIE)
}

/// `weight_compression = "auto"` for one ring (CONTRACT §7b): coded when
/// the recurrence ([`staged_ends`]) says its steady-state forward at
/// `depth` is shorter coded (`coded_copy_s` and `decode`) than uncoded
/// (`shape.copy_s`) by more than the planner's tie (a thousandth): where
/// the copies are exposed; a compute-bound ring (whose uncoded forward,
/// interference aside, is its compute) stays uncoded whatever the
/// interference models predict, the decode's interference being all it
/// would add. Typed errors on unusable input, as [`choose_lookahead`]'s.
pub fn choose_compression(
    shape: &RingShape<'_>,
    coded_copy_s: &[f64],
    decode: DecodeStage<'_>,
    depth: usize,
) -> Result<CompressionChoice, BudgetError> {
    let n = shape.compute_s.len();
    if coded_copy_s.len() != n || decode.decode_s.len() != n {
        return Err(BudgetError::Input {
            input: "coded ring shape".to_owned(),
            value: format!(
                "{n} computes, {} coded copies, {} decodes",
                coded_copy_s.len(),
                decode.decode_s.len()
            ),
            allowed: "one coded copy and one decode per block".to_owned(),
        });
    }
    let finite = |v: &f64| v.is_finite() && *v >= 0.0;
    if !coded_copy_s.iter().chain(decode.decode_s).all(finite)
        || !finite(&decode.interference)
        || decode.interference > MAX_DECODE_INTERFERENCE
    {
        return Err(BudgetError::Input {
            input: "coded ring shape".to_owned(),
            value: format!(
                "a time or an interference that is negative, not finite, or above {MAX_DECODE_INTERFERENCE}"
            ),
            allowed: format!(
                "finite times ≥ 0, a decode interference from 0 to {MAX_DECODE_INTERFERENCE}"
            ),
        });
    }
    // The uncoded shape's own checks.
    choose_lookahead(shape, 1, depth.clamp(1, MAX_DEPTH), None)?;
    let step = |copy: &[f64], decode: Option<DecodeStage<'_>>, interference: f64| {
        let e = staged_ends(
            shape.compute_s,
            copy,
            decode,
            shape.resident,
            depth,
            shape.other_s,
            interference,
        );
        e[FORWARDS - 1] - e[FORWARDS - 2]
    };
    let none_s = step(shape.copy_s, None, shape.interference);
    let lossless_s = step(coded_copy_s, Some(decode), shape.interference);
    // Coding pays only where the copies are exposed: the uncoded forward,
    // interference aside, outlasts its compute. Where it does not, the two
    // predictions differ only by how the interference models price fewer
    // copied bytes against the decodes' kernels, one of them an estimate
    // unless measured (an H100 at 16,896 tokens: predicted 0.1 % faster
    // coded, measured 1 % slower), so the ring stays uncoded: a veto, not
    // a margin.
    let exposed = copies_exposed(shape, depth);
    Ok(CompressionChoice {
        lossless: exposed && lossless_s < none_s * (1.0 - TIE),
        none_s,
        lossless_s,
        limit_s: shape.limit_s(),
        exposed,
    })
}

/// `"auto"`'s choice for a ring whose uncoded copies are hidden at `depth`
/// ([`copies_exposed`]), made before any block is encoded: uncoded, its
/// forward by the recurrence (`lossless_s` the same: nothing coded to
/// predict). `None` where the copies are exposed (or the input unusable):
/// then only the coded sizes and the measured decoder decide
/// ([`choose_compression`]).
pub fn hidden_choice(shape: &RingShape<'_>, depth: usize) -> Option<CompressionChoice> {
    if copies_exposed(shape, depth) || shape.compute_s.is_empty() {
        return None;
    }
    let e = staged_ends(
        shape.compute_s,
        shape.copy_s,
        None,
        shape.resident,
        depth.clamp(1, MAX_DEPTH),
        shape.other_s,
        shape.interference,
    );
    let none_s = e[FORWARDS - 1] - e[FORWARDS - 2];
    Some(CompressionChoice {
        lossless: false,
        none_s,
        lossless_s: none_s,
        limit_s: shape.limit_s(),
        exposed: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A staged block in parts (CONTRACT §7c): a block within a buffer is
    /// one part, the whole-block schedule; in parts its copy overlaps its
    /// own fills (filled in 1.0 and copied in 0.5 s, in four parts it is in
    /// at 1.125 s, not 1.5); and a ring of fewer buffers than the block's
    /// parts makes a fill wait for the copy out of the buffer it refills
    /// (copies slower than fills: the last part's fill ends at 1.25 s with
    /// two buffers, at 0.5 s with eight). Seen red (2026-12-07) with the
    /// buffers' reuse ignored in parts, and with every part charged the
    /// whole block's fill.
    #[test]
    fn a_block_in_parts_overlaps_its_fills_within_the_ring() {
        let run = |fill: f64, copy: f64, (bytes, part_bytes, buffers): (u64, u64, usize)| {
            let staged = [true, true];
            let fill_s = [fill, fill];
            let sizes = [bytes, bytes];
            let host = HostStage {
                staged: &staged,
                fill_s: &fill_s,
                buffers,
                bytes: &sizes,
                part_bytes,
                stream_bytes_per_s: None,
            };
            let mut f = Fills::new(1, 4);
            let ready = f.fill(0, &[], &[0, 1], &[copy, copy], (None, Some(host)));
            (ready, f.hosted[0])
        };
        let close =
            |a: (f64, f64), b: (f64, f64)| (a.0 - b.0).abs() < 1e-12 && (a.1 - b.1).abs() < 1e-12;
        // One part: whole blocks, whatever the part size beyond the block.
        assert!(close(run(1.0, 0.5, (4, 4, 2)), (1.5, 1.0)));
        assert!(close(run(1.0, 0.5, (4, 1 << 20, 2)), (1.5, 1.0)));
        // Four parts, room for all: each part's copy after its own fill.
        let four = run(1.0, 0.5, (4, 1, 8));
        assert!(close(four, (1.125, 1.0)), "{four:?}");
        // Uneven parts (3 + 1 bytes): the first copies 0.375 s from 0.75,
        // the last (a quarter) after it, from 1.125.
        let uneven = run(1.0, 0.5, (4, 3, 8));
        assert!(close(uneven, (1.25, 1.0)), "{uneven:?}");
        // Copies slower than fills, two buffers: the fills wait.
        let two = run(0.5, 2.0, (4, 1, 2));
        assert!(close(two, (2.125, 1.25)), "{two:?}");
        let eight = run(0.5, 2.0, (4, 1, 8));
        assert!(close(eight, (2.125, 0.5)), "{eight:?}");
    }

    /// A compute-bound ring of raw staged blocks in parts, through a ring
    /// of buffers smaller than a block: the parts a prefetch could not
    /// issue stay queued for a later hook, so no hook waits for a fill
    /// that waits (through the copies of the block's first parts) for
    /// compute it has yet to issue, and the ring runs at its compute. Seen red
    /// (2026-12-07) with the prefetching hook waiting for all its block's
    /// fills (the forward 1.42× its compute at depth 1).
    #[test]
    fn a_prefetch_in_parts_leaves_compute_bound_kernels_unwaited() {
        let n = 8;
        let staged = vec![true; n];
        let fill_s = vec![0.6; n];
        let bytes = vec![4; n];
        let host = HostStage {
            staged: &staged,
            fill_s: &fill_s,
            buffers: 2,
            bytes: &bytes,
            part_bytes: 1,
            stream_bytes_per_s: None,
        };
        for depth in [1, 2, 3] {
            let ends = hosted_ends(
                &vec![1.0; n],
                &vec![0.5; n],
                (None, Some(host)),
                &vec![false; n],
                depth,
                0.0,
                0.0,
            );
            let ratio = steady_s(&ends) / n as f64;
            assert!(ratio < 1.0 + 1e-9, "depth {depth}: {ratio}");
        }
    }

    /// The host stage of staged masters: free fills change no steady state; a
    /// ring of staged blocks whose fills outlast their copies and compute
    /// runs at the host's fills; two staging buffers keep fills at most
    /// two staged blocks ahead of the copies; staged blocks spread between
    /// pinned ones overlap their fills with the pinned copies, reaching
    /// max(fills, copies, compute); and a hook that waits for a fill
    /// delays its block's kernels.
    #[test]
    fn the_host_stage_bounds_a_staged_ring_by_its_fills() {
        let n = 12;
        let ends_with =
            |compute: f64, copy: f64, staged: &[bool], fill: f64, depth: usize, buffers: usize| {
                let compute_s = vec![compute; n];
                let copy_s = vec![copy; n];
                let fill_s = vec![fill; n];
                let resident = vec![false; n];
                let bytes = vec![1; n];
                hosted_ends(
                    &compute_s,
                    &copy_s,
                    (
                        None,
                        Some(HostStage {
                            staged,
                            fill_s: &fill_s,
                            buffers,
                            bytes: &bytes,
                            part_bytes: 1,
                            stream_bytes_per_s: None,
                        }),
                    ),
                    &resident,
                    depth,
                    0.0,
                    0.0,
                )
            };
        let ends = |compute, copy, staged: &[bool], fill, depth| {
            ends_with(compute, copy, staged, fill, depth, 2)
        };
        let all = vec![true; n];
        let none = vec![false; n];
        let plain = |compute: f64, copy: f64, depth: usize| {
            forward_ends(
                &vec![compute; n],
                &vec![copy; n],
                &vec![false; n],
                depth,
                0.0,
                0.0,
            )
        };
        for depth in [1, 2, 4] {
            // Free fills: the same schedule at every look-ahead, deeper
            // than the two staging buffers too: a fill that waits for the
            // copy out of the buffer it refills delays only its own
            // block, never the kernels of the blocks before it (seen red,
            // 2026-12-07, with each hook waiting for the fills of the
            // blocks it prefetched, as the engine did: the first forward
            // 2.0 s later at depth 4).
            let free = ends(1.0, 2.0, &all, 0.0, depth);
            assert_eq!(free, plain(1.0, 2.0, depth), "{depth}");
            assert_eq!(ends(1.0, 2.0, &none, 5.0, depth), plain(1.0, 2.0, depth));
            // Fills of 3 against copies of 2 and compute of 1: 12 × 3.
            let e = ends(1.0, 2.0, &all, 3.0, depth);
            assert!((steady_s(&e) - 36.0).abs() < 1e-9, "{depth}: {e:?}");
            // Fills of 1 against copies of 2: the link bounds it.
            let e = ends(0.5, 2.0, &all, 1.0, depth);
            assert!((steady_s(&e) - 24.0).abs() < 1e-9, "{depth}: {e:?}");
        }
        // Every other block staged, fills of 2, copies of 1, compute 0.5:
        // the six fills (12 s) overlap the pinned copies; the bound is the
        // host's 12 s, not 6 × (2 + 1) + 6 × 1 = 24 s.
        let half: Vec<bool> = (0..n).map(|i| i % 2 == 0).collect();
        let e = ends(0.5, 1.0, &half, 2.0, 4);
        assert!((steady_s(&e) - 12.0).abs() < 1e-9, "{e:?}");
        // Two staging buffers: copies of 4 and fills of 1 leave the host
        // idle, two fills ahead at most; the link's 48 s is the step.
        let e = ends(0.1, 4.0, &all, 1.0, 8);
        assert!((steady_s(&e) - 48.0).abs() < 1e-9, "{e:?}");
        // One staging buffer (the second refused): each fill waits for the
        // copy out of the buffer before it, so fills of 1 and copies of 2
        // serialise, 12 × 3, where two buffers overlap them at the link's
        // 12 × 2.
        for depth in [1, 2, 4] {
            let one = ends_with(0.1, 2.0, &all, 1.0, depth, 1);
            assert!((steady_s(&one) - 36.0).abs() < 1e-9, "{depth}: {one:?}");
            let two = ends_with(0.1, 2.0, &all, 1.0, depth, 2);
            assert!((steady_s(&two) - 24.0).abs() < 1e-9, "{depth}: {two:?}");
        }
        // The hook's wait: with the first forward's fills slower than
        // everything else, compute cannot start before the first fill.
        let e = ends(0.1, 0.1, &all, 1.0, 1);
        assert!(e[0] >= 12.0, "{e:?}");
    }

    fn choice(compute: f64, copy: f64, ratio: f64, decode: f64) -> CompressionChoice {
        let n = 12;
        let compute_s = vec![compute; n];
        let copy_s = vec![copy; n];
        let coded: Vec<f64> = copy_s.iter().map(|c| c * ratio).collect();
        let decode_s = vec![decode; n];
        let resident = vec![false; n];
        let shape = RingShape {
            compute_s: &compute_s,
            copy_s: &copy_s,
            resident: &resident,
            other_s: 0.0,
            interference: 0.03,
        };
        choose_compression(
            &shape,
            &coded,
            DecodeStage {
                decode_s: &decode_s,
                interference: 0.35,
            },
            2,
        )
        .unwrap()
    }

    #[test]
    fn a_transfer_bound_ring_streams_coded_at_the_coded_link() {
        // Copies 3× compute: coded at 0.7 the ring runs at its coded copies.
        let c = choice(1.0, 3.0, 0.7, 0.1);
        assert!(c.lossless);
        assert!((c.none_s - 36.0).abs() / 36.0 < 0.02, "{c:?}");
        assert!(
            (c.lossless_s - 0.7 * 36.0).abs() / (0.7 * 36.0) < 0.03,
            "{c:?}"
        );
    }

    #[test]
    fn a_compute_bound_ring_stays_uncoded() {
        // Copies half of compute: coding only adds the decode's interference.
        let c = choice(2.0, 1.0, 0.7, 0.2);
        assert!(!c.lossless, "{c:?}");
        assert!(c.lossless_s >= c.none_s, "{c:?}");
    }

    /// A compute-bound ring whose copies slow its kernels more than the
    /// decodes would (copy interference 0.3, decode interference 0): the
    /// recurrence predicts it faster coded (fewer copied bytes to
    /// interfere), but its copies are hidden, so it stays uncoded. Near
    /// the crossover, where the copies are exposed, it codes.
    #[test]
    fn a_hidden_ring_stays_uncoded_whatever_the_interference_predicts() {
        let n = 12;
        let run = |compute: f64, copy: f64| {
            let (compute_s, copy_s) = (vec![compute; n], vec![copy; n]);
            let coded: Vec<f64> = copy_s.iter().map(|c| c * 0.7).collect();
            let (decode_s, resident) = (vec![0.05; n], vec![false; n]);
            let shape = RingShape {
                compute_s: &compute_s,
                copy_s: &copy_s,
                resident: &resident,
                other_s: 0.0,
                interference: 0.3,
            };
            let d = DecodeStage {
                decode_s: &decode_s,
                interference: 0.0,
            };
            choose_compression(&shape, &coded, d, 2).unwrap()
        };
        let hidden = run(3.0, 1.0);
        assert!(
            hidden.lossless_s < hidden.none_s * (1.0 - TIE),
            "{hidden:?}"
        );
        assert!(!hidden.lossless && !hidden.exposed, "{hidden:?}");
        let exposed = run(1.0, 1.1);
        assert!(exposed.lossless && exposed.exposed, "{exposed:?}");
        // Decided before encoding: the same uncoded forward, and nothing
        // where the copies are exposed.
        let (compute_s, copy_s, resident) = (vec![3.0; n], vec![1.0; n], vec![false; n]);
        let shape = RingShape {
            compute_s: &compute_s,
            copy_s: &copy_s,
            resident: &resident,
            other_s: 0.0,
            interference: 0.3,
        };
        let early = hidden_choice(&shape, 2).unwrap();
        assert_eq!((early.lossless, early.none_s), (false, hidden.none_s));
        let copy_s = vec![3.3; n];
        let shape = RingShape {
            copy_s: &copy_s,
            ..shape
        };
        assert_eq!(hidden_choice(&shape, 2), None);
    }

    /// The hidden-copies rule's tie is the planner's thousandth: a
    /// transfer-bound ring whose copies outlast its compute by 0.2 % is
    /// exposed, one by 0.05 % hidden, with and without a host stage whose
    /// fills are the part that outlasts it. Seen red with the tie at 0.5 %
    /// and at 0 (the constant `TIE` and the comparison's own).
    #[test]
    fn the_copies_are_exposed_past_a_thousandth() {
        let n = 12;
        let resident = vec![false; n];
        let compute = vec![1.0; n];
        let free = vec![0.0; n];
        for (over, want) in [(2e-3, true), (5e-4, false)] {
            let long = vec![1.0 + over; n];
            let by_link = hosted_copies_exposed(&compute, &long, None, &resident, 2, 0.0);
            let staged = vec![true; n];
            let host = HostStage {
                staged: &staged,
                fill_s: &long,
                buffers: 2,
                bytes: &[],
                part_bytes: 1,
                stream_bytes_per_s: None,
            };
            let by_fills = hosted_copies_exposed(&compute, &free, Some(host), &resident, 2, 0.0);
            assert_eq!((by_link, by_fills), (want, want), "over by {over}");
        }
    }

    #[test]
    fn the_decode_stage_gates_a_fill_on_its_slot_and_its_staging() {
        // A decode longer than everything else bounds the ring.
        let c = choice(1.0, 1.0, 0.5, 4.0);
        assert!(!c.lossless);
        assert!(c.lossless_s >= 12.0 * 4.0 * 0.99, "{c:?}");
        // Bad input: lengths, values.
        let (a, r) = (vec![1.0; 3], vec![false; 3]);
        let shape = RingShape {
            compute_s: &a,
            copy_s: &a,
            resident: &r,
            other_s: 0.0,
            interference: 0.0,
        };
        let d = DecodeStage {
            decode_s: &a,
            interference: 0.3,
        };
        assert!(choose_compression(&shape, &a[..2], d, 1).is_err());
        let bad = [1.0, f64::NAN, 1.0];
        assert!(choose_compression(&shape, &bad, d, 1).is_err());
        let d2 = DecodeStage {
            decode_s: &a,
            interference: MAX_DECODE_INTERFERENCE * 1.01,
        };
        assert!(choose_compression(&shape, &a, d2, 1).is_err());
        // Above 1 is a card's measured figure, not an error.
        let d3 = DecodeStage {
            decode_s: &a,
            interference: 2.0,
        };
        assert!(choose_compression(&shape, &a, d3, 1).is_ok());
    }

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

    /// A kernel loses its interference for every fill within its own
    /// time, not only the one running when it starts: a resident block of
    /// 10 s computes while the next streamed block copies (0–6 s) and
    /// decodes (6–7 s), so at a decode interference k it takes 10 + k s;
    /// and a copy that starts within a kernel slows it as one running at
    /// its start does.
    #[test]
    fn every_fill_within_a_kernel_slows_it() {
        let (compute, copy, decode) = ([10.0, 1.0], [0.0, 6.0], [0.0, 1.0]);
        let resident = [true, false];
        let at = |k: f64| {
            staged_ends(
                &compute,
                &copy,
                Some(DecodeStage {
                    decode_s: &decode,
                    interference: k,
                }),
                &resident,
                1,
                0.0,
                0.0,
            )[0]
        };
        // Block 0 ends at 10 + k; block 1 (ready at 7) then computes 1 s,
        // beside the next forward's decode (12–13 s) where it overlaps it:
        // 11, 12, and at k = 2 block 1 runs 12–13 beside it, 15.
        assert!((at(0.0) - 11.0).abs() < 1e-9, "{}", at(0.0));
        assert!((at(1.0) - 12.0).abs() < 1e-9, "{}", at(1.0));
        assert!((at(2.0) - 15.0).abs() < 1e-9, "{}", at(2.0));
        // Copies: a resident block of 10 s computes while the next two
        // streamed blocks copy back to back (0–4 s, 4–8 s; depth 2), so at
        // an interference of 0.5 it takes 14 s, not 12 (the copy running
        // at its start only). The rest, by the recurrence's rules: block
        // 1 runs 14–15; block 2 15–16.5 beside the copy of block 4 (15–19
        // s); block 3 16.5–18 beside the same copy; block 4 19–20.5.
        let ends = forward_ends(
            &[10.0, 1.0, 1.0, 1.0, 1.0],
            &[0.0, 4.0, 4.0, 4.0, 4.0],
            &[true, false, false, false, false],
            2,
            0.0,
            0.5,
        );
        assert!((ends[0] - 20.5).abs() < 1e-9, "{ends:?}");
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

    /// Flux's blocks near the crossover (ms): 19 double blocks whose copy
    /// exceeds their compute, then 38 single blocks whose compute exceeds
    /// their copy. Four blocks of look-ahead (the old cap) leave the step
    /// above 1.02× its limit; the chooser runs as far ahead as the
    /// recurrence says it must, and stops there.
    fn crossover() -> (Vec<f64>, Vec<f64>) {
        let mut compute = vec![9.8e-3; 19];
        compute.extend([9.1e-3; 38]);
        let mut copy = vec![12.4e-3; 19];
        copy.extend([5.2e-3; 38]);
        (compute, copy)
    }

    #[test]
    fn the_lookahead_runs_ahead_as_far_as_the_crossover_needs() {
        let (compute, copy) = crossover();
        let resident = vec![false; compute.len()];
        let shape = RingShape {
            compute_s: &compute,
            copy_s: &copy,
            resident: &resident,
            other_s: 0.0,
            interference: 0.0,
        };
        let old = choose_lookahead(&shape, 100, 4, None).unwrap();
        assert!(
            old.predicted_step_s / old.limit_s > 1.02,
            "capped at 4: {old:?}"
        );
        let l = choose_lookahead(&shape, 100, 16, None).unwrap();
        assert!(l.predicted_step_s / l.limit_s <= 1.0 + 1e-9, "{l:?}");
        assert!(l.depth > 4 && l.depth < 16, "{l:?}");
        assert_eq!(l.slot_memory_bytes, 100 * (l.depth as u64 + 1));
        // One beyond the knee: two less is slower.
        let shallower = predict_step(&compute, &copy, &resident, l.depth - 2, 0.0, 0.0);
        assert!(shallower > l.predicted_step_s * (1.0 + 1e-3), "{shallower}");
        let knee = predict_step(&compute, &copy, &resident, l.depth - 1, 0.0, 0.0);
        assert!(knee <= l.predicted_step_s * (1.0 + 1e-3), "{knee}");
        // A memory cap bounds the depth.
        let capped = choose_lookahead(&shape, 100, 16, Some(350)).unwrap();
        assert_eq!((capped.depth, capped.slot_memory_bytes), (2, 300));
    }

    /// A ring bound by its copies at 4,608 tokens (Flux's blocks, compute
    /// well under the copies), two blocks in three staged (an 8 GiB host
    /// budget's share): with the staged stream's rate given below the link
    /// (38 of 46.4 GB/s, an H100's of 2026-12-08), each staged block's copy
    /// is priced at it, the copies sum to the pinned bytes at the link and
    /// the staged ones at the stream, the forecast sits on them ("the
    /// host's memory", about 1.15 of the link) where without it it sits on
    /// the link; a rate at or above the link changes nothing, and one that
    /// is not a finite number above 0 is a typed error. Red with the stream
    /// ignored (copies at the link).
    #[test]
    fn staged_copies_beside_the_fills_are_priced_at_the_staged_stream() {
        let link = 46.4e9;
        let mut bytes = vec![680_000_000u64; 19];
        bytes.extend([283_000_000u64; 38]);
        let n = bytes.len();
        let compute: Vec<f64> = bytes.iter().map(|b| *b as f64 / 200e9).collect();
        let copy: Vec<f64> = bytes.iter().map(|b| *b as f64 / link).collect();
        let resident = vec![false; n];
        let shape = RingShape {
            compute_s: &compute,
            copy_s: &copy,
            resident: &resident,
            other_s: 0.0,
            interference: 0.0,
        };
        let staged: Vec<bool> = (0..n).map(|i| i % 3 != 2).collect();
        let ring = |stream: Option<f64>| StagedRing {
            staged: &staged,
            staged_bytes: &bytes,
            fill_bytes_per_s: 45e9,
            buffers: 8,
            part_bytes: 64 << 20,
            stream_bytes_per_s: stream,
        };
        let at = |stream: Option<f64>| ring(stream).forecast(&shape, 2);
        let plain = at(None).unwrap();
        assert_eq!(plain.bound(), "the link", "{plain:?}");
        assert_eq!(plain.copies_s, plain.link_s);
        let beside = at(Some(38e9)).unwrap();
        let want: f64 = (0..n)
            .map(|i| {
                if staged[i] {
                    bytes[i] as f64 / 38e9
                } else {
                    copy[i]
                }
            })
            .sum();
        assert!(
            (beside.copies_s - want).abs() < 1e-9,
            "{} against {want}",
            beside.copies_s
        );
        assert_eq!(beside.link_s, plain.link_s);
        assert_eq!(
            beside.bound(),
            "the host's memory (the DMA beside the fills)",
            "{beside:?}"
        );
        assert!(beside.forward_s >= beside.copies_s, "{beside:?}");
        let ratio = beside.forward_s / plain.forward_s;
        assert!(
            (1.10..1.20).contains(&ratio),
            "{ratio}: {beside:?} {plain:?}"
        );
        assert!((beside.limit_s() - want).abs() < 1e-9, "{beside:?}");
        // A stream no slower than the link: the plain forecast.
        let fast = at(Some(2.0 * link)).unwrap();
        assert_eq!(
            (fast.forward_s, fast.copies_s, fast.bound()),
            (plain.forward_s, plain.copies_s, plain.bound())
        );
        for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
            let e = at(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("staged stream rate"), "{bad}: {e}");
        }
        // The chooser's limit is the forecast's.
        let l = choose_staged_lookahead(&shape, ring(Some(38e9)), 700_000_000, 16, None).unwrap();
        assert!((l.limit_s - want).abs() < 1e-9, "{l:?}");
    }

    /// A ring whose pinned copies hide behind compute from depth 3 (Flux's
    /// blocks a little past the crossover, ms: double blocks of 13 ms
    /// compute and 12.4 ms copy, single blocks of 10 and 5.2) but whose
    /// staged fills do not (the host fills 45 GB/s: 15.1 ms for a double
    /// block). The pinned chooser stops at depth 3; the staged chooser runs
    /// the fills ahead through the single blocks into the double ones, to
    /// within the tie of the staged path's limit, one slot beyond its knee,
    /// where the pinned chooser's depth is 2.25 % above it. Red with the
    /// staged chooser pricing the pinned ring (the host stage left out),
    /// and with the knee itself chosen.
    #[test]
    fn the_staged_chooser_runs_the_fills_ahead() {
        let mut compute = vec![13.0e-3; 19];
        compute.extend([10.0e-3; 38]);
        let mut copy = vec![12.4e-3; 19];
        copy.extend([5.2e-3; 38]);
        let mut bytes = vec![680_000_000u64; 19];
        bytes.extend([283_000_000u64; 38]);
        let n = compute.len();
        let resident = vec![false; n];
        let shape = RingShape {
            compute_s: &compute,
            copy_s: &copy,
            resident: &resident,
            other_s: 0.0,
            interference: 0.0,
        };
        let staged = vec![true; n];
        let host = StagedRing {
            staged: &staged,
            staged_bytes: &bytes,
            fill_bytes_per_s: 45e9,
            buffers: 8,
            part_bytes: 64 << 20,
            stream_bytes_per_s: None,
        };
        let pinned = choose_lookahead(&shape, 700_000_000, 16, None).unwrap();
        assert!(pinned.depth <= 3, "{pinned:?}");
        let l = choose_staged_lookahead(&shape, host, 700_000_000, 16, None).unwrap();
        let at = |depth: usize| {
            forecast_staged(&shape, &staged, &bytes, 45e9, (depth, 8, 64 << 20))
                .unwrap()
                .forward_s
        };
        eprintln!(
            "pinned {pinned:?}\nstaged {l:?}\nat the pinned depth: {:.4} s",
            at(pinned.depth)
        );
        assert!(l.depth > pinned.depth, "{l:?}");
        assert!((l.predicted_step_s - at(l.depth)).abs() < 1e-12, "{l:?}");
        assert!(l.predicted_step_s <= l.limit_s * (1.0 + TIE), "{l:?}");
        // One beyond the knee: the depth before it is as short as the best,
        // the one before that is not.
        let best = (1..=16).map(at).fold(f64::INFINITY, f64::min);
        assert!(at(l.depth - 1) <= best * (1.0 + TIE), "{l:?}");
        assert!(at(l.depth - 2) > best * (1.0 + TIE), "{l:?}");
        // The pinned chooser's depth leaves the staged ring 2 % over.
        assert!(
            at(pinned.depth) > l.limit_s * 1.02,
            "depth {}: {}",
            pinned.depth,
            at(pinned.depth)
        );
        // The limit is the staged path's, max(compute, copies, fills):
        // compute here.
        let fills: f64 = bytes.iter().map(|b| *b as f64 / 45e9).sum();
        let sum = |v: &[f64]| v.iter().sum::<f64>();
        assert!(fills < sum(&compute) && sum(&copy) < sum(&compute));
        assert!((l.limit_s - sum(&compute)).abs() < 1e-12, "{l:?}");
        let slow = StagedRing {
            fill_bytes_per_s: 30e9,
            ..host
        };
        let bound = choose_staged_lookahead(&shape, slow, 700_000_000, 16, None).unwrap();
        assert!((bound.limit_s - fills * 1.5).abs() < 1e-9, "{bound:?}");
        // And the link where it binds (copies doubled: 0.63 s of them).
        let slow_copy: Vec<f64> = copy.iter().map(|c| c * 2.0).collect();
        let linked = RingShape {
            copy_s: &slow_copy,
            ..shape
        };
        let link = choose_staged_lookahead(&linked, host, 700_000_000, 16, None).unwrap();
        assert!(sum(&slow_copy) > sum(&compute).max(fills));
        assert!((link.limit_s - sum(&slow_copy)).abs() < 1e-12, "{link:?}");
        // A block flagged staged but resident is never filled.
        let mut kept = resident.clone();
        kept[0] = true;
        let kept_shape = RingShape {
            resident: &kept,
            ..shape
        };
        let one_less = choose_staged_lookahead(&kept_shape, slow, 700_000_000, 16, None).unwrap();
        let kept_fills = (fills - bytes[0] as f64 / 45e9) * 1.5;
        assert!((one_less.limit_s - kept_fills).abs() < 1e-9, "{one_less:?}");
        // A memory cap bounds it as it bounds the pinned chooser.
        let capped = choose_staged_lookahead(&shape, host, 100, 16, Some(350)).unwrap();
        assert_eq!((capped.depth, capped.slot_memory_bytes), (2, 300));
        // Nothing staged: the pinned chooser's depth.
        let none = vec![false; n];
        let unstaged = StagedRing {
            staged: &none,
            ..host
        };
        let same = choose_staged_lookahead(&shape, unstaged, 700_000_000, 16, None).unwrap();
        assert_eq!(same.depth, pinned.depth, "{same:?}");
    }

    #[test]
    fn unusable_staged_chooser_inputs_are_typed_errors() {
        let compute = [1.0; 3];
        let shape = RingShape {
            compute_s: &compute,
            copy_s: &[1.0; 3],
            resident: &[false; 3],
            other_s: 0.0,
            interference: 0.0,
        };
        let host = StagedRing {
            staged: &[true; 3],
            staged_bytes: &[1; 3],
            fill_bytes_per_s: 1.0,
            buffers: 2,
            part_bytes: 1,
            stream_bytes_per_s: None,
        };
        let input = |r: Result<Lookahead, BudgetError>| match r {
            Err(BudgetError::Input { input, .. }) => input,
            other => panic!("expected an input error, got {other:?}"),
        };
        let bad_shape = RingShape {
            interference: 2.0,
            ..shape
        };
        // (shape, host stage, slot bytes, max depth, memory cap, the input
        // the error names)
        let cases = [
            (
                &shape,
                StagedRing {
                    staged: &[true; 2],
                    ..host
                },
                1,
                4,
                None,
                "staged ring shape",
            ),
            (
                &shape,
                StagedRing {
                    fill_bytes_per_s: 0.0,
                    ..host
                },
                1,
                4,
                None,
                "host fill rate",
            ),
            (
                &shape,
                StagedRing { buffers: 0, ..host },
                1,
                4,
                None,
                "host staging ring",
            ),
            (&shape, host, 1, 0, None, "max_depth"),
            (&shape, host, 10, 4, Some(19), "max_slot_memory_bytes"),
            (&bad_shape, host, 1, 4, None, "copy_interference"),
        ];
        for (shape, host, slot_bytes, max_depth, cap, named) in cases {
            assert_eq!(
                input(choose_staged_lookahead(
                    shape, host, slot_bytes, max_depth, cap
                )),
                named
            );
        }
    }

    #[test]
    fn a_uniform_ring_runs_one_slot_beyond_its_knee() {
        let shape = RingShape {
            compute_s: &[1.0; 8],
            copy_s: &[2.0; 8],
            resident: &[false; 8],
            other_s: 0.0,
            interference: 0.0,
        };
        let l = choose_lookahead(&shape, 10, 16, None).unwrap();
        assert_eq!(l.depth, 2, "the knee is depth 1: {l:?}");
        assert!((l.predicted_step_s - 16.0).abs() < 1e-9);
    }

    #[test]
    fn unusable_lookahead_inputs_are_typed_errors() {
        let ok = [1.0; 3];
        let res = [false; 3];
        let shape = |compute: &'static [f64], interference: f64| RingShape {
            compute_s: compute,
            copy_s: &[1.0; 3],
            resident: &[false; 3],
            other_s: 0.0,
            interference,
        };
        let input = |r: Result<Lookahead, BudgetError>| match r {
            Err(BudgetError::Input { input, .. }) => input,
            other => panic!("expected an input error, got {other:?}"),
        };
        assert_eq!(
            input(choose_lookahead(&shape(&[1.0; 2], 0.0), 1, 4, None)),
            "ring shape"
        );
        assert_eq!(
            input(choose_lookahead(
                &shape(&[f64::NAN, 1.0, 1.0], 0.0),
                1,
                4,
                None
            )),
            "ring shape"
        );
        assert_eq!(
            input(choose_lookahead(&shape(&[1.0; 3], 2.0), 1, 4, None)),
            "copy_interference"
        );
        assert_eq!(
            input(choose_lookahead(&shape(&[1.0; 3], 0.0), 1, 0, None)),
            "max_depth"
        );
        assert_eq!(
            input(choose_lookahead(&shape(&[1.0; 3], 0.0), 1, 65, None)),
            "max_depth"
        );
        assert_eq!(
            input(choose_lookahead(&shape(&[1.0; 3], 0.0), 10, 4, Some(19))),
            "max_slot_memory_bytes"
        );
        let fine = RingShape {
            compute_s: &ok,
            copy_s: &ok,
            resident: &res,
            other_s: 0.0,
            interference: 0.0,
        };
        assert!(choose_lookahead(&fine, 10, 4, Some(20)).is_ok());
    }

    /// `overlap_s`' walk against the sum over every recent window (each
    /// clamped at 0, newest first): equal to the bit (a zero perhaps
    /// signed) over 20,000 random
    /// streams of ordered windows (some of zero length, some back to
    /// back, gaps between), kernels anywhere among them. Seen red with the
    /// walk stopping at the first window that starts after the kernel
    /// ends, instead of skipping it.
    #[test]
    fn the_overlap_walk_sums_what_every_window_adds() {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        };
        for _ in 0..20_000 {
            let mut windows = Vec::new();
            let mut t = 0.0f64;
            for _ in 0..(next() * 24.0) as usize {
                let gap = if next() < 0.3 { 0.0 } else { next() * 3.0 };
                let len = if next() < 0.1 { 0.0 } else { next() * 5.0 };
                let s = t + gap;
                t = s + len;
                windows.push((s, t));
            }
            let recent = 1 + (next() * 20.0) as usize;
            let start = next() * (t + 2.0);
            let compute = next() * 8.0;
            let end = start + compute;
            let every = windows[windows.len().saturating_sub(recent)..]
                .iter()
                .rev()
                .map(|(s, e)| (e.min(end) - s.max(start)).max(0.0))
                .sum::<f64>()
                .min(compute);
            let walked = overlap_s(&windows, recent, start, compute);
            // (A zero may come back as -0.0 from an empty walk.)
            assert!(
                walked == every && (every == 0.0 || walked.to_bits() == every.to_bits()),
                "{walked} against {every}: {windows:?} recent {recent} from {start} for {compute}"
            );
        }
    }
}
