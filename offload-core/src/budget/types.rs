//! The request plan as data: what the planner returns phase by phase
//! ([`RequestPlan`], [`ComponentPlan`]), the device memory and budget it
//! planned for, and why a budget cannot be planned ([`BudgetError`]).

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::bytes::{ByteSize, DeviceBudget};
use crate::declaration::Role;
use crate::measurements::InputSource;
use crate::plan::PlanError;

/// The device's memory, as the backend read it when offload was enabled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceMemory {
    /// Total bytes.
    pub total_bytes: u64,
    /// Free bytes (other processes and the runtime's context excluded).
    pub free_bytes: u64,
}

impl DeviceMemory {
    /// A device of `bytes`, all free (capacity planning without a device).
    pub fn of(bytes: u64) -> Self {
        Self {
            total_bytes: bytes,
            free_bytes: bytes,
        }
    }
}

/// How the budget was arrived at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BudgetSource {
    /// `device_budget` named it.
    Given,
    /// `device_budget = "auto"`: the device's free memory less the headroom.
    Auto {
        /// Free device memory at enable.
        free_bytes: u64,
        /// `device_headroom` (default 1 GiB).
        headroom_bytes: u64,
    },
}

/// What the planner chose for one component.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ComponentMode {
    /// Every weight on the device for the whole request.
    Resident,
    /// Every weight brought in for its forward(s), evicted after (model
    /// level); kept components are resident instead.
    Swapped,
    /// Some blocks stream through a ring of slots in its phase; the rest
    /// (and its weights outside blocks) are held.
    Streamed,
}

impl fmt::Display for ComponentMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ComponentMode::Resident => "resident",
            ComponentMode::Swapped => "swapped",
            ComponentMode::Streamed => "streamed",
        })
    }
}

/// Which limit a phase's time is bound by.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// Its kernels: more residency would not shorten it.
    Compute,
    /// The host→device link: bytes it moves take longer than its compute.
    Link,
}

impl fmt::Display for Limit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Limit::Compute => "compute",
            Limit::Link => "link",
        })
    }
}

/// The parts of one phase's peak device memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PeakParts {
    /// Weights in no component (always resident).
    pub outside_bytes: u64,
    /// Device memory the host masters' mappings take (measured at enable).
    pub mapping_bytes: u64,
    /// The device allocator's slack (its chunk's rounding and the
    /// fragmentation the warm-up measured).
    pub allocator_slack_bytes: u64,
    /// Other components' kept sets.
    pub kept_bytes: u64,
    /// This component's held set (weights outside its blocks, resident
    /// blocks).
    pub held_bytes: u64,
    /// Its slots (`slots × slot_bytes`).
    pub slot_bytes: u64,
    /// Its decode staging buffers (two of its largest coded streamed
    /// block; 0 when nothing streams coded, CONTRACT §7b).
    pub staging_bytes: u64,
    /// Its activations.
    pub activation_bytes: u64,
}

impl PeakParts {
    /// The peak: every part.
    pub fn total(&self) -> u64 {
        self.outside_bytes
            + self.mapping_bytes
            + self.allocator_slack_bytes
            + self.kept_bytes
            + self.held_bytes
            + self.slot_bytes
            + self.staging_bytes
            + self.activation_bytes
    }
}

