//! The device-memory budget: a planner that, before anything is allocated,
//! chooses which blocks stay resident and the prefetch depth so that the
//! weights, the slots and the activations fit a budget and the predicted
//! step is as short as the budget allows (CONTRACT §7a).
//!
//! The planner is a pure function of the pipeline, the configuration (its
//! `device_budget`), and [`PlannerInputs`]: the link bandwidth, each
//! block's compute time and the activation memory a warm-up request
//! measured (CONTRACT §9). Its output, a [`BudgetPlan`], carries an
//! ordinary layerwise configuration with `resident_blocks` set and the
//! prefetch depth: what the ring engine builds and what INV-7's bounds
//! count. Nothing in it names a device.
//!
//! The step it predicts comes from [`predict_step`]: the ring engine's
//! schedule as a recurrence (the copy stream runs fills in order; the fill
//! of streamed block j waits for the compute of streamed block j − depth − 1,
//! whose slot it takes; a block computes after its predecessor and after
//! its fill), run over three forwards with wrap-around and read on the last.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

pub use crate::bytes::{BYTE_SIZE_FORMS, ByteSize, DeviceBudget};

use crate::config::OffloadConfig;
use crate::model::Pipeline;
use crate::plan::{PlanError, ResolvedPlan, resolve};

/// What the planner knows of the device and the workload.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PlannerInputs {
    /// Host→device bandwidth from the host masters, bytes per second.
    pub link_bytes_per_s: f64,
    /// Fixed cost of one copy, seconds.
    pub copy_latency_s: f64,
    /// Compute of one forward of each block, seconds, by block path.
    /// Blocks not listed cost `compute_s_per_byte` × their bytes.
    pub block_compute_s: BTreeMap<String, f64>,
    /// Fallback compute per weight byte, seconds (0: transfer only).
    pub compute_s_per_byte: f64,
    /// Compute of each stack's forward outside its blocks, seconds.
    pub other_compute_s: f64,
    /// Device memory a forward needs beside the weights (activations,
    /// scratch, workspaces): what a warm-up request measured.
    pub activation_bytes: u64,
    /// The deepest prefetch the planner may choose (≥ 1).
    pub max_depth: usize,
    /// How much slower a block computes while a copy runs beside it
    /// (0.035: 3.5 % slower), as measured: the copy engine's traffic
    /// competes with the kernels for memory.
    pub copy_interference: f64,
}

impl Default for PlannerInputs {
    /// A PCIe Gen4 link (25 GB/s), no compute model (every schedule is
    /// transfer-bound), no activations, depth up to 4.
    fn default() -> Self {
        Self {
            link_bytes_per_s: 25e9,
            copy_latency_s: 10e-6,
            block_compute_s: BTreeMap::new(),
            compute_s_per_byte: 0.0,
            other_compute_s: 0.0,
            activation_bytes: 0,
            max_depth: 4,
            copy_interference: 0.0,
        }
    }
}

impl PlannerInputs {
    fn compute_s(&self, path: &str, bytes: u64) -> f64 {
        self.block_compute_s
            .get(path)
            .copied()
            .unwrap_or(self.compute_s_per_byte * bytes as f64)
    }

    fn copy_s(&self, bytes: u64) -> f64 {
        bytes as f64 / self.link_bytes_per_s + self.copy_latency_s
    }
}

