//! INV-7's bounds as a pure function of the pipeline, the configuration and
//! the prefetch depth: what a checker compares the device's own accounting
//! with (the simulator's allocation counters, the CUDA allocator's
//! high-water mark), never a strategy's report of itself.

use crate::config::{OffloadConfig, OffloadStrategy};
use crate::lifecycle::OffloadError;
use crate::model::{Pipeline, StorageId};
use crate::runtime::ring::RingLayout;
use crate::runtime::shared::{plan_and_partition, swapped_components};

/// The most device and host memory a strategy may hold for weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBounds {
    /// The strategy the configuration selects.
    pub strategy: OffloadStrategy,
    /// Device weight bytes: everything for no offload; the resident part
    /// plus `depth + 1` slots of the largest block (its G·s bytes when
    /// gathered) and, when a ring gathers, two shard buffers of the largest
    /// shard, for the streaming strategies; the
    /// resident part plus the largest swapped component for model level.
    pub device_weight_bytes: u64,
    /// The part of `device_weight_bytes` that stays resident by design.
    pub resident_bytes: u64,
    /// One copy of the offloaded weights (all ranks' shards together, for
    /// gathered blocks).
    pub offloaded_bytes: u64,
    /// Host bytes for weights (pinned or registered) on this rank: exactly
    /// one copy of the offloaded weights (nothing for no offload), of which
    /// gathered blocks count 1/G plus the padding, plus the declared
    /// staging.
    pub host_weight_bytes: u64,
    /// The declared staging, included in `host_weight_bytes`: `enable`
    /// uploads each resident unit through one exact-size pinned buffer,
    /// freed before the next, so at most the largest resident unit.
    pub staging_bytes: u64,
    /// Device allocations the strategy makes at most at once (resident
    /// units, slots, a swapped component's units): an allocator that
    /// rounds each allocation up may exceed the byte bound by one granule
    /// per allocation.
    pub device_allocations: u64,
    /// The part of `offloaded_bytes` that is all-gathered (DLO with G > 1):
    /// each rank holds only its shards of it.
    pub gathered_bytes: u64,
    /// G (1 unless something is gathered).
    pub group_size: u32,
    /// This rank's shards beyond `gathered_bytes / G` (rounded up): the
    /// zero padding of `s = ceil(bytes / G)`, less than one byte per
    /// gathered block.
    pub padding_bytes: u64,
    /// With `weight_compression` `"lossless"` or `"auto"`: what coded masters may take
    /// beyond their blocks' bytes ([`crate::device::coded_bound`]'s headers,
    /// included in `host_weight_bytes`), before anything is encoded; the
    /// device bound then also counts two staging buffers of the largest
    /// coded block's bound.
    pub coded_overhead_bytes: u64,
    /// Layerwise with `host_budget` or `pin_cpu_memory = false` (CONTRACT
    /// §7c): the staging ring staged masters stream through, two pinned
    /// buffers of the largest streamed block (included in `staging_bytes`
    /// and `host_weight_bytes`; a staged master holds no pinned copy, so
    /// pinned masters and the ring stay within one copy + this). 0
    /// otherwise: a run whose device refused a pin adds it
    /// ([`Self::with_refused_pins`]). Model level: its one upload buffer
    /// (at most the largest unit, at most 64 MiB; CONTRACT §6), on the
    /// same terms.
    pub host_staging_bytes: u64,
    /// Layerwise: the staging ring's bytes, whether or not declared above;
    /// model level: its upload buffer's.
    pub staging_ring_bytes: u64,
    /// `host_budget` when it is a size: the most pinned + registered bytes
    /// the host may hold for weights (`"auto"` is read at enable, so only
    /// the device's own report can be checked against it).
    pub host_budget_bytes: Option<u64>,
}