/// One component's phase of the request, as planned.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ComponentPlan {
    /// The component's path.
    pub path: String,
    /// Its role.
    pub role: Role,
    /// What the planner chose.
    pub mode: ComponentMode,
    /// Whether its held set stays on the device across every phase.
    pub kept: bool,
    /// Its weights.
    pub bytes: u64,
    /// Its held set: on the device during its phase (always, if kept).
    pub held_bytes: u64,
    /// Its blocks that stay resident (held), by path.
    pub resident_blocks: Vec<String>,
    /// Its blocks (every stack).
    pub blocks: usize,
    /// How many stream.
    pub streamed_blocks: usize,
    /// Bytes streamed per forward (as stored: bf16).
    pub streamed_bytes: u64,
    /// Its streamed blocks that stream coded (CONTRACT §7b): copied as
    /// their coded bytes, decoded on the device into their slots.
    pub coded_blocks: Vec<String>,
    /// Bytes its forwards move over the link per forward: `streamed_bytes`
    /// with each coded block at its coded bytes.
    pub link_bytes: u64,
    /// The decodes of its coded blocks per request, s (device time on the
    /// decode stream, at the decoder's measured rate).
    pub decode_s: f64,
    /// Prefetch depth (0 when nothing streams).
    pub depth: usize,
    /// Slots of its phase (`depth + 1`; 0 when nothing streams).
    pub slots: usize,
    /// Bytes of one slot (its largest streamed block).
    pub slot_bytes: u64,
    /// Forwards per request.
    pub forwards: f64,
    /// Its phase's peak and its parts (`peak.total()` ≤ the budget).
    pub peak: PeakParts,
    /// Compute of its forwards per request (every block resident), s.
    pub compute_s: f64,
    /// Bytes its phase moves over the link per request (bring-in and
    /// streaming) over the bandwidth, s.
    pub transfer_s: f64,
    /// Its bring-in at the phase's start (0 when kept), s.
    pub bring_in_s: f64,
    /// The phase's predicted time per request, s.
    pub predicted_s: f64,
    /// What bounds it.
    pub limit: Limit,
    /// Whether the budget kept blocks streaming that would have shortened
    /// it: one more of them resident would not fit some phase.
    pub memory_binds: bool,
    /// Why: the choice, what binds it, and what the alternatives cost.
    pub reason: String,
    /// Where a streamed phase is predicted more than 1 % past the longest
    /// of what bounds it, where the difference goes ([`PastLimit`]);
    /// `None` otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub past_limit: Option<PastLimit>,
}

/// Why a streamed phase is predicted past its bound (CONTRACT §7a): the
/// phase's time from the ring recurrence again without the copies'
/// slowing of the kernels beside them (`copy_interference` 0), then also
/// at the deepest look-ahead the planner allows. The three parts add up
/// to `predicted_s − bound_s`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PastLimit {
    /// The bound, s per request: the bring-in, then the longest of the
    /// forwards' copies, their compute, the host's fills of staged blocks
    /// and the decodes of coded ones.
    pub bound_s: f64,
    /// What the copies' slowing of the kernels beside them adds, s
    /// (`copy_interference`; 0 for measured compute, which already ran
    /// beside the warm-up's copies).
    pub interference_s: f64,
    /// What the look-ahead adds, s: the time at this depth less the time
    /// at `deep_depth` (both without the interference).
    pub lookahead_s: f64,
    /// The deepest look-ahead the planner allows (`max_depth`).
    pub deep_depth: usize,
    /// The slot memory `deep_depth` would take beyond this plan's.
    pub deep_extra_bytes: u64,
    /// The rest, s: what no deeper ring removes (each request's first
    /// fill and bring-in order, copy latencies, blocks whose copy outlasts
    /// the compute that can hide it).
    pub rest_s: f64,
}

/// The least budget any plan needs: the largest phase's own minimum.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct MinimumBudget {
    /// Bytes.
    pub bytes: u64,
    /// The phase (component) that needs it.
    pub phase: String,
    /// Its parts there (no kept sets: the minimum keeps nothing).
    pub parts: PeakParts,
    /// Slots there (2, or 0 when nothing streams in it).
    pub slots: usize,
    /// Each phase's own minimum, in phase order (component path, bytes).
    pub phases: Vec<(String, u64)>,
}

impl MinimumBudget {
    /// The error for a `budget` below this minimum, naming it, its phase
    /// and its parts (every figure in the budget's unit: the one it was
    /// written in, if it was).
    pub fn does_not_fit(&self, budget: ByteSize) -> BudgetError {
        BudgetError::DoesNotFit {
            budget,
            minimum: self.bytes,
            phase: self.phase.clone(),
            outside: self.parts.outside_bytes,
            mapping: self.parts.mapping_bytes,
            slack: self.parts.allocator_slack_bytes,
            held: self.parts.held_bytes,
            slots: self.slots,
            slot_bytes: if self.slots > 0 {
                self.parts.slot_bytes / self.slots as u64
            } else {
                0
            },
            staging: self.parts.staging_bytes,
            activation_bytes: self.parts.activation_bytes,
        }
    }
}

/// The decode staging part of [`BudgetError::DoesNotFit`]'s sum (nothing
/// where the phase decodes nothing).
fn staging_part(budget: &ByteSize, staging: u64) -> String {
    if staging == 0 {
        String::new()
    } else {
        format!(
            " + {} of decode staging buffers (two of its largest coded block)",
            budget.in_unit_of(staging)
        )
    }
}

