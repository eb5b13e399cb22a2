//! Several ranks in one process: G simulated devices, one host thread per
//! rank (as one process per GPU), sharing one simulated gather group
//! ([`SimGroup`]). Each rank runs the same workload through its own
//! runtime and backend, as a data- or sequence-parallel runtime does, and
//! the group checks that every rank issues the same collectives in the
//! same order (INV-9).
//!
//! A request on a rank: the encoders (on every rank, or on rank 0 only, as
//! a sequence-parallel runtime that encodes the prompt once), then the
//! runtime's own collective on the same group (an all-gather of each
//! rank's view of the prompt embedding, which a kernel then reads), then
//! the denoising steps, then the VAE, then one host synchronisation to read
//! the output. A rank that fails leaves the group, so the others get typed
//! errors at their next collective instead of waiting for it.

use std::sync::Arc;

use offload_core::device::{Collective, Device, HostSource};
use offload_core::lifecycle::OffloadError;
use offload_core::runtime::WeightSource;
use offload_core::{ComponentName, OffloadConfig};

use crate::collective::{GatherRecord, SimCollective, SimGroup};
use crate::device::{SimDevice, SimDeviceBuffer, SimHostBuffer};
use crate::faults::FaultPlan;
use crate::harness::{
    RequestMeasure, Rig, RunFailure, RunOptions, RunOutcome, StrategyChoice, Workload, drive,
    request_with,
};
use crate::presets::SyntheticWeights;

/// Bytes of each rank's part of the runtime's prompt-embedding all-gather
/// (at least one kept byte: a multiple of the payload divisor).
pub fn embed_shard_bytes(divisor: u64) -> u64 {
    256u64.max(divisor)
}

/// Which ranks run (and may stream) the encoders.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EncoderRanks {
    /// Every rank encodes its own prompt.
    All,
    /// Rank 0 encodes; the others never run the encoders (and do not
    /// stream them).
    First,
}

/// How to run G ranks.
#[derive(Clone, Debug)]
pub struct MultiOptions {
    /// G.
    pub ranks: u32,
    /// Options of every rank (its profile is scaled to G ranks copying at
    /// once, [`crate::DeviceProfile::for_ranks`]).
    pub run: RunOptions,
    /// Faults per rank (missing entries: none).
    pub faults: Vec<FaultPlan>,
    /// Which ranks run the encoders.
    pub encoders: EncoderRanks,
}

/// One rank's run.
#[derive(Debug)]
pub struct RankOutcome {
    /// Its rank.
    pub rank: u32,
    /// What it measured, or how it failed.
    pub result: Result<RunOutcome, RunFailure>,
    /// The collectives it completed, in order.
    pub gathers: Vec<GatherRecord>,
    /// Blocks `disable` handed back to the weight source (each checked
    /// against the weights: a mismatch is an INV-8 violation).
    pub restored_blocks: usize,
}

impl RankOutcome {
    /// Every violation its device saw.
    pub fn violations(&self) -> &[offload_core::invariants::Violation] {
        match &self.result {
            Ok(o) => &o.violations,
            Err(f) => &f.violations,
        }
    }
}

/// The configuration rank `rank` of `ranks` runs `config` with: its rank
/// in `parallel`, a data-parallel group of `ranks` unless the configuration
/// names parallel sizes of its own, and (with [`EncoderRanks::First`]) no
/// encoder offload on ranks that never run the encoders.
pub fn rank_config(
    config: &OffloadConfig,
    rank: u32,
    ranks: u32,
    encoders: EncoderRanks,
) -> OffloadConfig {
    let mut c = config.clone();
    if c.parallel.world_size() == 1 && ranks > 1 {
        c.parallel.data_parallel_size = ranks;
    }
    c.parallel.rank = rank;
    if encoders == EncoderRanks::First
        && rank != 0
        && let Some(compact) = c.diffusion_offload_config.as_mut()
    {
        compact
            .components
            .retain(|n| *n != ComponentName::TextEncoder);
        compact.layer_options.remove("text_encoder");
    }
    c
}

/// The weight source of one rank: synthetic weights, and a check of every
/// block `disable` hands back ([`WeightSource::restore`]): its bytes must
/// be the weights' (INV-8), with a payload divisor at the kept positions.
struct Restored {
    weights: SyntheticWeights,
    divisor: u64,
    blocks: std::sync::Mutex<Vec<String>>,
    wrong: std::sync::Mutex<Vec<String>>,
}

impl WeightSource for Restored {
    fn read(&self, storage: offload_core::model::StorageId, position: u64, dst: &mut [u8]) {
        self.weights.read(storage, position, dst);
    }

    /// Checked with every payload byte kept only: a real-model-sized run
    /// (a sampled payload) would hand back its whole logical size.
    fn wants_restore(&self) -> bool {
        self.divisor == 1
    }