/// INV-7's bounds for `pipeline` under `config` at prefetch `depth` (the
/// platform's; the configuration's `prefetch_depth` wins, as it does in
/// the backend), on the rank the configuration's `parallel` section names.
pub fn memory_bounds(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    depth: usize,
) -> Result<MemoryBounds, OffloadError> {
    if let Some(budget) = config.device_budget {
        return Err(OffloadError::Budget(Box::new(
            crate::budget::BudgetError::Unplanned { budget },
        )));
    }
    let (plan, partition) = plan_and_partition(pipeline, config, None)?;
    let total: u64 = partition.all().map(|u| u.bytes).sum();
    let units = partition.all().count() as u64;
    let strategy = plan.strategy();
    let depth = config.prefetch_depth.map_or(depth, |d| d as usize).max(1) as u64;
    let largest_unit = |offloaded: &dyn Fn(&crate::runtime::layout::Unit) -> bool| {
        partition
            .all()
            .filter(|u| !offloaded(u))
            .map(|u| u.bytes)
            .max()
            .unwrap_or(0)
    };
    let (mut gathered_bytes, mut group_size, mut padding_bytes) = (0, 1, 0);
    let mut coded_overhead_bytes = 0;
    let mut host_staging_bytes = 0;
    let mut ring_bytes = 0;
    let (device_weight_bytes, offloaded_bytes, device_allocations, staging_bytes) = match strategy {
        OffloadStrategy::None => (total, 0, units, largest_unit(&|_| false)),
        OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => {
            let group = plan.selection.gather_group;
            let rank = group.rank_of(&config.parallel);
            let layout = RingLayout::new(&plan, &partition, group.size, rank);
            let streamed: u64 = layout.blocks().map(|b| b.unit.bytes).sum();
            let blocks = layout.blocks().count() as u64;
            let streamed_modules: std::collections::BTreeSet<_> =
                layout.blocks().map(|b| b.unit.module).collect();
            let gathered: Vec<&crate::runtime::ring::RingBlock> =
                layout.blocks().filter(|b| b.shard.is_some()).collect();
            gathered_bytes = gathered.iter().map(|b| b.unit.bytes).sum();
            let shares: u64 = gathered.iter().map(|b| b.master_bytes()).sum();
            group_size = if gathered.is_empty() { 1 } else { group.size };
            padding_bytes = shares - gathered_bytes.div_ceil(u64::from(group_size));
            // `disable` restores gathered blocks through one pinned buffer of
            // the largest.
            let restore = gathered.iter().map(|b| b.unit.bytes).max().unwrap_or(0);
            // Coded blocks (CONTRACT §7b): masters up to their bound, and two
            // staging buffers of the largest bound on the device.
            // `"auto"` may code every block: it is bounded as `"lossless"`.
            let coded: Vec<u64> = if config.compression() != crate::config::WeightCompression::None
            {
                layout
                    .blocks()
                    .filter(|b| b.shard.is_none())
                    .map(|b| crate::device::coded_bound(b.unit.bytes, b.unit.entries.len()))
                    .collect()
            } else {
                Vec::new()
            };
            let coded_raw: u64 = layout
                .blocks()
                .filter(|b| b.shard.is_none() && !coded.is_empty())
                .map(|b| b.unit.bytes)
                .sum();
            coded_overhead_bytes = coded.iter().sum::<u64>() - coded_raw;
            let staging_buffers = if coded.is_empty() {
                0
            } else {
                crate::runtime::layerwise::STAGING_BUFFERS as u64
            };
            let staging_device = staging_buffers * coded.iter().copied().max().unwrap_or(0);
            // A layerwise ring stages beyond a host budget, with
            // `pin_cpu_memory = false`, or where the device refuses a pin
            // (`MemoryBounds::with_refused_pins`).
            if strategy == OffloadStrategy::Layerwise {
                ring_bytes = crate::budget::host::staging_ring_bytes(
                    layout.blocks().map(|b| b.unit.bytes).max().unwrap_or(0),
                    config.host_budget.is_some(),
                );
                if config.host_budget.is_some() || !plan.selection.pin_memory {
                    host_staging_bytes = ring_bytes;
                }
            }
            (
                total - streamed
                    + (depth + 1) * layout.slot_bytes
                    + layout.shard_buffers() * layout.shard_bytes
                    + staging_device,
                streamed,
                units - blocks + depth + 1 + layout.shard_buffers() + staging_buffers,
                largest_unit(&|u| streamed_modules.contains(&u.module)).max(restore),
            )
        }
        OffloadStrategy::Planned => {
            // A budget's bounds are its plan's (`plan_bounds`); a
            // configuration with one returned above.
            return Err(OffloadError::Budget(Box::new(
                crate::budget::BudgetError::Unplanned {
                    budget: crate::bytes::DeviceBudget::Auto,
                },
            )));
        }
        OffloadStrategy::ModelLevel => {
            let swapped = swapped_components(pipeline, &plan, &partition);
            let swapped_names: std::collections::BTreeSet<&str> = swapped
                .iter()
                .flat_map(|(_, us)| us.iter().map(|u| u.name.as_str()))
                .collect();
            let staging = largest_unit(&|u| swapped_names.contains(u.name.as_str()));
            let bytes =
                |us: &[&crate::runtime::layout::Unit]| us.iter().map(|u| u.bytes).sum::<u64>();
            let swapped_bytes: u64 = swapped.iter().map(|(_, us)| bytes(us)).sum();
            let swapped_units: u64 = swapped.iter().map(|(_, us)| us.len() as u64).sum();
            let largest = swapped.iter().map(|(_, us)| bytes(us)).max().unwrap_or(0);
            let largest_units = swapped
                .iter()
                .map(|(_, us)| us.len() as u64)
                .max()
                .unwrap_or(0);
            // The upload buffer a staged master goes through (CONTRACT §6,
            // §7c): declared with `pin_cpu_memory = false`, and where the
            // device refuses a pin (`MemoryBounds::with_refused_pins`).
            ring_bytes = partition
                .all()
                .map(|u| u.bytes)
                .max()
                .unwrap_or(0)
                .min(crate::budget::host::UPLOAD_STAGING_BYTES);
            if !plan.selection.pin_memory {
                host_staging_bytes = ring_bytes;
            }
            (
                total - swapped_bytes + largest,
                swapped_bytes,
                units - swapped_units + largest_units,
                staging,
            )
        }
    };
    let local_bytes = offloaded_bytes - gathered_bytes;
    let staging_bytes = staging_bytes + host_staging_bytes;
    Ok(MemoryBounds {
        strategy,
        device_weight_bytes,
        resident_bytes: total - offloaded_bytes,
        offloaded_bytes,
        host_weight_bytes: gathered_bytes.div_ceil(u64::from(group_size))
            + padding_bytes
            + local_bytes
            + coded_overhead_bytes
            + staging_bytes,
        staging_bytes,
        device_allocations,
        gathered_bytes,
        group_size,
        padding_bytes,
        coded_overhead_bytes,
        host_staging_bytes,
        staging_ring_bytes: ring_bytes,
        host_budget_bytes: match config.host_budget {
            Some(crate::bytes::HostBudget::Bytes(b)) => Some(b.bytes()),
            _ => None,
        },
    })
}