/// Why a budget cannot be planned.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// The configuration does not resolve.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The configuration has no `device_budget`.
    #[error(
        "`device_budget` is not set; allowed: a layerwise configuration with `device_budget` = {forms}"
    )]
    NoBudget {
        /// [`BYTE_SIZE_FORMS`].
        forms: &'static str,
    },
    /// A configuration with `device_budget` where a planned one is needed
    /// (its residency is the planner's choice, not yet made).
    #[error(
        "`device_budget` = {budget} is an input of the budget planner; allowed here: the configuration budget::plan returns (with resident_blocks)"
    )]
    Unplanned {
        /// The budget.
        budget: DeviceBudget,
    },
    /// A backend was given a `device_budget` configuration but nothing to
    /// plan it with.
    #[error(
        "`device_budget` = {budget} needs what the planner knows; allowed: CorePlatform::with_planner(PlannerInputs) with the link, each block's compute and the activations a warm-up measured, or a configuration budget::plan returned"
    )]
    NoPlannerInputs {
        /// The budget.
        budget: DeviceBudget,
    },
    /// An input the planner cannot use.
    #[error("planner input `{input}` = {value} is not allowed; allowed: {allowed}")]
    Input {
        /// The input's name.
        input: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        allowed: &'static str,
    },
    /// The budget is below the least any schedule needs.
    #[error(
        "`device_budget` = {budget} does not fit: the least this pipeline needs is {minimum} B ({minimum_gib:.2} GiB) = {non_streamed} B outside the blocks + {forced_resident} B of blocks larger than a slot + 2 slots of {slot_bytes} B + {activation_bytes} B of activations; allowed: device_budget ≥ {minimum} B"
    )]
    DoesNotFit {
        /// The budget.
        budget: ByteSize,
        /// The least budget that fits.
        minimum: u64,
        /// `minimum` in GiB.
        minimum_gib: f64,
        /// Weights outside every block (always resident).
        non_streamed: u64,
        /// Blocks the minimal schedule keeps resident because they are
        /// larger than its slot.
        forced_resident: u64,
        /// The minimal schedule's slot.
        slot_bytes: u64,
        /// The activations.
        activation_bytes: u64,
    },
}

/// What the planner chose.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BudgetPlan {
    /// The configuration to run: the input's, with `device_budget`
    /// replaced by the chosen `resident_blocks` (every block when
    /// everything fits).
    pub config: OffloadConfig,
    /// The prefetch depth (0 when nothing streams).
    pub depth: usize,
    /// The budget.
    pub budget_bytes: u64,
    /// Weights outside every block.
    pub non_streamed_bytes: u64,
    /// Blocks kept resident.
    pub resident_block_bytes: u64,
    /// How many blocks stay resident, of how many.
    pub resident_blocks: usize,
    /// Every block of every stack.
    pub blocks: usize,
    /// Bytes streamed per forward of every stack.
    pub streamed_bytes: u64,
    /// Slots (`depth + 1`, 0 when nothing streams).
    pub slots: usize,
    /// Bytes of one slot (the largest streamed block).
    pub slot_bytes: u64,
    /// The activations.
    pub activation_bytes: u64,
    /// Predicted device bytes at peak: non-streamed + resident blocks +
    /// slots + activations (≤ the budget).
    pub peak_bytes: u64,
    /// Predicted forward time of every stack, seconds.
    pub predicted_step_s: f64,
    /// `max(compute, streamed / bandwidth)` for this plan, seconds.
    pub limit_s: f64,
    /// The least budget that fits this pipeline (see [`BudgetError::DoesNotFit`]).
    pub minimum_bytes: u64,
}

impl BudgetPlan {
    /// Bytes the budget leaves for resident blocks once the non-streamed
    /// part, the activations and the slots are paid: what
    /// `resident_block_bytes` fills.
    pub fn available_for_blocks(&self) -> u64 {
        self.budget_bytes.saturating_sub(
            self.non_streamed_bytes + self.activation_bytes + self.slots as u64 * self.slot_bytes,
        )
    }
}

impl fmt::Display for BudgetPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let gb = |b: u64| b as f64 / 1e9;
        writeln!(
            f,
            "budget {:.2} GB: {} of {} blocks resident ({:.2} GB) + {:.2} GB outside blocks; {:.2} GB streamed per forward through {} slots of {:.3} GB (prefetch depth {}); activations {:.2} GB",
            gb(self.budget_bytes),
            self.resident_blocks,
            self.blocks,
            gb(self.resident_block_bytes),
            gb(self.non_streamed_bytes),
            gb(self.streamed_bytes),
            self.slots,
            gb(self.slot_bytes),
            self.depth,
            gb(self.activation_bytes),
        )?;
        write!(
            f,
            "predicted peak {:.2} GB of {:.2} GB; predicted step {:.4} s (limit max(compute, streamed / link) {:.4} s, ratio {:.3}); least budget that fits {:.2} GB",
            gb(self.peak_bytes),
            gb(self.budget_bytes),
            self.predicted_step_s,
            self.limit_s,
            self.predicted_step_s / self.limit_s.max(f64::MIN_POSITIVE),
            gb(self.minimum_bytes),
        )
    }
}