/// A plan of one strategy alone (for comparison): what the request would
/// take if every component followed it, under the same budget.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Alternative {
    /// `resident`, `model-level` or `layerwise` (encoders and VAE
    /// resident, the DiT's blocks planned).
    pub strategy: String,
    /// Its predicted request time, or `None` when it does not fit.
    pub predicted_request_s: Option<f64>,
    /// Its choices (empty when it does not fit).
    pub choices: Vec<ComponentChoice>,
}

/// The host side of a request plan under `host_budget` (CONTRACT §7a,
/// §7c): what the plan pins and what it stages, against the budget.
///
/// The held set of a swapped component (its weights outside its blocks,
/// its resident blocks) keeps pinned masters: the phase engine brings it
/// in from pinned memory each time its phase begins. A kept component's
/// held set is uploaded once, at enable, from pageable masters through a
/// pinned upload buffer, and pins nothing after. Streamed blocks are
/// pinned as the budget allows ([`super::plan_host`]: spread over the
/// rings), the rest stay in pageable memory and stream through two pinned
/// staging buffers of the largest staged block. The largest unit outside
/// every component is uploaded once through a pinned buffer of its size.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HostSide {
    /// The host budget planned for.
    pub budget_bytes: u64,
    /// How it was found (a size as written, or what `"auto"` read).
    pub source: String,
    /// Pinned masters of the swapped components' held units.
    pub held_bytes: u64,
    /// The kept components' held sets, staged (pageable), uploaded once.
    pub kept_staged_bytes: u64,
    /// The kept components whose held sets are staged, by path.
    pub kept_staged: Vec<String>,
    /// Pinned masters of streamed blocks.
    pub pinned_streamed_bytes: u64,
    /// Staged (pageable) masters of streamed blocks.
    pub staged_bytes: u64,
    /// The staging ring (0 when nothing is staged).
    pub staging_bytes: u64,
    /// The pinned buffer enable's uploads go through: the largest unit
    /// outside every component (whole), or a kept set's staged upload (in
    /// chunks), whichever is larger.
    pub transient_bytes: u64,
    /// Page-locked bytes the plan holds at most: held, pinned streamed,
    /// the staging ring and the transient buffer.
    pub peak_bytes: u64,
    /// The least host budget any plan of this pipeline needs: every block
    /// that can stream staged, the held sets at their least.
    pub least_bytes: u64,
    /// The staged blocks, by path (in ring order).
    pub staged_blocks: Vec<String>,
    /// The host's fill rate staged blocks were priced at (bytes per
    /// second), or `None`: priced at the link, the rate unmeasured.
    pub fill_bytes_per_s: Option<f64>,
    /// Whether staged blocks' pages are released after each read (the
    /// staged bytes exceed what the budget leaves: a checkpoint larger than
    /// the budget must not stay resident).
    pub release_after_read: bool,
}

impl fmt::Display for HostSide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "host budget {:.2} GB ({}): peak {:.2} GB page-locked = {:.2} GB swapped held sets pinned + {:.2} GB streamed blocks pinned + {:.2} GB staging ring + {:.2} GB upload buffer; kept held sets ({:.2} GB) uploaded once from pageable memory; {} streamed blocks ({:.2} GB) staged{}{}; least host budget {:.2} GB",
            gb(self.budget_bytes),
            self.source,
            gb(self.peak_bytes),
            gb(self.held_bytes),
            gb(self.pinned_streamed_bytes),
            gb(self.staging_bytes),
            gb(self.transient_bytes),
            gb(self.kept_staged_bytes),
            self.staged_blocks.len(),
            gb(self.staged_bytes),
            if self.release_after_read {
                ", their pages released after each read"
            } else {
                ""
            },
            match (self.staged_blocks.is_empty(), self.fill_bytes_per_s) {
                (true, _) => String::new(),
                (false, Some(rate)) => format!(", filled at {:.1} GB/s (priced so)", rate / 1e9),
                (false, None) => {
                    ", priced at the link (the host's fill rate unmeasured)".to_owned()
                }
            },
            gb(self.least_bytes)
        )
    }
}