impl MemoryBounds {
    /// These bounds for a run whose device refused a pin (its own count): a
    /// layerwise or planned block whose pin was refused streams staged, through the
    /// staging ring (CONTRACT §7c), which the bounds then declare.
    pub fn with_refused_pins(mut self) -> Self {
        if self.host_staging_bytes == 0 && self.staging_ring_bytes > 0 {
            self.host_staging_bytes = self.staging_ring_bytes;
            self.staging_bytes += self.staging_ring_bytes;
            self.host_weight_bytes += self.staging_ring_bytes;
        }
        self
    }

    /// What INV-7's checker ([`crate::invariants::bounded_memory`]) is fed:
    /// these bounds with the peaks a device measured itself: device weight
    /// bytes, host weight bytes (pinned + registered windows) and
    /// page-locked bytes as the device locks them (a registered window's
    /// whole mapping; what a `host_budget` bounds).
    pub fn observe(
        &self,
        peak_device_weight_bytes: u64,
        peak_host_weight_bytes: u64,
        peak_host_locked_bytes: u64,
    ) -> crate::invariants::MemoryObservation {
        crate::invariants::MemoryObservation {
            peak_device_weight_bytes,
            resident_bytes: self.resident_bytes,
            slot_bytes: self.device_weight_bytes - self.resident_bytes,
            host_weight_bytes: peak_host_weight_bytes,
            offloaded_weight_bytes: self.gathered_bytes,
            group_size: self.group_size,
            local_weight_bytes: self.offloaded_bytes - self.gathered_bytes
                + self.coded_overhead_bytes,
            staging_bytes: self.staging_bytes,
            host_budget_bytes: self.host_budget_bytes,
            host_locked_bytes: peak_host_locked_bytes,
        }
    }
}

