//! Randomised scenarios on the simulated device: a generated pipeline, a
//! configuration, injected faults, and a sequence of operations (enable,
//! requests with skipped blocks, single block forwards, disable) applied to
//! an offloaded runtime and to a resident twin. After every operation the
//! checks of CONTRACT §10 run: no checker violation, identical outputs
//! (INV-8), memory within bounds (INV-7), and a failed `enable` leaves the
//! pipeline exactly as it was (INV-5).

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use offload_core::device::Device;
use offload_core::model::{DType, ModuleId, PipelineBuilder, StorageSpec, TensorSpec};
use offload_core::{ComponentDeclaration, OffloadConfig, Pipeline};
use offload_sim::harness::{
    Rig, RunOptions, StrategyChoice, Workload, blocks_of, host_master_census,
};
use offload_sim::presets::{BlockCost, Preset};
use offload_sim::{DeviceProfile, FaultPlan};
use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::{Config, RngAlgorithm, TestRng, TestRunner};

/// One generated block.
#[derive(Clone, Debug)]
pub struct BlockSpec {
    /// Tensors: dtype and shape.
    pub tensors: Vec<(DType, Vec<u64>)>,
    /// A tied alias of the first tensor inside the block.
    pub tie: bool,
    /// A non-persistent buffer.
    pub buffer: bool,
}

/// One generated pipeline.
#[derive(Clone, Debug)]
pub struct PipeSpec {
    /// Block containers of the DiT, in order.
    pub containers: Vec<Vec<BlockSpec>>,
    /// Layers of the text encoder (a stack when ≥ 2).
    pub encoder_layers: usize,
}

/// A whole scenario.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// The pipeline.
    pub spec: PipeSpec,
    /// The configuration (flags or compact form).
    pub config: OffloadConfig,
    /// Layerwise prefetch depth.
    pub depth: usize,
    /// Faults injected into the offloaded device.
    pub faults: FaultPlan,
    /// Weight seed.
    pub seed: u64,
}

/// One operation.
#[derive(Clone, Debug)]
pub enum Op {
    /// Enable (if disabled).
    Enable,
    /// Disable (if enabled).
    Disable,
    /// A whole request; DiT blocks of these indices are skipped by a cache hook.
    Request {
        /// Denoising steps.
        steps: usize,
        /// Block indices to skip (modulo the block count).
        skip: Vec<usize>,
    },
    /// One DiT block's forward on its own (out of order, repeated).
    Block {
        /// Block index (modulo the block count).
        index: usize,
    },
}

fn block_spec() -> impl Strategy<Value = BlockSpec> {
    let tensor = (
        prop::sample::select(&DType::ALL[..]),
        prop::collection::vec(1u64..12, 1..3),
    );
    (
        prop::collection::vec(tensor, 1..4),
        any::<bool>(),
        prop::bool::weighted(0.2),
    )
        .prop_map(|(tensors, tie, buffer)| BlockSpec {
            tensors,
            tie,
            buffer,
        })
}

/// Pipelines of 1–80 DiT blocks in one or two containers.
pub fn pipe_spec() -> impl Strategy<Value = PipeSpec> {
    (1usize..=80, 0usize..=1, 0usize..4).prop_flat_map(|(n, split, encoder_layers)| {
        prop::collection::vec(block_spec(), n).prop_map(move |blocks| {
            let containers = if split == 1 && blocks.len() > 1 {
                let mid = blocks.len() / 2;
                vec![blocks[..mid].to_vec(), blocks[mid..].to_vec()]
            } else {
                vec![blocks]
            };
            PipeSpec {
                containers,
                encoder_layers,
            }
        })
    })
}