/// The plan of one request under a budget, phase by phase, and why.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct RequestPlan {
    /// The pipeline type.
    pub pipeline_type: String,
    /// The budget planned for.
    pub budget_bytes: u64,
    /// How it was arrived at.
    pub budget: BudgetSource,
    /// The device's memory the budget was checked against.
    pub device: DeviceMemory,
    /// Denoising steps of the request.
    pub steps: u32,
    /// Weights in no component: always resident.
    pub outside_bytes: u64,
    /// Each component's phase, in phase order (encoders, DiTs, VAEs as the
    /// pipeline declares them).
    pub components: Vec<ComponentPlan>,
    /// The predicted request time, s (the phases' sum).
    pub predicted_request_s: f64,
    /// The largest phase peak.
    pub peak_bytes: u64,
    /// The least budget that fits.
    pub minimum: MinimumBudget,
    /// The best plan of each single strategy under the same budget.
    pub alternatives: Vec<Alternative>,
    /// The link the plan assumes, bytes per second.
    pub link_bytes_per_s: f64,
    /// The device allocator's granule the plan rounded allocations to.
    pub allocation_granule_bytes: u64,
    /// Device memory of the host masters' mappings every phase carries.
    pub mapping_bytes: u64,
    /// The device allocator's slack every phase carries.
    pub allocator_slack_bytes: u64,
    /// Where the inputs came from.
    pub source: InputSource,
    /// The host side, under a `host_budget` (`None` without one: every
    /// master pinned).
    pub host: Option<HostSide>,
}

impl RequestPlan {
    /// The choices the backend carries out.
    pub fn choices(&self) -> Vec<ComponentChoice> {
        self.components
            .iter()
            .map(|c| ComponentChoice {
                path: c.path.clone(),
                resident_blocks: c.resident_blocks.clone(),
                depth: c.depth,
                kept: c.kept,
                coded_blocks: c.coded_blocks.clone(),
            })
            .collect()
    }

    /// The phase of `path`.
    pub fn component(&self, path: &str) -> Option<&ComponentPlan> {
        self.components.iter().find(|c| c.path == path)
    }

    /// The predicted time of the denoising phases per step, s.
    pub fn predicted_step_s(&self) -> f64 {
        let denoise: f64 = self
            .components
            .iter()
            .filter(|c| c.role == Role::Dit)
            .map(|c| c.predicted_s)
            .sum();
        denoise / f64::from(self.steps.max(1))
    }
}

fn gb(b: u64) -> f64 {
    b as f64 / 1e9
}

impl fmt::Display for RequestPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let budget = match self.budget {
            BudgetSource::Given => ByteSize::new(self.budget_bytes).to_string(),
            BudgetSource::Auto {
                free_bytes,
                headroom_bytes,
            } => format!(
                "auto = {:.2} GB free − {:.2} GB headroom = {:.2} GB",
                gb(free_bytes),
                gb(headroom_bytes),
                gb(self.budget_bytes)
            ),
        };
        writeln!(
            f,
            "budget {budget}: request of {} steps predicted {:.3} s; peak {:.2} GB; least budget {:.2} GB (the `{}` phase)",
            self.steps,
            self.predicted_request_s,
            gb(self.peak_bytes),
            gb(self.minimum.bytes),
            self.minimum.phase
        )?;
        if self.mapping_bytes > 0 || self.allocator_slack_bytes > 0 {
            writeln!(
                f,
                "  every phase counts {:.3} GB of host mappings (the device's page tables for the pinned or registered host masters and the pinned staging and upload buffers) and {:.3} GB of allocator slack (up to one of its chunks of rounding, and what the warm-up saw its frees leave)",
                gb(self.mapping_bytes),
                gb(self.allocator_slack_bytes)
            )?;
        }
        if self.allocation_granule_bytes > 1 {
            writeln!(
                f,
                "  each allocation counted in whole {} B granules",
                self.allocation_granule_bytes
            )?;
        }
        for c in &self.components {
            let what = match c.mode {
                ComponentMode::Streamed => format!(
                    "streamed: {} of {} blocks through {} slots of {:.3} GB (depth {}), {} resident{}",
                    c.streamed_blocks,
                    c.blocks,
                    c.slots,
                    gb(c.slot_bytes),
                    c.depth,
                    c.blocks - c.streamed_blocks,
                    if c.coded_blocks.is_empty() {
                        String::new()
                    } else {
                        format!(
                            "; {} coded ({:.2} GB on the link per forward for {:.2} GB of weights, decoded through {:.3} GB of staging)",
                            c.coded_blocks.len(),
                            gb(c.link_bytes),
                            gb(c.streamed_bytes),
                            gb(c.peak.staging_bytes)
                        )
                    }
                ),
                m => m.to_string(),
            };
            writeln!(
                f,
                "  {} ({}, {:.2} GB): {what}{}; held {:.2} GB; {} forward(s) {:.3} s ({} bound{}); peak {:.2} GB",
                c.path,
                c.role,
                gb(c.bytes),
                if c.kept && c.mode != ComponentMode::Resident {
                    ", kept across phases"
                } else {
                    ""
                },
                gb(c.held_bytes),
                c.forwards,
                c.predicted_s,
                c.limit,
                if c.memory_binds { ", memory binds" } else { "" },
                gb(c.peak.total()),
            )?;
            writeln!(f, "    why: {}", c.reason)?;
        }
        let alts: Vec<String> = self
            .alternatives
            .iter()
            .map(|a| match a.predicted_request_s {
                Some(t) => format!("{} {t:.3} s", a.strategy),
                None => format!("{} does not fit", a.strategy),
            })
            .collect();
        if let Some(h) = &self.host {
            writeln!(f, "  {h}")?;
        }
        write!(f, "  one strategy alone: {}", alts.join("; "))
    }
}