    fn restore(&self, unit: &offload_core::runtime::Unit, bytes: &[u8]) {
        let mut wrong = None;
        if bytes.len() as u64 != unit.bytes {
            wrong = Some(format!("{} bytes, not {}", bytes.len(), unit.bytes));
        }
        for e in &unit.entries {
            if wrong.is_some() {
                break;
            }
            let mut want = vec![0u8; e.bytes as usize];
            self.weights.read(e.storage, 0, &mut want);
            let got = &bytes[e.offset as usize..(e.offset + e.bytes) as usize];
            if let Some(i) = (0..want.len())
                .filter(|i| ((e.offset as usize + i) as u64).is_multiple_of(self.divisor))
                .find(|&i| got[i] != want[i])
            {
                wrong = Some(format!("byte {} of storage {:?}", i, e.storage));
            }
        }
        if let Ok(mut v) = self.blocks.lock() {
            v.push(unit.name.clone());
        }
        if let Some(w) = wrong
            && let Ok(mut v) = self.wrong.lock()
        {
            v.push(format!(
                "block `{}` restored at disable differs: {w}",
                unit.name
            ));
        }
    }
}

/// The runtime's own buffers for its prompt-embedding gather on one rank.
struct Embedding {
    len: u64,
    host: SimHostBuffer,
    shard: SimDeviceBuffer,
    gathered: SimDeviceBuffer,
}

impl Embedding {
    fn new(device: &SimDevice, rank: u32, ranks: u32, len: u64) -> Result<Self, OffloadError> {
        let err = |op: &str, e| OffloadError::device(op, e);
        let mut host = device
            .alloc_pinned(len)
            .map_err(|e| err("alloc_pinned(embedding)", e))?;
        let tag: Vec<u8> = (0..len)
            .map(|i| (i as u8) ^ (rank as u8).wrapping_mul(37))
            .collect();
        offload_core::device::HostBuffer::write_from(&mut host, 0, len, &tag);
        let shard = device
            .alloc_device(len)
            .map_err(|e| err("alloc_device(embedding shard)", e))?;
        let gathered = device
            .alloc_device(len * u64::from(ranks))
            .map_err(|e| err("alloc_device(embedding)", e))?;
        Ok(Self {
            len,
            host,
            shard,
            gathered,
        })
    }

    /// Device bytes it holds (not weights: subtracted from the peaks INV-7
    /// compares).
    fn device_bytes(len: u64, ranks: u32) -> u64 {
        len * (1 + u64::from(ranks))
    }

    /// The runtime's collective, on the compute stream: copy this rank's
    /// part in, all-gather everyone's, then a kernel reads the result.
    fn exchange(&self, rig: &Rig, collective: &SimCollective) -> Result<(), OffloadError> {
        let d = &rig.device;
        let compute = rig.runtime.compute_stream();
        let err = |op: &str, e| OffloadError::device(op, e);
        // SAFETY: whole buffers of `len` bytes; the host buffer is not
        // written again, and the stream orders the gather and the kernel
        // after the copy; the buffers are freed only after a device sync.
        unsafe {
            d.copy_h2d(
                compute,
                HostSource::Pinned(&self.host),
                0,
                &self.shard,
                0,
                self.len,
            )
        }
        .map_err(|e| err("copy_h2d(embedding)", e))?;
        // SAFETY: the shard is `len` bytes and `gathered` G times
        // that; both are used only on the compute stream, in order.
        unsafe { collective.all_gather(compute, &self.shard, 0, self.len, &self.gathered, 0) }
            .map_err(|e| err("all_gather(prompt embedding)", e))?;
        d.compute(
            compute,
            &[(&self.gathered, 0..self.gathered_len())],
            1.0e6,
            "prompt embedding",
            &rig.probe.output,
        )
        .map_err(|e| err("compute(prompt embedding)", e))
    }

    fn gathered_len(&self) -> u64 {
        offload_core::device::DeviceBuffer::len_bytes(&self.gathered)
    }

    fn free(self, device: &SimDevice) {
        device.synchronize_all();
        // SAFETY: the device is synchronised: nothing uses them any more.
        unsafe {
            let _ = device.free_device(self.shard, &[]);
            let _ = device.free_device(self.gathered, &[]);
            let _ = device.free_pinned(self.host);
        }
    }
}