fn config() -> impl Strategy<Value = OffloadConfig> {
    let json = prop_oneof![
        3 => Just(r#"{"enable_layerwise_offload": true}"#),
        2 => Just(r#"{"enable_cpu_offload": true}"#),
        1 => Just(r#"{"enable_cpu_offload": true, "enable_layerwise_offload": true}"#),
        1 => Just(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit"]}}"#),
        1 => Just(r#"{"diffusion_offload_config": {"mode": "layer", "components": ["dit", "text_encoder"]}}"#),
        1 => Just(r#"{"diffusion_offload_config": {"mode": "module", "components": ["dit", "text_encoder"]}}"#),
    ];
    json.prop_map(|j| OffloadConfig::from_json_str(j).expect("scenario configs parse"))
}

/// Whole scenarios: pipeline, configuration, depth, faults, seed.
pub fn scenario() -> impl Strategy<Value = Scenario> {
    let faults = (
        prop::option::weighted(0.25, 1u64..40),
        prop::option::weighted(0.25, 1u64..120),
    )
        .prop_map(|(alloc, copy)| FaultPlan {
            fail_alloc_at: alloc,
            fail_copy_at: copy,
            fail_collective_at: None,
            fail_sync_at: None,
            refuse_pin_every: None,
            refuse_pins: None,
        });
    (pipe_spec(), config(), 1usize..=3, faults, any::<u64>()).prop_map(
        |(spec, config, depth, faults, seed)| Scenario {
            spec,
            config,
            depth,
            faults,
            seed,
        },
    )
}

/// Operations.
pub fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(Op::Enable),
        1 => Just(Op::Disable),
        4 => (1usize..3, prop::collection::vec(0usize..80, 0..3)).prop_map(|(steps, skip)| Op::Request { steps, skip }),
        2 => (0usize..80).prop_map(|index| Op::Block { index }),
    ]
}

/// One scenario and its operations, generated from `seed` alone.
pub fn seeded(seed: u64) -> (Scenario, Vec<Op>) {
    let mut bytes = [0u8; 32];
    bytes[..8].copy_from_slice(&seed.to_le_bytes());
    let rng = TestRng::from_seed(RngAlgorithm::ChaCha, &bytes);
    let mut runner = TestRunner::new_with_rng(Config::default(), rng);
    let strategy = (scenario(), prop::collection::vec(op(), 1..16));
    strategy
        .new_tree(&mut runner)
        .expect("generation")
        .current()
}

/// Builds the pipeline of `spec`.
pub fn build(spec: &PipeSpec) -> Pipeline {
    let mut b = PipelineBuilder::new("Generated");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[8, 4]);
        t.buffer("rope.freqs", DType::F32, &[4, 2], false);
        let names: Vec<String> = (0..spec.containers.len())
            .map(|i| format!("blocks_{i}"))
            .collect();
        for (name, blocks) in names.iter().zip(&spec.containers) {
            t.list(name, blocks.len(), |i, blk| {
                let s = &blocks[i];
                for (k, (dtype, shape)) in s.tensors.iter().enumerate() {
                    blk.parameter(&format!("w{k}"), *dtype, shape);
                }
                if s.tie {
                    let path = format!("transformer.{name}.{i}.w0");
                    blk.tensor(
                        "w0_tied",
                        TensorSpec {
                            storage: StorageSpec::SharedWith(path),
                            ..TensorSpec::parameter(s.tensors[0].0, &[1])
                        },
                    );
                }
                if s.buffer {
                    blk.buffer("cache", DType::F32, &[3], false);
                }
            });
        }
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        t.block_containers(&refs);
    }
    {
        let mut e = b.module("text_encoder");
        e.parameter("embed.weight", DType::Bf16, &[10, 4]);
        e.tie("lm_head.weight", "text_encoder.embed.weight");
        e.list("layers", spec.encoder_layers, |i, l| {
            l.parameter("fc.weight", DType::Bf16, &[4, 4 + i as u64]);
        });
        e.block_containers(&["layers"]);
    }
    b.module("vae")
        .parameter("conv.weight", DType::F16, &[4, 4, 3, 3]);
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        vae: vec!["vae".into()],
        resident: vec![],
    });
    b.build().expect("generated pipelines build")
}

/// Drives one scenario on an offloaded rig and a resident twin.
pub struct Driver {
    scenario: Scenario,
    pipeline: Pipeline,
    blocks: Vec<ModuleId>,
    workload: Workload,
    resident: Rig,
    offloaded: Rig,
    enabled: bool,
    skip: Arc<Mutex<BTreeSet<ModuleId>>>,
    /// What happened, for failure messages.
    pub log: Vec<String>,
}

fn rig_with_cache(
    pipeline: &Pipeline,
    opts: &RunOptions,
    blocks: &[ModuleId],
    skip: &Arc<Mutex<BTreeSet<ModuleId>>>,
) -> Rig {
    let mut rig = Rig::new(pipeline.clone(), opts).expect("rig");
    crate::BlockCache::install(rig.runtime.model_mut(), blocks, skip);
    rig
}

impl Driver {
    /// Builds both rigs and enables the resident twin.
    pub fn new(scenario: Scenario) -> Self {
        Self::planted(scenario, &[])
    }

