//! The crossover sweep: default layerwise on the simulated device at every
//! token count of a range, each at the look-ahead the core's chooser
//! ([`offload_core::budget::choose_lookahead`]) picks from the kernel
//! model's per-block compute and the link's per-block copy, against the
//! limit `max(compute, streamed bytes / bandwidth)` (docs/PERFORMANCE.md).
//! The same chooser is what the GPU benchmark runs at; here the step is
//! measured on the simulated device, whose happens-before checker sees
//! every fill, wrap-around and slot reuse the deeper look-ahead issues.

use offload_core::OffloadConfig;
use offload_core::budget::{self, BudgetError, Lookahead, RingShape, StagedRing};
use offload_core::lifecycle::OffloadError;
use offload_core::runtime::PlantedBug;

use crate::harness::{RunOptions, StrategyChoice, Workload, blocks_of, dit_charges, run};
use crate::presets::Preset;
use crate::profile::DeviceProfile;

/// One token count of the sweep.
#[derive(Clone, Debug)]
pub struct SweepRow {
    /// Tokens per DiT forward.
    pub tokens: u64,
    /// The look-ahead it ran at (the chooser's).
    pub lookahead: Lookahead,
    /// The simulated steady-state step, ms.
    pub step_ms: f64,
    /// `max(compute, streamed / bandwidth)` of one step, ms.
    pub limit_ms: f64,
    /// What no schedule beats on the simulated device, ms: the limit, or
    /// where the device slows kernels beside copies (its profile's
    /// `copy_interference` i), `compute + i / (1 + i) · streamed /
    /// bandwidth` if longer. (Of the step T, the copies overlap compute
    /// for at least `W/B − (T − C)`, which slows it by i times that.)
    pub floor_ms: f64,
    /// What the device's checkers saw broken.
    pub violations: Vec<String>,
    /// Whether the output equals the resident run's (INV-8).
    pub output_matches: bool,
}

impl SweepRow {
    /// Simulated step over its limit.
    pub fn ratio(&self) -> f64 {
        self.step_ms / self.limit_ms
    }

    /// Simulated step over what no schedule beats on the simulated device.
    pub fn ratio_to_floor(&self) -> f64 {
        self.step_ms / self.floor_ms
    }
}

/// Why a sweep point could not run.
#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    /// The chooser refused its inputs.
    #[error("choosing the look-ahead at {tokens} tokens: {source}")]
    Lookahead {
        /// Tokens per forward.
        tokens: u64,
        /// Why (boxed: a budget error is large).
        source: Box<BudgetError>,
    },
    /// The simulated run failed.
    #[error("simulating layerwise at {tokens} tokens, depth {depth}: {source}")]
    Run {
        /// Tokens per forward.
        tokens: u64,
        /// Its depth.
        depth: usize,
        /// Why (boxed: an offload error is large).
        source: Box<OffloadError>,
    },
    /// The preset has no DiT to stream.
    #[error("preset `{preset}` has no DiT blocks to stream")]
    NoDit {
        /// The preset's name.
        preset: &'static str,
    },
}

/// The ring of `preset`'s (first) DiT at `tokens` as the chooser sees it:
/// each block's compute (the kernel model), its copy (`profile`'s link),
/// the DiT's compute outside its blocks, and the largest block's bytes.
pub fn ring_inputs(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
) -> Option<(Vec<f64>, Vec<f64>, f64, u64)> {
    let p = &preset.pipeline;
    let dit = p.module_id(preset.dits.first()?)?;
    let charges = dit_charges(preset, p, profile, tokens);
    let blocks = blocks_of(p, dit);
    if blocks.is_empty() {
        return None;
    }
    let s = |ns: u64| ns as f64 * 1e-9;
    let compute = blocks.iter().map(|b| s(charges[b].duration_ns)).collect();
    let bytes: Vec<u64> = blocks.iter().map(|b| p.subtree_bytes(*b)).collect();
    let copy = bytes.iter().map(|b| s(profile.h2d_ns(*b))).collect();
    let other = s(charges[&dit].duration_ns);
    Some((compute, copy, other, bytes.into_iter().max().unwrap_or(0)))
}