/// Why a budget cannot be planned.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum BudgetError {
    /// The configuration does not resolve.
    #[error(transparent)]
    Plan(#[from] PlanError),
    /// The configuration has no `device_budget`.
    #[error("`device_budget` is not set; allowed: a configuration with `device_budget` = {forms}")]
    NoBudget {
        /// [`crate::bytes::DEVICE_BUDGET_FORMS`].
        forms: &'static str,
    },
    /// A backend was given a budget but nothing to plan it with.
    #[error(
        "`device_budget` = {budget} needs what the planner knows of this device and request; allowed: a warm-up (the pipeline's warm-up request, PipelineBuilder::warmup_request, and the runtime's request, Runtime::set_request), saved measurements or PlannerInputs (CorePlatform::with_planner)"
    )]
    NoPlannerInputs {
        /// The budget.
        budget: DeviceBudget,
    },
    /// A configuration with `device_budget` where a planned request is
    /// needed (INV-7's bounds of a budget are its plan's, per phase).
    #[error(
        "`device_budget` = {budget} is an input of the request planner; allowed here: a plan's own bounds (runtime::plan_bounds of the RequestPlan budget::plan returns)"
    )]
    Unplanned {
        /// The budget.
        budget: DeviceBudget,
    },
    /// An input the planner cannot use.
    #[error("planner input `{input}` = {value} is not allowed; allowed: {allowed}")]
    Input {
        /// The input's name.
        input: String,
        /// Its value.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// A budget larger than the device.
    #[error(
        "`device_budget` = {budget} is more than the device's memory, {}; allowed: at most {}, or \"auto\"",
        .budget.in_unit_of(*.device_bytes),
        .budget.in_unit_of(*.device_bytes),
    )]
    AboveDevice {
        /// The budget.
        budget: ByteSize,
        /// The device's memory.
        device_bytes: u64,
        /// The same in GiB.
        device_gib: f64,
    },
    /// `"auto"` found no memory beyond the headroom.
    #[error(
        "`device_budget` = \"auto\": the device has {} free and device_headroom is {headroom}, which leaves nothing; allowed: a smaller device_headroom, or free device memory",
        .headroom.in_unit_of(*.free_bytes)
    )]
    NoRoom {
        /// Free device memory.
        free_bytes: u64,
        /// The headroom (as written, or the default).
        headroom: ByteSize,
    },
    /// The budget is below the least any plan needs.
    #[error(
        "`device_budget` = {budget} does not fit: the least this pipeline needs is {}, in the phase of `{phase}`: {} outside every component + {} of host mappings + {} of allocator slack + {} held + {slots} slots of {}{} + {} of activations; allowed: device_budget ≥ {}",
        .budget.in_unit_of_at_least(*.minimum),
        .budget.in_unit_of(*.outside),
        .budget.in_unit_of(*.mapping),
        .budget.in_unit_of(*.slack),
        .budget.in_unit_of(*.held),
        .budget.in_unit_of(*.slot_bytes),
        staging_part(.budget, *.staging),
        .budget.in_unit_of(*.activation_bytes),
        .budget.written_at_least(*.minimum),
    )]
    DoesNotFit {
        /// The budget (the device's free memory where that is less).
        budget: ByteSize,
        /// The least budget that fits, bytes.
        minimum: u64,
        /// The phase that needs it.
        phase: String,
        /// Weights in no component.
        outside: u64,
        /// Device memory of the host masters' mappings.
        mapping: u64,
        /// The device allocator's slack.
        slack: u64,
        /// The phase's held part at its minimum (outside its blocks, and
        /// blocks larger than its slot).
        held: u64,
        /// Its slots.
        slots: usize,
        /// One slot.
        slot_bytes: u64,
        /// Its decode staging buffers (`weight_compression = "lossless"`).
        staging: u64,
        /// Its activations.
        activation_bytes: u64,
    },
    /// The host budget is below the least any plan needs.
    #[error(
        "`host_budget` = {budget} does not fit: the least any plan of this pipeline needs is {} page-locked: {} of held sets pinned (each component's weights outside its blocks, and any block held so that the staging ring stays small) + {} of staging buffers (the ring of the largest block streamed: two of it within 512 MiB, else 512 MiB of parts) + {} for enable's uploads (the largest unit outside the components, or a kept set's staged upload in chunks); allowed: host_budget ≥ {}",
        .budget.in_unit_of_at_least(*.least),
        .budget.in_unit_of(*.held),
        .budget.in_unit_of(*.staging),
        .budget.in_unit_of(*.transient),
        .budget.written_at_least(*.least),
    )]
    HostDoesNotFit {
        /// The host budget.
        budget: ByteSize,
        /// The least host budget, bytes.
        least: u64,
        /// Its held part.
        held: u64,
        /// Its staging ring.
        staging: u64,
        /// Its upload buffer.
        transient: u64,
    },
    /// The warm-up's footprint (nothing kept) needs more host memory than
    /// the host budget, though a plan keeping components may fit it.
    #[error(
        "`host_budget` = {budget} is below what the warm-up needs, {}: it runs with nothing kept, every held set pinned (a plan that keeps components on the device pins less); allowed: host_budget ≥ {}, or saved measurements (`PlannerInputs`, `CorePlatform::with_planner`), which skip the warm-up",
        .budget.in_unit_of_at_least(*.least),
        .budget.written_at_least(*.least),
    )]
    WarmupHostDoesNotFit {
        /// The host budget.
        budget: ByteSize,
        /// What the warm-up needs, bytes.
        least: u64,
    },
    /// Each budget alone has a plan, but no plan fits both.
    #[error(
        "no plan fits `device_budget` = {device} and `host_budget` = {host} together: within the host budget at most {} of swapped held sets can stay pinned (with nothing streamed; less beside a staging ring), and every plan found within the device budget pins more (a swapped component's held set keeps pinned masters, and a phase that cannot stream its largest blocks in its device memory must hold them); allowed: a larger device_budget (its phases can then stream more, or a component be kept) or a larger host_budget",
        .host.in_unit_of(*.held_room)
    )]
    NoPlanFitsBoth {
        /// The device budget.
        device: ByteSize,
        /// The host budget.
        host: ByteSize,
        /// What the host budget leaves for held sets.
        held_room: u64,
    },
    /// The first request ran out of memory twice.
    #[error(
        "a request ran out of device memory in the `{phase}` phase again after the re-plan: it needed {} more than the plan allowed (a budget of {}); allowed: a larger device_budget or device_headroom, or less work per request",
        .budget.in_unit_of_at_least(*.needed_bytes),
        .budget
    )]
    ShortfallAgain {
        /// The phase.
        phase: String,
        /// What it lacked.
        needed_bytes: u64,
        /// The budget (in the unit it was written in).
        budget: ByteSize,
    },
}

/// One component's choice, as the backend carries it out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ComponentChoice {
    /// The component's path.
    pub path: String,
    /// Its blocks that stay resident (held).
    pub resident_blocks: Vec<String>,
    /// Prefetch depth (0 when nothing streams).
    pub depth: usize,
    /// Whether its held set stays on the device across phases.
    pub kept: bool,
    /// Its streamed blocks that stream coded (CONTRACT §7b; empty: none).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub coded_blocks: Vec<String>,
}