/// The storages `config` keeps on the host while enabled (its host masters
/// hold them): the streamed blocks for layerwise, the swapped components
/// for model level, none otherwise. The same units `memory_bounds` counts,
/// for checkers that look for them in a device's host memory (INV-2).
pub fn offloaded_storages(
    pipeline: &Pipeline,
    config: &OffloadConfig,
) -> Result<std::collections::BTreeSet<StorageId>, OffloadError> {
    let (plan, partition) = plan_and_partition(pipeline, config, None)?;
    let units: Vec<&crate::runtime::layout::Unit> = match plan.strategy() {
        OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => plan
            .stacks
            .iter()
            .flat_map(|s| s.streamed())
            .map(|b| &partition.blocks[&b.module])
            .collect(),
        OffloadStrategy::ModelLevel => swapped_components(pipeline, &plan, &partition)
            .into_iter()
            .flat_map(|(_, us)| us)
            .collect(),
        _ => Vec::new(),
    };
    Ok(units
        .into_iter()
        .flat_map(|u| u.entries.iter().map(|e| e.storage))
        .collect())
}

/// INV-7's bounds of one phase of a request plan.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhaseBounds {
    /// The component whose phase it is.
    pub component: String,
    /// Device weight bytes while it runs: the weights in no component, the
    /// kept held sets, its own held set, and its slots.
    pub device_weight_bytes: u64,
}

/// INV-7's bounds of a request plan, per phase, computed from its choices
/// and the pipeline (not from the planner's report of its peaks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PlanBounds {
    /// Each phase, in phase order.
    pub phases: Vec<PhaseBounds>,
    /// Device bytes every phase may use in all (weights and activations):
    /// the budget.
    pub budget_bytes: u64,
    /// Host bytes for weights: one copy of every weight of every managed
    /// component (the masters both engines share) plus `staging_bytes`.
    pub host_weight_bytes: u64,
    /// `enable`'s staging: the largest unit outside every component,
    /// uploaded through one exact-size pinned buffer, and under a host
    /// budget the host staging ring (`host_staging_bytes`).
    pub staging_bytes: u64,
    /// Under a `host_budget` (CONTRACT §7c): the most a host staging ring
    /// takes, `budget::host::staging_ring_bytes` of the largest block
    /// (two whole blocks, or a ring of parts; the warm-up's
    /// footprint and the plan may stage different blocks; a staged master
    /// holds no pinned copy). 0 without one.
    pub host_staging_bytes: u64,
    /// The staging ring a staged master streams through (two pinned
    /// buffers of the largest block), whether or not declared above:
    /// without a host budget a block stages only where the device refused
    /// its pin, and the bounds then declare it.
    pub staging_ring_bytes: u64,
    /// The host budget the plan was made within (a size, or what `"auto"`
    /// read at enable): the most pinned + registered bytes.
    pub host_budget_bytes: Option<u64>,
}

