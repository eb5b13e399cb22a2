//! Helpers shared by the integration tests: small pipelines built the way a
//! runtime author builds theirs, a block-cache hook, and a log capture for
//! warnings and info lines.

pub mod budget;
pub mod scenario;

/// The README, whose every ```` ```rust ```` block is a doctest of this
/// crate: `cargo test --workspace` compiles each one and runs those not
/// marked `no_run` (issue 10: the snippets a newcomer copies must work).
/// They name the backends (feature `backends`, on by default).
#[cfg(feature = "backends")]
#[doc = include_str!("../../README.md")]
mod readme {}

use std::collections::BTreeSet;
use std::io;
use std::sync::{Arc, Mutex};

use offload_core::model::{DType, ModuleBuilder, ModuleId, Pipeline, PipelineBuilder};
use offload_core::runtime::ForwardCtx;
use offload_hooks::{BoxError, ModelHook, PreForward};

/// A weight source that counts its `release` calls (a staged block's pages
/// dropped after its read, CONTRACT §7c) and reads as `inner`.
pub struct CountsReleases {
    /// What it reads.
    pub inner: offload_sim::presets::TrainedWeights,
    /// `release` calls so far.
    pub releases: Arc<std::sync::atomic::AtomicUsize>,
    /// The units released so far.
    pub released: Arc<Mutex<BTreeSet<String>>>,
}

impl offload_core::runtime::WeightSource for CountsReleases {
    fn read(&self, storage: offload_core::model::StorageId, position: u64, dst: &mut [u8]) {
        self.inner.read(storage, position, dst);
    }

    fn release(&self, unit: &offload_core::runtime::Unit) {
        self.releases
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.released
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(unit.name.clone());
    }
}

/// The `tiny-wide` preset's workload (3 steps, 2 requests): linear weights
/// large enough for a lossless code to take them (CONTRACT §7b), small
/// enough for exact payloads.
pub fn tiny_wide_workload() -> offload_sim::harness::Workload {
    let preset = offload_sim::presets::tiny_wide();
    offload_sim::harness::Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 3,
        requests: 2,
    }
}

/// Run options on the H200 profile over weights that look trained, with
/// `bugs` planted, prefetch `depth`, and seeded jitter (probability 0.3, up
/// to 50 µs) where `jitter` gives a seed.
pub fn trained_opts(
    bugs: &[offload_core::runtime::PlantedBug],
    depth: usize,
    jitter: Option<u64>,
) -> offload_sim::harness::RunOptions {
    offload_sim::harness::RunOptions {
        bugs: bugs.to_vec(),
        prefetch_depth: depth,
        trained_weights: true,
        jitter: jitter.map(|seed| offload_sim::Jitter {
            seed,
            probability: 0.3,
            max_ns: 50_000,
        }),
        ..offload_sim::harness::RunOptions::new(offload_sim::DeviceProfile::h200())
    }
}

/// Layerwise offload with `pin_cpu_memory` = `pin` and `host_budget` =
/// `budget` bytes where given (staged masters, CONTRACT §7c).
pub fn staged_layerwise(
    pin: Option<bool>,
    budget: Option<u64>,
) -> offload_sim::harness::StrategyChoice {
    use offload_core::bytes::{ByteSize, HostBudget};
    offload_sim::harness::StrategyChoice::Config(offload_core::OffloadConfig {
        enable_layerwise_offload: true,
        pin_cpu_memory: pin,
        host_budget: budget.map(|b| HostBudget::Bytes(ByteSize::new(b))),
        ..offload_core::OffloadConfig::default()
    })
}

/// A run of staged masters as it must be (CONTRACT §7c): outputs `want`,
/// no checker violation, and the device's own pinned + registered peak
/// within `bound`; `at` names the case in each failure.
pub fn assert_staged_run(o: &offload_sim::harness::RunOutcome, want: &[u64], bound: u64, at: &str) {
    assert_eq!(outputs(o), want, "{at}");
    assert!(
        all_violations(o).is_empty(),
        "{at}: {:#?}",
        all_violations(o)
    );
    assert!(
        host_peak(o) <= bound,
        "{at}: the device's page-locked peak {} is over {bound}",
        host_peak(o)
    );
}

/// A weight source whose reads fail (panic) once armed, from its
/// `fail_at`-th read after the arming on: a checkpoint on a network disk
/// that fails under a reader that unwraps, at the start of a staged fill
/// (`fail_at` 0) or in the middle of a block in parts.
pub struct FailsAtRead {
    inner: offload_sim::presets::TrainedWeights,
    armed: std::sync::atomic::AtomicBool,
    reads: std::sync::atomic::AtomicU64,
    fail_at: u64,
}

impl FailsAtRead {
    /// Over `pipeline`'s trained-looking weights (seed 0), disarmed.
    pub fn new(pipeline: &Pipeline, fail_at: u64) -> Self {
        Self {
            inner: offload_sim::presets::TrainedWeights::new(0, pipeline),
            armed: false.into(),
            reads: 0.into(),
            fail_at,
        }
    }