    /// As [`Self::new`], with `bugs` planted in the offloaded rig (to see
    /// the suite's checks catch them).
    pub fn planted(scenario: Scenario, bugs: &[offload_core::runtime::PlantedBug]) -> Self {
        let pipeline = build(&scenario.spec);
        let blocks = blocks_of(&pipeline, pipeline.module_id("transformer").expect("dit"));
        let skip = Arc::new(Mutex::new(BTreeSet::new()));
        let base = RunOptions {
            prefetch_depth: scenario.depth,
            seed: scenario.seed,
            ..RunOptions::new(DeviceProfile::h200())
        };
        let faulty = RunOptions {
            faults: scenario.faults,
            bugs: bugs.to_vec(),
            ..base.clone()
        };
        let mut resident = rig_with_cache(&pipeline, &base, &blocks, &skip);
        let backend = resident
            .backend(&StrategyChoice::Resident)
            .expect("resident backend");
        resident
            .runtime
            .enable(backend)
            .map_err(|(e, _)| e)
            .expect("resident enable");
        let offloaded = rig_with_cache(&pipeline, &faulty, &blocks, &skip);
        let preset = Preset {
            name: "generated",
            pipeline: pipeline.clone(),
            dits: vec!["transformer"],
            encoders: vec!["text_encoder"],
            vaes: vec!["vae"],
            block_cost: BlockCost {
                hidden: 8,
                attention: true,
            },
            default_tokens: 16,
            text_tokens: 4,
            vae_flops: 1e3,
            vae_channels: [4, 4, 2, 2],
            pixels_per_token: 4,
            vae_chunks: 1,
        };
        let workload = Workload {
            preset,
            tokens: 16,
            steps: 1,
            requests: 1,
        };
        Self {
            scenario,
            pipeline,
            blocks,
            workload,
            resident,
            offloaded,
            enabled: false,
            skip,
            log: Vec::new(),
        }
    }

    fn fail(&self, what: String) -> ! {
        panic!(
            "{what}\nscenario: {:?}\nlog: {:#?}",
            self.scenario, self.log
        );
    }

    /// Applies one operation and runs every check.
    pub fn apply(&mut self, op: &Op) {
        self.log.push(format!("{op:?}"));
        match op {
            Op::Enable if !self.enabled => self.enable(),
            Op::Disable if self.enabled => self.disable(),
            Op::Request { steps, skip } if self.enabled => self.request(*steps, skip),
            Op::Block { index } if self.enabled => self.block(*index),
            _ => {}
        }
        self.check();
    }

    fn enable(&mut self) {
        let before = self.offloaded.runtime.model().hook_claims();
        let stats_before = self.offloaded.device.stats();
        self.offloaded.device.reset_peak();
        let choice = StrategyChoice::Config(self.scenario.config.clone());
        let backend = match self.offloaded.backend(&choice) {
            Ok(b) => b,
            Err(e) => self.fail(format!("building the backend failed: {e}")),
        };
        match self.offloaded.runtime.enable(backend) {
            Ok(()) => self.enabled = true,
            Err((e, _)) => {
                self.log.push(format!("enable failed: {e}"));
                let after = self.offloaded.runtime.model().hook_claims();
                if let Err(v) = offload_core::invariants::fail_before_mutate(&before, &after) {
                    self.fail(v.to_string());
                }
                let stats = self.offloaded.device.stats();
                if stats.device_bytes != stats_before.device_bytes
                    || stats.pinned_bytes != stats_before.pinned_bytes
                {
                    self.fail(format!("a failed enable left memory behind: {stats:?}"));
                }
            }
        }
    }

    fn disable(&mut self) {
        if let Err(e) = self.offloaded.runtime.disable() {
            self.fail(format!("disable failed: {e}"));
        }
        self.enabled = false;
        let stats = self.offloaded.device.stats();
        if stats.device_bytes != 0 || stats.pinned_bytes != 0 || stats.registered_bytes != 0 {
            self.fail(format!("memory held after disable: {stats:?}"));
        }
    }

    fn set_skip(&self, skip: &[usize]) {
        let mut set = self.skip.lock().expect("no poisoning");
        set.clear();
        set.extend(skip.iter().map(|i| self.blocks[i % self.blocks.len()]));
    }