/// The ring shape of [`ring_inputs`]' compute and copies with `resident`
/// (every block streamed where all false) on `profile`.
fn streamed<'a>(
    compute: &'a [f64],
    copy: &'a [f64],
    resident: &'a [bool],
    other: f64,
    profile: &DeviceProfile,
) -> RingShape<'a> {
    RingShape {
        compute_s: compute,
        copy_s: copy,
        resident,
        other_s: other,
        interference: profile.copy_interference,
    }
}

/// The look-ahead the chooser picks for `preset` at `tokens` (every block
/// streamed, no memory cap: default layerwise), deepest `max_depth`.
pub fn lookahead(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    max_depth: usize,
) -> Result<Lookahead, SweepError> {
    let (compute, copy, other, slot_bytes) =
        ring_inputs(preset, profile, tokens).ok_or(SweepError::NoDit {
            preset: preset.name,
        })?;
    let resident = vec![false; compute.len()];
    let shape = streamed(&compute, &copy, &resident, other, profile);
    budget::choose_lookahead(&shape, slot_bytes, max_depth, None).map_err(|source| {
        SweepError::Lookahead {
            tokens,
            source: Box::new(source),
        }
    })
}

/// The bytes of `preset`'s (first) DiT's blocks and which of them stream
/// staged: all where `host_budget` is `None` (`pin_cpu_memory = false`),
/// else those the host plan stages beyond a budget of that many bytes
/// (`budget::plan_host` with the DiT's own tensors as the transient
/// upload). The engine plans every ring of a pipeline together and counts
/// its largest resident unit as the transient, so this is its plan for a
/// DiT-only preset (`SimStats::host_filled_bytes` per step equals the
/// staged bytes here at 4, 8 and 16 GiB on Flux's DiT), not for a whole
/// pipeline's.
pub fn staged_blocks(
    preset: &Preset,
    tokens: u64,
    host_budget: Option<u64>,
) -> Result<(Vec<u64>, Vec<bool>), SweepError> {
    let p = &preset.pipeline;
    let dit = preset
        .dits
        .first()
        .and_then(|d| p.module_id(d))
        .ok_or(SweepError::NoDit {
            preset: preset.name,
        })?;
    let bytes: Vec<u64> = blocks_of(p, dit)
        .iter()
        .map(|b| p.subtree_bytes(*b))
        .collect();
    let staged = match host_budget {
        None => vec![true; bytes.len()],
        Some(budget) => {
            let blocks: Vec<budget::HostBlock> =
                bytes.iter().map(|b| budget::HostBlock::raw(*b)).collect();
            let transient = p.subtree_bytes(dit) - bytes.iter().sum::<u64>();
            let plan = budget::plan_host(&blocks, transient, Some(budget), true).map_err(|e| {
                SweepError::Lookahead {
                    tokens,
                    source: Box::new(BudgetError::Input {
                        input: "host_budget".to_owned(),
                        value: budget.to_string(),
                        allowed: e.to_string(),
                    }),
                }
            })?;
            plan.staged.iter().map(Option::is_some).collect()
        }
    };
    Ok((bytes, staged))
}