/// One block as the planner sees it.
#[derive(Clone, Debug)]
struct PBlock {
    path: String,
    bytes: u64,
    compute_s: f64,
}

/// One stack's blocks and which of them stay resident.
#[derive(Clone, Debug)]
struct PStack {
    blocks: Vec<PBlock>,
}

/// The predicted forward time of one stack (seconds, steady state over
/// forwards that wrap around), with `resident[i]` blocks on the device and
/// the rest streamed through `depth + 1` slots; `other_s` is its compute
/// outside the blocks, run before block 0.
///
/// Fills run in order on one copy stream; the fill of streamed block j
/// starts after the fill before it and after the compute of streamed block
/// j − depth − 1 (whose slot it takes); block i computes after block i − 1
/// and, if streamed, after its fill; the part of it a running fill
/// overlaps takes `1 + interference` times longer.
pub fn predict_step(
    compute_s: &[f64],
    copy_s: &[f64],
    resident: &[bool],
    depth: usize,
    other_s: f64,
    interference: f64,
) -> f64 {
    const FORWARDS: usize = 3;
    let n = compute_s.len();
    let streamed: Vec<usize> = (0..n).filter(|&i| !resident[i]).collect();
    let m = streamed.len();
    let mut t_compute = 0.0f64; // end of the last compute
    let mut t_copy = 0.0f64; // end of the last fill
    // End of compute of each streamed block, in fill order (global index).
    let mut done: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let mut filled: Vec<f64> = Vec::with_capacity(m * FORWARDS);
    let mut ends = [0.0f64; FORWARDS];
    // The fill of global streamed index g, issued lazily in order.
    // Fills are computed lazily in order: fill k needs only the compute of
    // streamed block k − depth − 1, always known by the time block k runs.
    let depth = depth.min(m.saturating_sub(1)).max(1);
    let mut starts: Vec<f64> = Vec::with_capacity(m * FORWARDS);
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
                // Fills up to g + depth are issued by now; only g's matters.
                let ready = fill(g, &done, &mut filled, &mut starts, &mut t_copy);
                t_compute.max(ready)
            };
            // Fills are issued up to `depth` streamed blocks ahead; one
            // still running slows this block's kernels.
            if m > 0 {
                let ahead = done.len() + usize::from(!resident[i]) + depth - 1;
                fill(ahead, &done, &mut filled, &mut starts, &mut t_copy);
            }
            // The part of this block a running fill overlaps.
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
    ends[FORWARDS - 1] - ends[FORWARDS - 2]
}

/// The predicted forward time of every stack `config` streams (a layerwise
/// configuration, `resident_blocks` honoured) at `depth`, from `inputs`:
/// what [`plan`] minimises, for a configuration chosen elsewhere.
pub fn predict_config(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    depth: usize,
    inputs: &PlannerInputs,
) -> Result<f64, BudgetError> {
    check_inputs(inputs)?;
    let resolved = resolve(pipeline, config)?;
    let (stacks, resident) = planner_stacks(&resolved, inputs);
    Ok(predict_all(&stacks, &resident, depth.max(1), inputs))
}

/// The planner's view of `resolved`'s stacks, and which blocks it keeps
/// resident.
fn planner_stacks(
    resolved: &ResolvedPlan,
    inputs: &PlannerInputs,
) -> (Vec<PStack>, Vec<Vec<bool>>) {
    let stacks = resolved
        .stacks
        .iter()
        .map(|s| PStack {
            blocks: s
                .blocks
                .iter()
                .map(|b| PBlock {
                    path: b.path.clone(),
                    bytes: b.bytes,
                    compute_s: inputs.compute_s(&b.path, b.bytes),
                })
                .collect(),
        })
        .collect();
    let resident = resolved
        .stacks
        .iter()
        .map(|s| {
            (0..s.blocks.len())
                .map(|i| s.resident.contains(&i))
                .collect()
        })
        .collect();
    (stacks, resident)
}

