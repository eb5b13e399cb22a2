//! The `tracing` spans a runtime's own subscriber sees (issue 10): one
//! `offload.enable` per backend enable, one `offload.transfer` per transfer
//! the strategies issue (block, bytes, stream, kind) and one
//! `offload.collective` per all-gather, nested in the gather's transfer.
//!
//! One test in its own binary: the subscriber is the process's global
//! default, so the ranks' threads of a multi-rank run report to it too.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex};

use offload_core::OffloadConfig;
use offload_sim::DeviceProfile;
use offload_sim::harness::{Rig, RunOptions, StrategyChoice, Workload, blocks_of};
use offload_sim::multi::{EncoderRanks, MultiOptions, run_ranks};
use offload_sim::presets::tiny;
use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id};
use tracing::{Subscriber, subscriber};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt};

/// One span as created: its name, its fields, the span it was opened in.
#[derive(Clone, Debug)]
struct Seen {
    name: String,
    fields: BTreeMap<String, String>,
    parent: Option<String>,
}

impl Seen {
    fn field(&self, name: &str) -> &str {
        self.fields.get(name).map_or("", String::as_str)
    }

    fn bytes(&self) -> u64 {
        self.field("bytes").parse().expect("a byte count")
    }
}

#[derive(Default)]
struct Fields(BTreeMap<String, String>);

impl Visit for Fields {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_owned(), value.to_owned());
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0.insert(field.name().to_owned(), format!("{value:?}"));
    }
}

/// A capturing layer: every span created, in order.
#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Seen>>>);

impl<S: Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, _: &Id, ctx: Context<'_, S>) {
        let mut fields = Fields::default();
        attrs.record(&mut fields);
        let parent = ctx.lookup_current().map(|s| s.name().to_owned());
        self.0.lock().unwrap().push(Seen {
            name: attrs.metadata().name().to_owned(),
            fields: fields.0,
            parent,
        });
    }
}

impl Capture {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

#[test]
fn spans_name_each_enable_transfer_and_collective() {
    let capture = Capture::default();
    subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .expect("the only subscriber of this binary");
    let preset = tiny();
    let p = preset.pipeline.clone();
    let w = Workload {
        tokens: preset.default_tokens,
        preset,
        steps: 4,
        requests: 1,
    };

    // Layerwise on one simulated GPU.
    let mut rig = Rig::new(p.clone(), &RunOptions::new(DeviceProfile::h200())).unwrap();
    let config = OffloadConfig::from_json_str(r#"{"enable_layerwise_offload": true}"#).unwrap();
    capture.take();
    rig.runtime.enable_selected(&config, &rig.platform).unwrap();
    rig.request(&w).unwrap();
    rig.runtime.disable().unwrap();
    let seen = capture.take();

    let enables: Vec<&Seen> = seen.iter().filter(|s| s.name == "offload.enable").collect();
    assert_eq!(enables.len(), 1, "{seen:#?}");
    assert_eq!(enables[0].field("strategy"), "layerwise");
    assert_eq!(enables[0].field("pipeline"), "TinyPipeline");

    let transfers: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.name == "offload.transfer")
        .collect();
    // Every DiT block streamed in at least once, named by its path, with
    // its exact bytes, on the copy stream.
    let blocks: BTreeMap<String, u64> = ["transformer", "transformer_2"]
        .iter()
        .flat_map(|dit| blocks_of(&p, p.module_id(dit).unwrap()))
        .map(|b| (p.module(b).path.clone(), p.subtree_bytes(b)))
        .collect();
    let mut streamed = BTreeSet::new();
    let mut block_transfers = 0;
    for t in &transfers {
        assert_eq!(t.field("stream"), "copy", "{t:?}");
        assert_eq!(t.field("kind"), "h2d", "{t:?}");
        let block = t.field("block");
        assert!(p.module_id(block).is_some(), "no module `{block}`");
        if let Some(bytes) = blocks.get(block) {
            assert_eq!(t.bytes(), *bytes, "{t:?}");
            streamed.insert(block.to_owned());
            block_transfers += 1;
        }
    }
    for path in blocks.keys() {
        assert!(
            streamed.contains(path),
            "no transfer of `{path}`: {transfers:#?}"
        );
    }
    // The resident part is uploaded inside `enable`: its span is the parent.
    assert!(
        transfers
            .iter()
            .any(|t| t.field("block") == "text_encoder"
                && t.parent.as_deref() == Some("offload.enable")),
        "{transfers:#?}"
    );
    // Each DiT runs twice in four steps (two experts): every block is
    // streamed in twice or more (prefetches of the next forward included).
    assert!(block_transfers >= 2 * blocks.len(), "{transfers:#?}");

    // Distributed layerwise on two ranks: each block's gather is a transfer
    // on the communication stream with the collective's span inside it.
    let dlo = OffloadConfig {
        enable_distributed_layerwise_offload: true,
        ..OffloadConfig::default()
    };
    let m = MultiOptions {
        ranks: 2,
        run: RunOptions::new(DeviceProfile::h200()),
        faults: Vec::new(),
        encoders: EncoderRanks::All,
    };
    capture.take();
    let ranks = run_ranks(&w, &StrategyChoice::Config(dlo), &m).unwrap();
    assert!(ranks.iter().all(|r| r.result.is_ok()));
    let seen = capture.take();
    let gathers: Vec<&Seen> = seen
        .iter()
        .filter(|s| s.name == "offload.transfer" && s.field("kind") == "all-gather")
        .collect();
    assert!(!gathers.is_empty(), "{seen:#?}");
    for g in &gathers {
        assert_eq!(g.field("stream"), "comm", "{g:?}");
        let module = p.module_id(g.field("block")).expect("a block path");
        // G·s: the block's bytes rounded up to whole shards.
        assert_eq!(g.bytes(), p.subtree_bytes(module).div_ceil(2) * 2, "{g:?}");
    }
    let collectives: Vec<&Seen> = seen
        .iter()
        .filter(|s| {
            s.name == "offload.collective" && s.parent.as_deref() == Some("offload.transfer")
        })
        .collect();
    assert_eq!(collectives.len(), gathers.len(), "{seen:#?}");
    let mut by_size: Vec<u64> = gathers.iter().map(|g| g.bytes()).collect();
    let mut got: Vec<u64> = collectives.iter().map(|c| c.bytes()).collect();
    by_size.sort_unstable();
    got.sort_unstable();
    assert_eq!(got, by_size);
    for c in &collectives {
        assert_eq!(c.field("ranks"), "2", "{c:?}");
        assert_eq!(c.field("op"), "all-gather", "{c:?}");
    }
    // Both ranks (each on its own thread) reported to the subscriber.
    let ranks: BTreeSet<&str> = collectives.iter().map(|c| c.field("rank")).collect();
    assert_eq!(ranks, BTreeSet::from(["0", "1"]));
}