/// The look-ahead the staged chooser
/// ([`offload_core::budget::choose_staged_lookahead`]) picks for `preset`'s
/// DiT at `tokens`, deepest `max_depth`: with every master staged where
/// `host_budget` is `None` (`pin_cpu_memory = false`), else with the blocks
/// the host plan stages beyond a budget of that many bytes, each filled at
/// `profile`'s `host_fill_gbps`
/// through the staging ring the engine makes for them
/// (`budget::host::staging_layout`); the staged blocks are
/// [`staged_blocks`]'s.
pub fn staged_lookahead(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    host_budget: Option<u64>,
    max_depth: usize,
) -> Result<Lookahead, SweepError> {
    let no_dit = || SweepError::NoDit {
        preset: preset.name,
    };
    let (compute, copy, other, slot_bytes) =
        ring_inputs(preset, profile, tokens).ok_or_else(no_dit)?;
    let (bytes, staged) = staged_blocks(preset, tokens, host_budget)?;
    let chooser = |source: BudgetError| SweepError::Lookahead {
        tokens,
        source: Box::new(source),
    };
    let resident = vec![false; compute.len()];
    let shape = streamed(&compute, &copy, &resident, other, profile);
    let largest_staged = (0..bytes.len())
        .filter(|&i| staged[i])
        .map(|i| bytes[i])
        .max()
        .unwrap_or(0);
    let ring = budget::host::staging_layout(largest_staged, host_budget.is_some());
    let host = StagedRing {
        staged: &staged,
        staged_bytes: &bytes,
        fill_bytes_per_s: profile.host_fill_gbps * 1e9,
        buffers: usize::try_from(ring.buffers).unwrap_or(usize::MAX).max(1),
        part_bytes: ring.part_bytes.max(1),
        // The simulated DMA runs at the link beside the host's fills.
        stream_bytes_per_s: None,
    };
    budget::choose_staged_lookahead(&shape, host, slot_bytes, max_depth, None).map_err(chooser)
}

/// [`staged_point_as`] at the look-ahead the staged chooser picks
/// ([`staged_lookahead`], deepest `max_depth`).
pub fn staged_chooser_point(
    preset: &Preset,
    profile: &DeviceProfile,
    (tokens, host_budget, max_depth): (u64, Option<u64>, usize),
    bugs: &[PlantedBug],
    step_sync: bool,
) -> Result<StagedRow, SweepError> {
    let l = staged_lookahead(preset, profile, tokens, host_budget, max_depth)?;
    staged_point_as(
        preset,
        profile,
        tokens,
        (l.depth, host_budget),
        bugs,
        step_sync,
    )
}