/// Plans `config`'s `device_budget` for `pipeline`: see the module docs.
///
/// Fails before anything is allocated: when the configuration does not
/// resolve, has no budget, or the budget is below the least any schedule
/// needs ([`BudgetError::DoesNotFit`] names it).
pub fn plan(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    inputs: &PlannerInputs,
) -> Result<BudgetPlan, BudgetError> {
    let budget = match config.device_budget {
        None => {
            return Err(BudgetError::NoBudget {
                forms: crate::budget::BYTE_SIZE_FORMS,
            });
        }
        Some(DeviceBudget::Bytes(b)) => b,
        Some(DeviceBudget::Auto) => {
            return Err(BudgetError::Unplanned {
                budget: DeviceBudget::Auto,
            });
        }
    };
    // The configuration's own rules first (a budget with another strategy,
    // with resident_layers, with resident_blocks).
    config
        .select()
        .map_err(|e| BudgetError::Plan(PlanError::Config(e)))?;
    check_inputs(inputs)?;
    let mut base = config.clone();
    base.device_budget = None;
    base.resident_blocks = Vec::new();
    if base.diffusion_offload_config.is_none() {
        // A budget alone selected layerwise; keep it selected without one.
        base.enable_layerwise_offload = true;
    }
    let resolved = resolve(pipeline, &base)?;
    plan_resolved(pipeline, &base, &resolved, budget, inputs)
}

fn check_inputs(inputs: &PlannerInputs) -> Result<(), BudgetError> {
    let positive = |x: f64| x.is_finite() && x > 0.0;
    let non_negative = |x: f64| x.is_finite() && x >= 0.0;
    if !positive(inputs.link_bytes_per_s) {
        return Err(BudgetError::Input {
            input: "link_bytes_per_s",
            value: inputs.link_bytes_per_s.to_string(),
            allowed: "a finite number > 0",
        });
    }
    for (input, v) in [
        ("copy_latency_s", inputs.copy_latency_s),
        ("compute_s_per_byte", inputs.compute_s_per_byte),
        ("other_compute_s", inputs.other_compute_s),
    ] {
        if !non_negative(v) {
            return Err(BudgetError::Input {
                input,
                value: v.to_string(),
                allowed: "a finite number ≥ 0",
            });
        }
    }
    if let Some((path, v)) = inputs
        .block_compute_s
        .iter()
        .find(|(_, v)| !non_negative(**v))
    {
        return Err(BudgetError::Input {
            input: "block_compute_s",
            value: format!("{v} for `{path}`"),
            allowed: "a finite number ≥ 0 per block",
        });
    }
    if !(1..=MAX_DEPTH).contains(&inputs.max_depth) {
        return Err(BudgetError::Input {
            input: "max_depth",
            value: inputs.max_depth.to_string(),
            allowed: "1..=64",
        });
    }
    if !(non_negative(inputs.copy_interference) && inputs.copy_interference <= 1.0) {
        return Err(BudgetError::Input {
            input: "copy_interference",
            value: inputs.copy_interference.to_string(),
            allowed: "a finite number in 0..=1 (0.035: kernels 3.5 % slower beside a copy)",
        });
    }
    if inputs.activation_bytes > MAX_ACTIVATION_BYTES {
        return Err(BudgetError::Input {
            input: "activation_bytes",
            value: inputs.activation_bytes.to_string(),
            allowed: "at most 2^60 bytes",
        });
    }
    Ok(())
}

/// The deepest prefetch the planner considers.
pub const MAX_DEPTH: usize = 64;

/// The most activation bytes the planner accepts (sums stay far from
/// `u64::MAX`).
const MAX_ACTIVATION_BYTES: u64 = 1 << 60;

/// Rounds of the planner's local search (each moves one block's residency
/// to a block of the same size).
const SWAP_ROUNDS: usize = 32;

/// A candidate schedule: the resident set per stack and the depth.
#[derive(Clone, Debug)]
struct Candidate {
    resident: Vec<Vec<bool>>,
    depth: usize,
    step_s: f64,
    resident_bytes: u64,
}