/// Runs `w` with `choice` on `m.ranks` ranks, one thread each, and returns
/// every rank's outcome (never hangs: a failed rank leaves the group).
/// Errors only when the group cannot be built.
pub fn run_ranks(
    w: &Workload,
    choice: &StrategyChoice,
    m: &MultiOptions,
) -> Result<Vec<RankOutcome>, OffloadError> {
    let g = m.ranks.max(1);
    let profile = m.run.profile.for_ranks(g);
    let opts: Vec<RunOptions> = (0..g as usize)
        .map(|r| RunOptions {
            profile: profile.clone(),
            faults: m.faults.get(r).copied().unwrap_or_default(),
            ..m.run.clone()
        })
        .collect();
    let devices = opts
        .iter()
        .map(|o| SimDevice::new(o.sim_config()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| OffloadError::device("SimDevice::new", e))?;
    let collectives = SimGroup::new(&devices)
        .ranks()
        .map_err(|e| OffloadError::device("SimGroup::new", e))?;
    let outcomes = std::thread::scope(|s| {
        let handles: Vec<_> = devices
            .into_iter()
            .zip(collectives)
            .zip(&opts)
            .enumerate()
            .map(|(r, ((device, collective), opts))| {
                s.spawn(move || rank_run(w, choice, m, opts, r as u32, device, collective))
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join().unwrap_or_else(|_| RankOutcome {
                    rank: r as u32,
                    result: Err(RunFailure::from(OffloadError::Request {
                        reason: format!("rank {r}'s thread panicked"),
                    })),
                    gathers: Vec::new(),
                    restored_blocks: 0,
                })
            })
            .collect()
    });
    Ok(outcomes)
}

fn rank_run(
    w: &Workload,
    choice: &StrategyChoice,
    m: &MultiOptions,
    opts: &RunOptions,
    rank: u32,
    device: SimDevice,
    collective: SimCollective,
) -> RankOutcome {
    // Leaves the group however this rank ends (an early return, a panic).
    struct Leave<'a>(&'a SimCollective);
    impl Drop for Leave<'_> {
        fn drop(&mut self) {
            self.0.depart();
        }
    }
    let _leave = Leave(&collective);
    let g = m.ranks.max(1);
    let config = rank_config(&choice.config(), rank, g, m.encoders);
    let choice = match choice {
        StrategyChoice::Resident => StrategyChoice::Resident,
        StrategyChoice::Config(_) => StrategyChoice::Config(config.clone()),
    };
    let encodes = m.encoders == EncoderRanks::All || rank == 0;
    let embed = embed_shard_bytes(opts.payload_divisor);
    let restored = Arc::new(Restored {
        weights: SyntheticWeights { seed: opts.seed },
        divisor: opts.payload_divisor,
        blocks: Default::default(),
        wrong: Default::default(),
    });
    let weights: Arc<dyn WeightSource> = Arc::clone(&restored) as Arc<dyn WeightSource>;
    let result = (|| {
        let embedding = Embedding::new(&device, rank, g, embed)?;
        device.reset_peak();
        let rig = Rig::on_device(
            device.clone(),
            w.preset.pipeline.clone(),
            opts,
            weights,
            Some(collective.clone()),
        )?;
        let embedding = std::cell::RefCell::new(Some(embedding));
        let out = drive(
            rig,
            &choice,
            &config,
            opts,
            w.requests,
            |rig| {
                request_with(rig, w, encodes, || {
                    let e = embedding.borrow();
                    e.as_ref()
                        .expect("freed only at teardown")
                        .exchange(rig, &collective)
                })
            },
            |device| {
                if let Some(e) = embedding.borrow_mut().take() {
                    e.free(device);
                }
            },
        );
        Ok::<_, OffloadError>(out)
    })();
    let mut result = match result {
        Ok(r) => r,
        Err(e) => Err(RunFailure::from(e)),
    };
    // The embedding's buffers are the runtime's, not weights.
    let harness_bytes = Embedding::device_bytes(embed, g);
    if let Ok(out) = &mut result {
        out.at_end.device_peak_bytes = out.at_end.device_peak_bytes.saturating_sub(harness_bytes);
        out.at_end.pinned_peak_bytes = out.at_end.pinned_peak_bytes.saturating_sub(embed);
        out.after_enable.pinned_bytes = out.after_enable.pinned_bytes.saturating_sub(embed);
    }
    let wrong: Vec<String> = restored.wrong.lock().map(|v| v.clone()).unwrap_or_default();
    let restored_blocks = restored.blocks.lock().map(|v| v.len()).unwrap_or_default();
    let extra = wrong
        .into_iter()
        .map(|detail| offload_core::invariants::Violation {
            invariant: offload_core::invariants::Invariant::Equivalence,
            detail,
        });
    match &mut result {
        Ok(o) => o.violations.extend(extra),
        Err(f) => f.violations.extend(extra),
    }
    collective.depart();
    RankOutcome {
        rank,
        result,
        gathers: collective.log(),
        restored_blocks,
    }
}

/// Every rank's outputs, request by request (`None` for a failed rank).
pub fn outputs(ranks: &[RankOutcome]) -> Vec<Option<Vec<u64>>> {
    ranks
        .iter()
        .map(|r| {
            r.result.as_ref().ok().map(|o| {
                o.requests
                    .iter()
                    .map(|q: &RequestMeasure| q.output)
                    .collect()
            })
        })
        .collect()
}