    fn request(&mut self, steps: usize, skip: &[usize]) {
        self.set_skip(skip);
        let w = Workload {
            steps,
            ..self.workload.clone()
        };
        let expected = self.resident.request(&w).expect("resident request");
        match self.offloaded.request(&w) {
            Ok(got) if got.output != expected.output => {
                self.fail("INV-8: request output differs from the resident run".to_owned())
            }
            Ok(_) => {}
            Err(e) => self.survived(e),
        }
        self.set_skip(&[]);
    }

    fn block(&mut self, index: usize) {
        let block = self.blocks[index % self.blocks.len()];
        let rel = self.pipeline.module(block).path["transformer.".len()..].to_owned();
        let run = |rig: &Rig| -> Result<u64, offload_core::OffloadError> {
            let out = &rig.probe.output;
            rig.device
                .reset_accumulator(rig.runtime.compute_stream(), out)
                .map_err(|e| offload_core::OffloadError::device("reset output", e))?;
            rig.runtime.forward("transformer", |dit| {
                let tensors = dit.pipeline().subtree_tensors(block);
                dit.child(&rel, |b| {
                    Ok(offload_sim::harness::kernel(
                        b, &tensors, 1e3, "block", out,
                    )?)
                })?;
                Ok(())
            })?;
            rig.device
                .synchronize_stream(rig.runtime.compute_stream())
                .map_err(|e| offload_core::OffloadError::device("synchronize_stream", e))?;
            Ok(rig.device.read_accumulator(out))
        };
        let expected = run(&self.resident).expect("resident block");
        match run(&self.offloaded) {
            Ok(got) if got != expected => self.fail(format!("INV-8: block {index} output differs")),
            Ok(_) => {}
            Err(e) => self.survived(e),
        }
    }

    /// A forward failed: only an injected copy fault may cause that.
    fn survived(&mut self, e: offload_core::OffloadError) {
        let text = e.to_string();
        if !text.contains("injected failure") {
            self.fail(format!("forward failed without an injected fault: {text}"));
        }
        self.log.push(format!("survived: {text}"));
    }

    fn check(&self) {
        let violations = self.offloaded.device.violations();
        if !violations.is_empty() {
            self.fail(format!("checker violations: {violations:#?}"));
        }
        if self.enabled {
            self.check_memory();
        }
    }

    /// INV-7 with each strategy's exact bound, against the device's own
    /// peak counters since enable (device weights; pinned + registered host
    /// bytes, staging included); and INV-2 read from the device's host
    /// allocations: each offloaded storage's bytes are held exactly once.
    fn check_memory(&self) {
        let Ok(bounds) = offload_core::runtime::memory_bounds(
            &self.pipeline,
            &self.scenario.config,
            self.scenario.depth,
        ) else {
            return;
        };
        let stats = self.offloaded.device.stats();
        let bounds = if stats.pins_refused > 0 {
            bounds.with_refused_pins()
        } else {
            bounds
        };
        let observed = bounds.observe(
            stats.device_peak_bytes,
            stats.pinned_peak_bytes + stats.registered_peak_bytes,
            stats.locked_peak_bytes,
        );
        if let Err(v) = offload_core::invariants::bounded_memory(&observed, bounds.padding_bytes) {
            self.fail(format!("{v} ({} strategy)", bounds.strategy));
        }
        let Ok(offloaded) =
            offload_core::runtime::offloaded_storages(&self.pipeline, &self.scenario.config)
        else {
            return;
        };
        let weights = offload_sim::presets::SyntheticWeights {
            seed: self.scenario.seed,
        };
        let found =
            host_master_census(&self.offloaded.device, &self.pipeline, &weights, &offloaded);
        let identifiable: Vec<_> = offloaded
            .iter()
            .copied()
            .filter(|s| self.pipeline.storage(*s).bytes >= 16)
            .collect();
        // A refused pin (an injected allocation failure) leaves a layerwise
        // block's master pageable (CONTRACT §7c): then no pinned copy, or
        // its copies in the staging ring, and never more.
        let staged = stats.pins_refused > 0 && bounds.staging_ring_bytes > 0;
        let checked = if staged {
            offload_core::invariants::staged_host_masters(
                identifiable,
                found,
                offload_core::budget::host::HOST_STAGING_BUFFERS as usize,
            )
        } else {
            offload_core::invariants::one_host_master(identifiable, found)
        };
        if let Err(v) = checked {
            self.fail(v.to_string());
        }
    }

    /// The final phase: disable, and everything must drain.
    pub fn finish(mut self) {
        if self.enabled {
            self.disable();
        }
        self.offloaded.device.check_released();
        self.check();
    }
}