fn plan_resolved(
    pipeline: &Pipeline,
    base: &OffloadConfig,
    resolved: &ResolvedPlan,
    budget: ByteSize,
    inputs: &PlannerInputs,
) -> Result<BudgetPlan, BudgetError> {
    let (stacks, _) = planner_stacks(resolved, inputs);
    if let Some(path) = inputs
        .block_compute_s
        .keys()
        .find(|k| !stacks.iter().flat_map(|s| &s.blocks).any(|b| &b.path == *k))
    {
        return Err(BudgetError::Input {
            input: "block_compute_s",
            value: format!("a time for `{path}`"),
            allowed: "times for blocks of the streamed stacks, by path",
        });
    }
    let total: u64 = pipeline.storages().map(|(_, s)| s.bytes).sum();
    let block_bytes: u64 = stacks.iter().flat_map(|s| &s.blocks).map(|b| b.bytes).sum();
    let non_streamed = total - block_bytes;
    let act = inputs.activation_bytes;
    let budget_b = budget.0;
    // Slot sizes worth trying: every distinct block size, largest first.
    let sizes: Vec<u64> = stacks
        .iter()
        .flat_map(|s| &s.blocks)
        .map(|b| b.bytes)
        .collect::<BTreeSet<u64>>()
        .into_iter()
        .rev()
        .collect();
    let minimum = minimum_bytes(&stacks, &sizes, non_streamed, act);
    let n_blocks: usize = stacks.iter().map(|s| s.blocks.len()).sum();
    let all_resident = non_streamed + block_bytes + act;
    if budget_b >= all_resident {
        // Everything fits: every block resident, nothing streams.
        let mut config = base.clone();
        config.resident_blocks = stacks
            .iter()
            .flat_map(|s| &s.blocks)
            .map(|b| b.path.clone())
            .collect();
        let compute: f64 = stacks
            .iter()
            .map(|s| inputs.other_compute_s + s.blocks.iter().map(|b| b.compute_s).sum::<f64>())
            .sum();
        return Ok(BudgetPlan {
            config,
            depth: 0,
            budget_bytes: budget_b,
            non_streamed_bytes: non_streamed,
            resident_block_bytes: block_bytes,
            resident_blocks: n_blocks,
            blocks: n_blocks,
            streamed_bytes: 0,
            slots: 0,
            slot_bytes: 0,
            activation_bytes: act,
            peak_bytes: all_resident,
            predicted_step_s: compute,
            limit_s: compute,
            minimum_bytes: minimum.0.min(all_resident),
        });
    }
    let does_not_fit = || BudgetError::DoesNotFit {
        budget,
        minimum: minimum.0,
        minimum_gib: minimum.0 as f64 / f64::from(1u32 << 30),
        non_streamed,
        forced_resident: minimum.1,
        slot_bytes: minimum.2,
        activation_bytes: act,
    };
    if budget_b < minimum.0 {
        return Err(does_not_fit());
    }
    let mut best: Option<Candidate> = None;
    for &sigma in &sizes {
        for depth in 1..=inputs.max_depth {
            let Some(c) = fill_greedy(&stacks, sigma, depth, budget_b, non_streamed, act, inputs)
            else {
                continue;
            };
            let better = match &best {
                None => true,
                // A shorter step by more than 0.1%, else more resident
                // bytes, else a shallower ring.
                Some(b) => {
                    c.step_s < b.step_s * 0.999
                        || (c.step_s <= b.step_s * 1.001
                            && (c.resident_bytes > b.resident_bytes
                                || (c.resident_bytes == b.resident_bytes && c.depth < b.depth)))
                }
            };
            if better {
                best = Some(c);
            }
        }
    }
    // Some slot size at depth 1 fits whenever budget ≥ minimum (the same
    // sum); refuse rather than panic if that ever stops holding.
    let best = best.ok_or_else(does_not_fit)?;
    let mut resident_paths = Vec::new();
    let (mut resident_block_bytes, mut streamed, mut slot, mut resident_count) = (0, 0, 0, 0);
    let mut compute = 0.0;
    for (s, res) in stacks.iter().zip(&best.resident) {
        compute += inputs.other_compute_s;
        for (b, &r) in s.blocks.iter().zip(res) {
            compute += b.compute_s;
            if r {
                resident_paths.push(b.path.clone());
                resident_block_bytes += b.bytes;
                resident_count += 1;
            } else {
                streamed += b.bytes;
                slot = slot.max(b.bytes);
            }
        }
    }
    let depth = if streamed == 0 { 0 } else { best.depth };
    let slots = if streamed == 0 { 0 } else { depth + 1 };
    let mut config = base.clone();
    config.resident_blocks = resident_paths;
    Ok(BudgetPlan {
        config,
        depth,
        budget_bytes: budget_b,
        non_streamed_bytes: non_streamed,
        resident_block_bytes,
        resident_blocks: resident_count,
        blocks: n_blocks,
        streamed_bytes: streamed,
        slots,
        slot_bytes: slot,
        activation_bytes: act,
        peak_bytes: non_streamed + resident_block_bytes + slots as u64 * slot + act,
        predicted_step_s: best.step_s,
        limit_s: compute.max(streamed as f64 / inputs.link_bytes_per_s),
        minimum_bytes: minimum.0,
    })
}