    /// Arms it (its reads counted from here) or disarms it.
    pub fn arm(&self, armed: bool) {
        use std::sync::atomic::Ordering;
        self.reads.store(0, Ordering::SeqCst);
        self.armed.store(armed, Ordering::SeqCst);
    }
}

impl offload_core::runtime::WeightSource for FailsAtRead {
    fn read(&self, storage: offload_core::model::StorageId, position: u64, dst: &mut [u8]) {
        use std::sync::atomic::Ordering;
        if self.armed.load(Ordering::SeqCst) {
            let n = self.reads.fetch_add(1, Ordering::SeqCst);
            assert!(n < self.fail_at, "the weight source failed at read {n}");
        }
        self.inner.read(storage, position, dst);
    }
}

/// What [`failing_fill_run`] saw: the armed request's error (`None`: it
/// succeeded) and, where a disarmed request followed, its outputs and
/// violation count.
pub type FailedRun = (Option<String>, Option<(Vec<u64>, usize)>);

/// One armed request over a [`FailsAtRead`] failing at `fail_at` (and,
/// where `then_disarmed`, one more request disarmed) of the workload, run
/// options and strategy `make` gives, on a thread of its own with a 120 s
/// deadline, so that a hang is a failure and not a stuck CI. `Err` names
/// what went wrong around the requests: a panic that unwound out of them,
/// or a failed disarmed request. Panics where no answer comes in time.
pub fn failing_fill_run(
    make: impl FnOnce() -> (
        offload_sim::harness::Workload,
        offload_sim::harness::RunOptions,
        offload_sim::harness::StrategyChoice,
    ) + Send
    + 'static,
    fail_at: u64,
    then_disarmed: bool,
) -> Result<FailedRun, String> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (w, o, choice) = make();
        let pipeline = w.preset.pipeline.clone();
        let source = Arc::new(FailsAtRead::new(&pipeline, fail_at));
        let rig = offload_sim::harness::Rig::with_weights(
            pipeline,
            &o,
            Arc::clone(&source) as Arc<dyn offload_core::runtime::WeightSource>,
        )
        .expect("the rig builds");
        let offload_sim::harness::StrategyChoice::Config(config) = &choice else {
            panic!("a failing fill runs under a configuration")
        };
        let mut first = None;
        // (The expected panic's message is printed: the panic hook is
        // process-wide, and other tests' messages need it.)
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            offload_sim::harness::drive(
                rig,
                &choice,
                config,
                &o,
                1,
                |rig| {
                    source.arm(true);
                    let armed = rig.request(&w);
                    if !then_disarmed {
                        return armed;
                    }
                    first = Some(armed.err().map(|e| e.to_string()));
                    source.arm(false);
                    rig.request(&w)
                },
                |_| {},
            )
        }));
        let _ = tx.send(match r {
            Err(_) => Err("a panic unwound out of the request".to_owned()),
            Ok(Ok(_)) if !then_disarmed => Ok((None, None)),
            Ok(Ok(o)) => Ok((
                first.flatten(),
                Some((outputs(&o), all_violations(&o).len())),
            )),
            Ok(Err(f)) if !then_disarmed => Ok((Some(f.error.to_string()), None)),
            Ok(Err(f)) => Err(format!("the run failed: {}", f.error)),
        });
    });
    rx.recv_timeout(std::time::Duration::from_secs(120))
        .unwrap_or_else(|_| panic!("no answer in 120 s (a hang)"))
}

/// The simulated device's own pinned + registered peak of a run.
pub fn host_peak(o: &offload_sim::harness::RunOutcome) -> u64 {
    o.at_end.pinned_peak_bytes + o.at_end.registered_peak_bytes
}

/// Each request's output of a run.
pub fn outputs(o: &offload_sim::harness::RunOutcome) -> Vec<u64> {
    o.requests.iter().map(|r| r.output).collect()
}

/// A run's violations: the device checker's and INV-7's from the device's
/// own counters (`offload_sim::job::memory_violations`).
pub fn all_violations(
    o: &offload_sim::harness::RunOutcome,
) -> Vec<offload_core::invariants::Violation> {
    let mut v = o.violations.clone();
    v.extend(offload_sim::job::memory_violations(o));
    v
}

/// Adds a module list `container` of `n` transformer-like blocks of width
/// `hidden` to `m`.
pub fn blocks(m: &mut ModuleBuilder<'_>, container: &str, n: usize, hidden: u64) {
    m.list(container, n, |_, b| {
        b.parameter("attn.to_qkv.weight", DType::Bf16, &[3 * hidden, hidden])
            .parameter("attn.to_out.weight", DType::Bf16, &[hidden, hidden])
            .parameter("ff.up.weight", DType::Bf16, &[4 * hidden, hidden])
            .parameter("ff.down.weight", DType::Bf16, &[hidden, 4 * hidden])
            .parameter("norm.weight", DType::F32, &[hidden]);
    });
}