impl PlanBounds {
    /// The largest phase's device weight bound.
    pub fn device_weight_bytes(&self) -> u64 {
        self.phases
            .iter()
            .map(|p| p.device_weight_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The bound of `component`'s phase.
    pub fn phase(&self, component: &str) -> Option<&PhaseBounds> {
        self.phases.iter().find(|p| p.component == component)
    }

    /// Each phase's weight bound by component, for
    /// [`crate::invariants::bounded_phases`].
    pub fn by_phase(&self) -> std::collections::BTreeMap<String, u64> {
        self.phases
            .iter()
            .map(|p| (p.component.clone(), p.device_weight_bytes))
            .collect()
    }

    /// The whole request's bounds in the form every strategy's have: the
    /// largest phase's device weight bound, and the host bound.
    pub fn as_memory_bounds(&self) -> MemoryBounds {
        let device = self.device_weight_bytes();
        MemoryBounds {
            strategy: OffloadStrategy::Planned,
            device_weight_bytes: device,
            resident_bytes: device,
            offloaded_bytes: self.host_weight_bytes - self.staging_bytes,
            host_weight_bytes: self.host_weight_bytes,
            staging_bytes: self.staging_bytes,
            device_allocations: u64::MAX,
            gathered_bytes: 0,
            group_size: 1,
            padding_bytes: 0,
            coded_overhead_bytes: 0,
            host_staging_bytes: self.host_staging_bytes,
            staging_ring_bytes: self.staging_ring_bytes,
            host_budget_bytes: self.host_budget_bytes,
        }
    }
}

/// INV-7's bounds of `plan` (a request plan of `pipeline` under `config`),
/// per phase, from its choices: what a checker compares the device's own
/// counters with while each phase runs.
pub fn plan_bounds(
    pipeline: &Pipeline,
    config: &OffloadConfig,
    plan: &crate::budget::RequestPlan,
) -> Result<PlanBounds, OffloadError> {
    let resolved = crate::plan::resolve(pipeline, config)?;
    let groups: Vec<_> = resolved.components.iter().map(|c| c.module).collect();
    let part = crate::runtime::layout::partition(pipeline, &resolved.stacks, &groups);
    let managed: Vec<&crate::plan::ResolvedComponent> = resolved
        .components
        .iter()
        .filter(|c| c.role != crate::declaration::Role::Resident && !c.self_managed)
        .collect();
    let is_managed = |m| managed.iter().any(|c| c.module == m);
    let outside: Vec<&crate::runtime::layout::Unit> =
        part.rest.iter().filter(|u| !is_managed(u.module)).collect();
    let outside_bytes: u64 = outside.iter().map(|u| u.bytes).sum();
    // Each component's held set and slots, from the plan's choices; its
    // coded streamed blocks (CONTRACT §7b) add the two decode staging
    // buffers the plan counted for them (of its largest coded streamed
    // block, at the coded size it planned: the engine allocates exactly
    // that), and their masters up to `coded_bound` on the host.
    let bf16 = crate::runtime::layout::bf16_storages(pipeline);
    let mut coded_overhead = 0u64;
    let mut held = Vec::new();
    for c in &managed {
        let choice = plan
            .choices()
            .into_iter()
            .find(|x| x.path == c.path)
            .ok_or_else(|| OffloadError::Forward {
                module: c.path.clone(),
                reason: "the request plan has no choice for this component".to_owned(),
            })?;
        let mut held_bytes = part.rest_of(c.module).map_or(0, |u| u.bytes);
        let mut streamed_max = 0;
        for stack in resolved.stacks.iter().filter(|s| s.owner == c.path) {
            for b in &stack.blocks {
                let unit = &part.blocks[&b.module];
                let bytes = unit.bytes;
                if choice.resident_blocks.contains(&b.path) {
                    held_bytes += bytes;
                } else {
                    streamed_max = streamed_max.max(bytes);
                    if choice.coded_blocks.contains(&b.path) {
                        let spans = crate::runtime::layout::codec_spans(unit, &bf16).len();
                        let bound = crate::device::coded_bound(bytes, spans);
                        coded_overhead += bound.saturating_sub(bytes);
                    }
                }
            }
        }
        let slots = if streamed_max > 0 {
            choice.depth as u64 + 1
        } else {
            0
        };
        let staging = if choice.coded_blocks.is_empty() {
            0
        } else {
            plan.component(&c.path).map_or(0, |p| p.peak.staging_bytes)
        };
        held.push((
            c.path.clone(),
            held_bytes,
            slots * streamed_max + staging,
            choice.kept,
        ));
    }
    let kept: u64 = held.iter().filter(|h| h.3).map(|h| h.1).sum();
    let phases = held
        .iter()
        .map(|(path, h, slots, k)| PhaseBounds {
            component: path.clone(),
            device_weight_bytes: outside_bytes + kept + if *k { 0 } else { *h } + slots,
        })
        .collect();
    let managed_bytes: u64 = part
        .rest
        .iter()
        .filter(|u| is_managed(u.module))
        .chain(part.blocks.values())
        .map(|u| u.bytes)
        .sum();
    // The ring a staged master streams through: declared under a host
    // budget; without one only where the device refused a pin
    // (`MemoryBounds::with_refused_pins`).
    let ring = crate::budget::host::staging_ring_bytes(
        part.blocks.values().map(|u| u.bytes).max().unwrap_or(0),
        config.host_budget.is_some(),
    );
    let host_staging = if plan.host.is_some() { ring } else { 0 };
    let staging = outside.iter().map(|u| u.bytes).max().unwrap_or(0) + host_staging;
    Ok(PlanBounds {
        phases,
        budget_bytes: plan.budget_bytes,
        host_weight_bytes: managed_bytes + staging + coded_overhead,
        staging_bytes: staging,
        host_staging_bytes: host_staging,
        staging_ring_bytes: ring,
        host_budget_bytes: plan.host.as_ref().map(|h| h.budget_bytes),
    })
}