/// The least budget any schedule fits, with its forced-resident bytes and
/// slot: over slot sizes σ, non-streamed + blocks larger than σ + 2σ +
/// activations, where a ring left with one streamed block keeps it too.
fn minimum_bytes(stacks: &[PStack], sizes: &[u64], non_streamed: u64, act: u64) -> (u64, u64, u64) {
    sizes
        .iter()
        .map(|&sigma| {
            let mut forced = 0;
            let mut slot = 0;
            for s in stacks {
                let small: Vec<&PBlock> = s.blocks.iter().filter(|b| b.bytes <= sigma).collect();
                forced += s
                    .blocks
                    .iter()
                    .filter(|b| b.bytes > sigma)
                    .map(|b| b.bytes)
                    .sum::<u64>();
                if small.len() == 1 {
                    forced += small[0].bytes;
                } else {
                    slot = slot.max(small.iter().map(|b| b.bytes).max().unwrap_or(0));
                }
            }
            (non_streamed + forced + 2 * slot + act, forced, slot)
        })
        .min()
        .unwrap_or((non_streamed + act, 0, 0))
}

/// Makes block `i` of a ring resident, and with it the ring's last
/// streamed block if only that one would be left; returns the bytes made
/// resident.
fn make_resident(blocks: &[PBlock], ring: &mut [bool], i: usize) -> u64 {
    ring[i] = true;
    blocks[i].bytes + keep_no_lone_block(blocks, ring)
}

/// One streaming block cannot form a ring: if a ring has exactly one
/// streamed block, it stays resident too. Returns the bytes that adds.
fn keep_no_lone_block(blocks: &[PBlock], ring: &mut [bool]) -> u64 {
    let mut left = (0..ring.len()).filter(|&j| !ring[j]);
    match (left.next(), left.next()) {
        (Some(lone), None) => {
            ring[lone] = true;
            blocks[lone].bytes
        }
        _ => 0,
    }
}

/// The predicted time of every stack under `resident` at `depth`.
fn predict_all(
    stacks: &[PStack],
    resident: &[Vec<bool>],
    depth: usize,
    inputs: &PlannerInputs,
) -> f64 {
    stacks
        .iter()
        .zip(resident)
        .map(|(s, r)| {
            let compute: Vec<f64> = s.blocks.iter().map(|b| b.compute_s).collect();
            let copy: Vec<f64> = s.blocks.iter().map(|b| inputs.copy_s(b.bytes)).collect();
            predict_step(
                &compute,
                &copy,
                r,
                depth,
                inputs.other_compute_s,
                inputs.copy_interference,
            )
        })
        .sum()
}