/// A DiT at `path` with the given `(container, blocks)` lists, declared as
/// its block containers, plus non-block embeddings.
pub fn dit(b: &mut PipelineBuilder, path: &str, containers: &[(&str, usize)]) {
    let mut m = b.module(path);
    m.parameter("x_embedder.weight", DType::Bf16, &[64, 16])
        .buffer("rope.freqs", DType::F32, &[32], false);
    for (name, n) in containers {
        blocks(&mut m, name, *n, 16);
    }
    let names: Vec<&str> = containers.iter().map(|(n, _)| *n).collect();
    m.block_containers(&names);
}

/// An encoder at `path` with `n` blocks in `layers` (declared).
pub fn encoder(b: &mut PipelineBuilder, path: &str, n: usize) {
    let mut m = b.module(path);
    m.parameter("embed.weight", DType::Bf16, &[100, 16]);
    blocks(&mut m, "layers", n, 16);
    m.block_containers(&["layers"]);
}

/// A VAE at `path` without blocks.
pub fn vae(b: &mut PipelineBuilder, path: &str) {
    b.module(path)
        .parameter("decoder.conv.weight", DType::F16, &[8, 8, 3, 3]);
}

/// A Flux-shaped pipeline (double then single blocks), declared explicitly.
pub fn flux_like(double: usize, single: usize) -> Pipeline {
    let mut b = PipelineBuilder::new("FluxLike");
    dit(
        &mut b,
        "transformer",
        &[
            ("transformer_blocks", double),
            ("single_transformer_blocks", single),
        ],
    );
    encoder(&mut b, "text_encoder", 4);
    vae(&mut b, "vae");
    b.declare_components(offload_core::ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        vae: vec!["vae".into()],
        resident: vec![],
    });
    b.build().expect("flux_like builds")
}

#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl io::Write for Sink {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The process-wide default where no test installs its own: records
/// nothing, but never lets a callsite's interest be cached as "never". A
/// thread without a subscriber of its own (another test, a fill thread)
/// that hits a callsite first would otherwise disable it for every thread,
/// and a test capturing logs beside it would miss its events.
struct Quiet;

impl tracing::Subscriber for Quiet {
    fn register_callsite(
        &self,
        _: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        tracing::subscriber::Interest::sometimes()
    }
    fn enabled(&self, _: &tracing::Metadata<'_>) -> bool {
        false
    }
    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }
    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
    fn event(&self, _: &tracing::Event<'_>) {}
    fn enter(&self, _: &tracing::span::Id) {}
    fn exit(&self, _: &tracing::span::Id) {}
}

/// Runs `f` with a subscriber that records every event at `info` and
/// above; returns `f`'s result and the log text.
pub fn capture_logs<T>(f: impl FnOnce() -> T) -> (T, String) {
    static QUIET: std::sync::Once = std::sync::Once::new();
    // A binary that installed its own default keeps it.
    QUIET.call_once(|| {
        let _ = tracing::subscriber::set_global_default(Quiet);
    });
    let sink = Sink::default();
    let writer = sink.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_max_level(tracing::Level::INFO)
        .without_time()
        .finish();
    // Callsite interest is cached process-wide; a callsite first hit on a
    // thread without a subscriber would stay disabled here without a rebuild.
    let out = tracing::subscriber::with_default(subscriber, || {
        tracing::callsite::rebuild_interest_cache();
        f()
    });
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    (out, text)
}

/// A block cache, as a runtime's feature would install one: its hook skips
/// the forward of every module in the shared set (so the next block arrives
/// unprefetched and offload must copy it on demand).
pub struct BlockCache(pub Arc<Mutex<BTreeSet<ModuleId>>>);

impl BlockCache {
    /// Registers a cache hook reading `skip` on each of `blocks` (named
    /// `block_cache`, which dispatches before `layerwise_offload`).
    pub fn install(
        model: &mut offload_core::runtime::Model,
        blocks: &[ModuleId],
        skip: &Arc<Mutex<BTreeSet<ModuleId>>>,
    ) {
        for b in blocks {
            model
                .hooks_of(*b)
                .register(
                    "block_cache",
                    offload_hooks::HookOwner::new("block_cache"),
                    Box::new(BlockCache(Arc::clone(skip))),
                )
                .expect("the block cache registers on a fresh model");
        }
    }
}

impl ModelHook<ForwardCtx> for BlockCache {
    fn pre_forward(&mut self, ctx: &mut ForwardCtx) -> Result<PreForward, BoxError> {
        let skip = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .contains(&ctx.module);
        Ok(if skip {
            PreForward::Skip
        } else {
            PreForward::Continue
        })
    }
}