/// Default layerwise at `tokens` on `profile`, at the chooser's look-ahead
/// (deepest `max_depth`), with `bugs` planted: the steady-state step from
/// two runs (`steps` and `2 × steps` denoising steps, one request each
/// after a warm-up one), the limit, and what the checkers saw.
pub fn sweep_point(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    max_depth: usize,
    bugs: &[PlantedBug],
) -> Result<SweepRow, SweepError> {
    let lookahead = lookahead(preset, profile, tokens, max_depth)?;
    let config = OffloadConfig {
        enable_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let m = measure(
        preset,
        profile,
        tokens,
        (lookahead.depth, bugs),
        config,
        false,
    )?;
    let i = profile.copy_interference;
    let limit_ms = m.compute_ms.max(m.transfer_ms);
    let floor_ms = limit_ms.max(m.compute_ms + i / (1.0 + i) * m.transfer_ms);
    Ok(SweepRow {
        tokens,
        lookahead,
        step_ms: m.step_ms,
        limit_ms,
        floor_ms,
        violations: m.violations,
        output_matches: m.output_matches,
    })
}

/// Layerwise with every master staged (`pin_cpu_memory = false`, CONTRACT
/// §7c) at `tokens` on `profile`, at look-ahead `depth`, with `bugs`
/// planted: the steady-state step as [`sweep_point`] measures it, beside
/// the staged path's own limit, `max(compute, streamed / bandwidth,
/// streamed / host fill rate)` (the simulated host fills on the engine's
/// thread at the profile's `host_fill_gbps`).
#[derive(Clone, Debug)]
pub struct StagedRow {
    /// Tokens per DiT forward.
    pub tokens: u64,
    /// The look-ahead it ran at.
    pub depth: usize,
    /// The simulated steady-state step, ms.
    pub step_ms: f64,
    /// The resident step's compute, ms.
    pub compute_ms: f64,
    /// The streamed bytes over the link, ms.
    pub transfer_ms: f64,
    /// The bytes the engine filled on the host at the profile's fill
    /// rate, ms.
    pub fills_ms: f64,
    /// The bytes the engine filled on the host per step
    /// (`SimStats::host_filled_bytes`).
    pub filled_bytes: u64,
    /// What the device's checkers saw broken.
    pub violations: Vec<String>,
    /// Whether the output equals the resident run's (INV-8).
    pub output_matches: bool,
}

impl StagedRow {
    /// Simulated step over the staged path's limit.
    pub fn ratio(&self) -> f64 {
        self.step_ms / self.compute_ms.max(self.transfer_ms).max(self.fills_ms)
    }
}

/// [`StagedRow`] at `tokens` and `depth`: every master staged where
/// `host_budget` is `None`, else the masters beyond a host budget of that
/// many bytes (`host_budget`, CONTRACT §7c). Its fills are the bytes the
/// engine filled on the device's host (`SimStats::host_filled_bytes`).
pub fn staged_point(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    (depth, host_budget): (usize, Option<u64>),
    bugs: &[PlantedBug],
) -> Result<StagedRow, SweepError> {
    staged_point_as(preset, profile, tokens, (depth, host_budget), bugs, false)
}

/// [`staged_point`] for a caller that synchronises at each step's end
/// where `step_sync` ([`RunOptions::step_sync`], as `offload-bench` does).
/// The fills run on the simulated host's one clock (inline): with a
/// filler thread the timings depend on the scheduler, and one step's
/// difference between two runs is noise.
pub fn staged_point_as(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    (depth, host_budget): (usize, Option<u64>),
    bugs: &[PlantedBug],
    step_sync: bool,
) -> Result<StagedRow, SweepError> {
    let config = match host_budget {
        None => OffloadConfig {
            enable_layerwise_offload: true,
            pin_cpu_memory: Some(false),
            ..OffloadConfig::default()
        },
        Some(bytes) => OffloadConfig {
            enable_layerwise_offload: true,
            host_budget: Some(offload_core::bytes::HostBudget::Bytes(
                offload_core::bytes::ByteSize::new(bytes),
            )),
            ..OffloadConfig::default()
        },
    };
    let m = measure(preset, profile, tokens, (depth, bugs), config, step_sync)?;
    Ok(StagedRow {
        tokens,
        depth,
        step_ms: m.step_ms,
        compute_ms: m.compute_ms,
        transfer_ms: m.transfer_ms,
        fills_ms: m.filled_bytes as f64 / (profile.host_fill_gbps * 1e9) * 1e3,
        filled_bytes: m.filled_bytes,
        violations: m.violations,
        output_matches: m.output_matches,
    })
}

/// What one configuration measured: [`sweep_point`]'s runs.
struct Measured {
    step_ms: f64,
    compute_ms: f64,
    transfer_ms: f64,
    /// Bytes filled into host staging buffers per step.
    filled_bytes: u64,
    violations: Vec<String>,
    output_matches: bool,
}

/// The steady-state step of `config` at `tokens` and `depth` with `bugs`
/// planted, from two runs (one and two denoising steps, one request each
/// after a warm-up one), the resident run's compute and what the checkers
/// saw.
fn measure(
    preset: &Preset,
    profile: &DeviceProfile,
    tokens: u64,
    (depth, bugs): (usize, &[PlantedBug]),
    config: OffloadConfig,
    step_sync: bool,
) -> Result<Measured, SweepError> {
    const STEPS: usize = 1;
    // One payload byte per MiB of weights: the checksums still read every
    // slot a kernel reads, at a debug build's pace.
    let divisor = (preset.weight_bytes() / (1 << 20))
        .max(1)
        .next_power_of_two();
    let opts = RunOptions {
        prefetch_depth: depth,
        payload_divisor: divisor,
        bugs: bugs.to_vec(),
        step_sync,
        ..RunOptions::new(profile.clone())
    };
    let layerwise = StrategyChoice::Config(config);
    // A caller that waits at each step's end is seen to wait from its
    // second step on (the engine's `end_waited`): both runs lead with one
    // step more, so that the steps they differ by are its steady state.
    let lead = usize::from(step_sync);
    let workload = |steps: usize| Workload {
        preset: preset.clone(),
        tokens,
        steps: lead + steps,
        requests: 1,
    };
    let failed = |f: crate::harness::RunFailure| SweepError::Run {
        tokens,
        depth,
        source: Box::new(f.error),
    };
    // Two requests' denoising, `lead + STEPS` and `lead + 2 × STEPS`
    // steps: their difference is `STEPS` steady-state steps (the cold
    // first fill and the wrap into the decode cancel).
    let short = run(&workload(STEPS), &layerwise, &opts).map_err(failed)?;
    let long = run(&workload(2 * STEPS), &layerwise, &opts).map_err(failed)?;
    let resident = run(&workload(STEPS), &StrategyChoice::Resident, &opts).map_err(failed)?;
    let output_matches = short
        .requests
        .iter()
        .map(|r| r.output)
        .eq(resident.requests.iter().map(|r| r.output));
    let violations = short
        .violations
        .iter()
        .chain(&long.violations)
        .map(ToString::to_string)
        .collect();
    let denoise = |o: &crate::harness::RunOutcome| o.requests.last().map_or(0, |r| r.denoise_ns);
    let step_ms = denoise(&long).saturating_sub(denoise(&short)) as f64 / STEPS as f64 / 1e6;
    let per_step = |ns: u64| ns as f64 / (lead + STEPS) as f64 / 1e6;
    let last = resident.requests.last().cloned().unwrap_or_default();
    let block_bytes = short.requests.last().map_or(0, |r| r.block_bytes) / (lead + STEPS) as u64;
    Ok(Measured {
        step_ms,
        compute_ms: per_step(last.dit_compute_ns),
        transfer_ms: block_bytes as f64 / (profile.h2d_pinned_gbps * 1e9) * 1e3,
        filled_bytes: long
            .at_end
            .host_filled_bytes
            .saturating_sub(short.at_end.host_filled_bytes)
            / STEPS as u64,
        violations,
        output_matches,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::flux1_dev_dit_preset;

    /// The deepest look-ahead the sweep allows: the `prefetch_depth` key's
    /// range (1 to 16). Today's main capped the benchmark's choice at 4.
    const MAX_DEPTH: usize = 16;

    /// Every 1,024 tokens from 1,024 to 16,896.
    fn token_counts() -> impl Iterator<Item = u64> {
        (1..=16u64).map(|k| k * 1024).chain([16_896])
    }

    /// Default layerwise of Flux.1-dev's DiT (19 double, 38 single blocks)
    /// on the simulated H200 at every token count, each at the chooser's
    /// look-ahead: within 1.02 of what no schedule beats, bit-identical to
    /// resident, nothing the checkers see. (The simulated device slows
    /// kernels beside copies by 3.3 %, which no schedule hides where
    /// compute binds: there its floor lies up to 2 % above the plain limit;
    /// both ratios are printed.)
    #[test]
    fn default_layerwise_reaches_its_floor_at_every_token_count() {
        let preset = flux1_dev_dit_preset();
        let profile = DeviceProfile::h200();
        let mut failed = Vec::new();
        for t in token_counts() {
            let r = sweep_point(&preset, &profile, t, MAX_DEPTH, &[]).expect("runs");
            eprintln!(
                "tokens {:>6}  depth {:>2}  slots {:>5.2} GB  step {:>7.2} ms  limit {:>7.2} ms  step/limit {:.4}  step/floor {:.4}  predicted/limit {:.4}",
                r.tokens,
                r.lookahead.depth,
                r.lookahead.slot_memory_bytes as f64 / 1e9,
                r.step_ms,
                r.limit_ms,
                r.ratio(),
                r.ratio_to_floor(),
                r.lookahead.predicted_step_s * 1e3 / r.limit_ms,
            );
            assert!(r.violations.is_empty(), "{t} tokens: {:?}", r.violations);
            assert!(r.output_matches, "{t} tokens: output differs from resident");
            if r.ratio_to_floor() > 1.02 {
                failed.push((t, r.lookahead.depth, r.ratio_to_floor()));
            }
        }
        assert!(
            failed.is_empty(),
            "step / floor above 1.02 (tokens, depth, ratio): {failed:?}"
        );
    }

    /// Every master staged (`pin_cpu_memory = false`) across the staged
    /// path's crossover (9,216 to 16,384 tokens), where the simulated host's fills (526 ms a step at
    /// the profile's 45 GB/s, on the engine's thread) meet compute: a
    /// double block's fill outlasts its compute, a single block's does not.
    /// At a look-ahead of 12 the step is within 1.02 of the staged path's
    /// floor, `max(compute + copies' interference, fills, copies)`:
    /// a block's queued fill holds back no kernels of the blocks before
    /// it, so the host runs its fills ahead through the single blocks
    /// into the double ones. Bit-identical, nothing the checkers see. Seen
    /// red (2026-12-07) with the hook's thread waiting after each block
    /// for the fills of the block it prefetched, as the engine did before:
    /// 1.06–1.14 from 11,264 to 14,336 tokens (at 12,288, 1.13 at depths
    /// 1, 2, 4 and 6 too); and with the ring's last post-forward waiting
    /// for every queued fill (1.06 at 12,288, 1.04 at 13,312).
    #[test]
    fn every_master_staged_runs_its_fills_ahead_at_the_crossover() {
        let preset = flux1_dev_dit_preset();
        let profile = DeviceProfile::h200();
        let i = profile.copy_interference;
        let mut failed = Vec::new();
        for t in (9..=16u64).map(|k| k * 1024) {
            let r = staged_point(&preset, &profile, t, (12, None), &[]).expect("runs");
            let floor = (r.compute_ms + i / (1.0 + i) * r.transfer_ms)
                .max(r.fills_ms)
                .max(r.transfer_ms);
            eprintln!(
                "tokens {t:>6}  step {:>7.2} ms  compute {:>7.2}  copies {:>7.2}  fills {:>7.2}  step/limit {:.4}  step/floor {:.4}",
                r.step_ms,
                r.compute_ms,
                r.transfer_ms,
                r.fills_ms,
                r.ratio(),
                r.step_ms / floor
            );
            assert!(r.violations.is_empty(), "{t} tokens: {:?}", r.violations);
            assert!(r.output_matches, "{t} tokens: output differs from resident");
            if r.step_ms / floor > 1.02 {
                failed.push((t, r.step_ms / floor));
            }
        }
        assert!(
            failed.is_empty(),
            "staged step / floor above 1.02 (tokens, ratio): {failed:?}"
        );
    }

    /// The staged bytes each step fills at `budget` (every master staged
    /// where `None`), and all the DiT's block bytes.
    fn staged_total(preset: &Preset, budget: Option<u64>) -> (u64, u64) {
        let (bytes, staged) = staged_blocks(preset, 4096, budget).expect("plans");
        let filled = (0..bytes.len())
            .filter(|&i| staged[i])
            .map(|i| bytes[i])
            .sum();
        (filled, bytes.iter().sum())
    }

    /// The staged point at `tokens` at the staged chooser's depth, printed,
    /// with what every such point must hold: no violations, the resident
    /// output, and each step filling `staged_bytes` (each staged block
    /// once).
    fn chooser_point(
        preset: &Preset,
        profile: &DeviceProfile,
        (tokens, budget, staged_bytes): (u64, Option<u64>, u64),
        bugs: &[PlantedBug],
        step_sync: bool,
    ) -> StagedRow {
        let r = staged_chooser_point(
            preset,
            profile,
            (tokens, budget, MAX_DEPTH),
            bugs,
            step_sync,
        )
        .expect("runs");
        eprintln!(
            "{bugs:?} budget {budget:?} fills {} GB/s {}",
            profile.host_fill_gbps,
            line(&r)
        );
        assert!(
            r.violations.is_empty(),
            "{tokens} tokens: {:?}",
            r.violations
        );
        assert!(
            r.output_matches,
            "{tokens} tokens: output differs from resident"
        );
        assert_eq!(r.filled_bytes, staged_bytes, "{budget:?}, {tokens} tokens");
        r
    }

    /// One staged point as the sweeps print it.
    fn line(r: &StagedRow) -> String {
        format!(
            "tokens {:>6}  depth {:>2}  step {:>7.2} ms  compute {:>7.2}  copies {:>7.2}  fills {:>7.2}  step/limit {:.4}",
            r.tokens,
            r.depth,
            r.step_ms,
            r.compute_ms,
            r.transfer_ms,
            r.fills_ms,
            r.ratio()
        )
    }

    /// Staged rings at the look-ahead the staged chooser picks
    /// ([`staged_lookahead`]: the recurrence with the host stage), from
    /// 4,096 to 16,384 tokens, every master staged and the masters beyond
    /// an 8 GiB host budget, the host filling at the profile's 45 GB/s and
    /// at 35 (an H100's fills beside the DMA ran 41–46): every step within
    /// 1.02 of the staged path's limit, `max(compute, copies, fills)`,
    /// each step filling exactly the bytes the host plan stages,
    /// bit-identical, nothing the checkers see (worst 1.0107, where the
    /// fills bind). Where the fills outlast a stretch's compute the pinned
    /// chooser's depth is too shallow: seen red (2026-12-07) with the
    /// pinned chooser's depth ([`lookahead`]) at six points, 1.021–1.118:
    /// every master staged at 45 GB/s (13,312 and 14,336 tokens) and at 35
    /// (14,336–16,384), 8 GiB at 35 (12,288); and with each step's filled
    /// bytes read from the two-step run alone.
    #[test]
    fn the_staged_choosers_look_ahead_reaches_the_floor() {
        let preset = flux1_dev_dit_preset();
        let mut failed = Vec::new();
        for (budget, fill_gbps) in [
            (None, 45.0),
            (None, 35.0),
            (Some(8u64 << 30), 45.0),
            (Some(8 << 30), 35.0),
        ] {
            let profile = DeviceProfile {
                host_fill_gbps: fill_gbps,
                ..DeviceProfile::h200()
            };
            let (staged_bytes, all) = staged_total(&preset, budget);
            assert!(staged_bytes > 0 && (budget.is_none() || staged_bytes < all));
            for t in (4..=16u64).map(|k| k * 1024) {
                let r = chooser_point(&preset, &profile, (t, budget, staged_bytes), &[], false);
                if r.ratio() > 1.02 {
                    failed.push((budget, fill_gbps, t, r.depth, r.ratio()));
                }
            }
        }
        assert!(
            failed.is_empty(),
            "staged step / limit above 1.02 (budget, fill GB/s, tokens, depth, ratio): {failed:?}"
        );
    }

    /// The step-end sweep's points: every 1,024 tokens from 1,024 to
    /// 16,896 and two counts between.
    fn step_end_tokens() -> impl Iterator<Item = u64> {
        token_counts().chain([5_000, 11_000])
    }

    /// The worst staged step / limit of a caller that waits at each step's
    /// end, with `bugs` planted, over [`step_end_tokens`] at the staged
    /// chooser's depth on each of `configs` (profile, host budget: `None`
    /// stages every master, fill rate GB/s): the ratio, its tokens and
    /// configuration.
    fn step_end_worst(
        configs: &[(DeviceProfile, Option<u64>, f64)],
        bugs: &[PlantedBug],
    ) -> (f64, u64, String) {
        let preset = flux1_dev_dit_preset();
        let mut worst = (0.0f64, 0u64, String::new());
        for (base, budget, fill_gbps) in configs {
            let profile = DeviceProfile {
                host_fill_gbps: *fill_gbps,
                ..base.clone()
            };
            let (staged_bytes, _) = staged_total(&preset, *budget);
            for t in step_end_tokens() {
                let r = chooser_point(&preset, &profile, (t, *budget, staged_bytes), bugs, true);
                if r.ratio() > worst.0 {
                    let at = format!("{} {budget:?} fills {fill_gbps} GB/s", profile.name);
                    worst = (r.ratio(), t, at);
                }
            }
        }
        worst
    }

    /// A caller that waits at each step's end (`offload-bench` times each
    /// step so) runs no hook while the ring's last block computes: the
    /// last post-forward, having seen the last step's end waited for,
    /// issues the queue there (the next pass's first staged blocks, filled
    /// in host time the wait would idle) while those kernels run, waiting
    /// for a staging buffer only as long as they do. The staged chooser's
    /// depth stays within 1.02 of `max(compute, copies, fills)` at every
    /// 1,024 tokens from 1,024 to 16,896 (and 5,000 and 11,000): on the
    /// `h100` profile at 8 GiB (fills at 45 GB/s) and with every master
    /// staged (35), and on the `h200` profile at 16 GiB (45), each step
    /// filling each staged block once (worst 1.0090). Seen red: with the
    /// queue left to the next forward's hooks (planted
    /// `StepEndLeavesQueue`, the engine of e2d0e9b to a579936) those
    /// blocks fill and copy after the wait, beside nothing (1.20-1.22);
    /// with the loop waiting for a staging buffer behind the copy stream's
    /// backlog (planted `StepEndWaitsOnCopies`, the engine of 5cdbaba) the
    /// wait outlasts the last block and the next step's launches wait for
    /// it: 1.050 at 11,264 tokens on the `h200` profile at 16 GiB.
    #[test]
    fn a_caller_waiting_at_each_steps_end_keeps_the_staged_floor() {
        let configs = [
            (DeviceProfile::h100(), Some(8u64 << 30), 45.0),
            (DeviceProfile::h100(), None, 35.0),
            (DeviceProfile::h200(), Some(16 << 30), 45.0),
        ];
        let clean = step_end_worst(&configs, &[]);
        assert!(
            clean.0 <= 1.02,
            "a waiting caller's staged step / limit {:.4} at {} tokens ({})",
            clean.0,
            clean.1,
            clean.2
        );
        #[cfg(feature = "planted-bugs")]
        {
            let planted = step_end_worst(&configs, &[PlantedBug::StepEndLeavesQueue]);
            assert!(
                planted.0 > 1.04,
                "with the queue left to the next forward the worst point is {:.4}, not above 1.04",
                planted.0
            );
            let planted = step_end_worst(&configs[2..], &[PlantedBug::StepEndWaitsOnCopies]);
            assert!(
                planted.0 > 1.03,
                "with the loop waiting behind the copy stream the worst point is {:.4} at {} tokens ({}), not above 1.03",
                planted.0,
                planted.1,
                planted.2
            );
        }
    }

    /// The deeper look-ahead's wrap-around (the next step's first blocks
    /// fetched during this step's compute-bound tail, into slots this
    /// step's last blocks read) is ordered by the slot's last use: with
    /// that wait planted away, the device's happens-before checker reports
    /// INV-3 at the crossover's depth.
    #[cfg(feature = "planted-bugs")]
    #[test]
    fn a_wrapped_prefetch_that_skips_the_last_use_is_caught_at_depth() {
        let preset = flux1_dev_dit_preset();
        let profile = DeviceProfile::h200();
        let tokens = 10_240;
        let clean = sweep_point(&preset, &profile, tokens, MAX_DEPTH, &[]).expect("runs");
        assert!(clean.lookahead.depth > 4, "{:?}", clean.lookahead);
        assert!(clean.violations.is_empty(), "{:?}", clean.violations);
        let bug = PlantedBug::WrapAroundSkipLastUseWait;
        let r = sweep_point(&preset, &profile, tokens, MAX_DEPTH, &[bug]).expect("runs");
        assert!(
            r.violations.iter().any(|v| v.contains("INV-3")),
            "{bug:?} at depth {}: {:?}",
            r.lookahead.depth,
            r.violations
        );
    }
}