/// With slots of σ bytes at `depth`: every block larger than σ resident,
/// then, while the budget allows, the block whose residency shortens the
/// predicted step most (ties: the larger, then the earlier). `None` when
/// the forced part does not fit.
fn fill_greedy(
    stacks: &[PStack],
    sigma: u64,
    depth: usize,
    budget: u64,
    non_streamed: u64,
    act: u64,
    inputs: &PlannerInputs,
) -> Option<Candidate> {
    let mut resident: Vec<Vec<bool>> = stacks
        .iter()
        .map(|s| s.blocks.iter().map(|b| b.bytes > sigma).collect())
        .collect();
    for (s, r) in stacks.iter().zip(resident.iter_mut()) {
        keep_no_lone_block(&s.blocks, r);
    }
    // The slot: the largest block left streaming (σ, unless a lone block
    // at σ went resident).
    let slot = stacks
        .iter()
        .zip(&resident)
        .flat_map(|(s, r)| {
            s.blocks
                .iter()
                .zip(r)
                .filter(|(_, r)| !**r)
                .map(|(b, _)| b.bytes)
        })
        .max()
        .unwrap_or(0);
    let slots_bytes = if slot == 0 {
        0
    } else {
        (depth as u64 + 1) * slot
    };
    let used = |res: &Vec<Vec<bool>>| -> u64 {
        stacks
            .iter()
            .zip(res)
            .flat_map(|(s, r)| {
                s.blocks
                    .iter()
                    .zip(r)
                    .filter(|(_, r)| **r)
                    .map(|(b, _)| b.bytes)
            })
            .sum()
    };
    let fixed = non_streamed + slots_bytes + act;
    if fixed + used(&resident) > budget {
        return None;
    }
    let mut step = predict_all(stacks, &resident, depth, inputs);
    loop {
        let room = budget - fixed - used(&resident);
        let mut pick: Option<(usize, usize, f64, u64)> = None;
        for (si, s) in stacks.iter().enumerate() {
            for (bi, b) in s.blocks.iter().enumerate() {
                if resident[si][bi] || b.bytes > room {
                    continue;
                }
                let mut trial = resident.clone();
                if make_resident(&s.blocks, &mut trial[si], bi) > room {
                    continue;
                }
                let t = predict_all(stacks, &trial, depth, inputs);
                let better = match pick {
                    None => true,
                    Some((_, _, pt, pb)) => {
                        t < pt * (1.0 - 1e-9) || (t <= pt * (1.0 + 1e-9) && b.bytes > pb)
                    }
                };
                if better {
                    pick = Some((si, bi, t, b.bytes));
                }
            }
        }
        let Some((si, bi, t, _)) = pick else { break };
        make_resident(&stacks[si].blocks, &mut resident[si], bi);
        step = t;
    }
    // Then move residency between blocks of one size (memory unchanged)
    // while that shortens the predicted step: greedy choices made early
    // can leave streamed blocks bunched where the link cannot keep up.
    for _ in 0..SWAP_ROUNDS {
        let mut best: Option<(usize, usize, usize, f64)> = None;
        for (si, s) in stacks.iter().enumerate() {
            for (a, ba) in s.blocks.iter().enumerate() {
                if !resident[si][a] || ba.bytes > sigma {
                    continue;
                }
                for (b, bb) in s.blocks.iter().enumerate() {
                    if resident[si][b] || bb.bytes != ba.bytes {
                        continue;
                    }
                    let mut trial = resident.clone();
                    trial[si][a] = false;
                    trial[si][b] = true;
                    let t = predict_all(stacks, &trial, depth, inputs);
                    if t < best.map_or(step, |x| x.3) * (1.0 - 1e-6) {
                        best = Some((si, a, b, t));
                    }
                }
            }
        }
        let Some((si, a, b, t)) = best else { break };
        resident[si][a] = false;
        resident[si][b] = true;
        step = t;
    }
    let resident_bytes = used(&resident);
    Some(Candidate {
        resident,
        depth,
        step_s: step,
        resident_bytes,
    })
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
    /// depth 1 (the fill after the short one waits for the long compute's
    /// slot); depth 2 hides it.
    #[test]
    fn heterogeneous_blocks_idle_the_link_at_depth_one() {
        // Two big blocks (compute 3, copy 3) then four small (compute 0.8,
        // copy 1): the limit is max(compute 9.2, copies 10) = 10.
        let compute = [3.0, 3.0, 0.8, 0.8, 0.8, 0.8];
        let copy = [3.0, 3.0, 1.0, 1.0, 1.0, 1.0];
        let res = [false; 6];
        let d1 = predict_step(&compute, &copy, &res, 1, 0.0, 0.0);
        let d2 = predict_step(&compute, &copy, &res, 2, 0.0, 0.0);
        assert!(d1 > 10.0 + 1e-9, "depth 1: {d1}");
        assert!(d2 < d1, "depth 2 {d2} vs depth 1 {d1}");
    }

    /// A kernel that starts beside a running fill is slowed for the part
    /// the fill overlaps: compute-bound blocks of 10 s whose next fill
    /// (1 s) starts with them take 10 + 0.5 × 1 s at interference 0.5.
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
}
