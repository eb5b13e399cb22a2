//! How fast the simulator runs a ~300 MB pipeline: `Rig::quick` and the
//! exact rig (`Rig::new` keeping every byte), each through `enable_selected`
//! (layerwise), one forward over every block and `disable`, in wall-clock
//! seconds. Built by `cargo test --workspace`, never run there; run it to
//! see what the build profile costs:
//!
//! ```text
//! cargo run -p offload-sim --example debug_speed
//! cargo run -p offload-sim --example debug_speed \
//!     --config 'profile.dev.package.offload-sim.opt-level=3' \
//!     --config 'profile.dev.package.offload-core.opt-level=3'
//! ```

use std::time::Instant;

use offload_core::model::{DType, PipelineBuilder};
use offload_core::runtime::{Scope, View};
use offload_core::{ComponentDeclaration, OffloadConfig, Pipeline};
use offload_sim::harness::{Rig, RunOptions};
use offload_sim::{DeviceProfile, Sim, SimAccumulator};

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The DiT's width: with it the pipeline holds 296 MB of bf16 weights.
const H: u64 = 1536;
/// Blocks of each of the DiT's two sizes.
const DIT_BLOCKS: usize = 6;
/// The encoder's blocks.
const ENCODER_BLOCKS: usize = 4;

/// A Flux-shaped pipeline, narrowed: a DiT of 6 double blocks (5·H² each)
/// and 6 single blocks (4·H² each), and an encoder of 4 blocks (2·H² each).
fn pipeline() -> Result<Pipeline, BoxError> {
    let mut b = PipelineBuilder::new("DebugSpeedPipeline");
    {
        let mut t = b.module("transformer");
        t.parameter("x_embedder.weight", DType::Bf16, &[H, 64]);
        t.list("transformer_blocks", DIT_BLOCKS, |_, blk| {
            blk.parameter("attn.to_q.weight", DType::Bf16, &[H, H]);
            blk.parameter("ff.weight", DType::Bf16, &[4 * H, H]);
        });
        t.list("single_transformer_blocks", DIT_BLOCKS, |_, blk| {
            blk.parameter("proj_mlp.weight", DType::Bf16, &[4 * H, H]);
        });
        t.block_containers(&["transformer_blocks", "single_transformer_blocks"]);
    }
    {
        let mut e = b.module("text_encoder");
        e.parameter("shared.weight", DType::Bf16, &[1000, H]);
        e.list("block", ENCODER_BLOCKS, |_, blk| {
            blk.parameter("mlp.weight", DType::Bf16, &[2 * H, H]);
        });
        e.block_containers(&["block"]);
    }
    b.declare_components(ComponentDeclaration {
        dit: vec!["transformer".into()],
        encoder: vec!["text_encoder".into()],
        ..Default::default()
    });
    Ok(b.build()?)
}

/// Seconds since `start`, restarting it.
fn lap(start: &mut Instant) -> f64 {
    let s = start.elapsed().as_secs_f64();
    *start = Instant::now();
    s
}

/// Builds a rig with `make`, enables layerwise offload, runs one forward
/// over every block of both components and disables; prints each step's
/// seconds under `name`.
fn time(name: &str, make: impl FnOnce(Pipeline) -> Result<Rig, BoxError>) -> Result<(), BoxError> {
    let config = OffloadConfig::from_toml_str("enable_layerwise_offload = true")?;
    let p = pipeline()?;
    let mut t = Instant::now();
    let mut rig = make(p)?;
    let build_s = lap(&mut t);
    rig.runtime.enable_selected(&config, &rig.platform)?;
    let enable_s = lap(&mut t);
    let out = &rig.probe.output;
    rig.runtime.forward("text_encoder", |enc| {
        kernel(enc, &[enc.view("shared.weight")?], out)?;
        for i in 0..ENCODER_BLOCKS {
            enc.child(&format!("block.{i}"), |blk| kernel(blk, &blk.views()?, out))?;
        }
        Ok(())
    })?;
    rig.runtime.forward("transformer", |dit| {
        kernel(dit, &[dit.view("x_embedder.weight")?], out)?;
        for i in 0..DIT_BLOCKS {
            dit.child(&format!("transformer_blocks.{i}"), |blk| {
                kernel(blk, &blk.views()?, out)
            })?;
        }
        for i in 0..DIT_BLOCKS {
            dit.child(&format!("single_transformer_blocks.{i}"), |blk| {
                kernel(blk, &blk.views()?, out)
            })?;
        }
        Ok(())
    })?;
    let forward_s = lap(&mut t);
    rig.runtime.disable()?;
    let disable_s = lap(&mut t);
    let violations = rig.device.violations();
    if !violations.is_empty() {
        return Err(format!("{name}: residency violations: {violations:?}").into());
    }
    println!(
        "{name:<6} rig {build_s:6.2} s  enable {enable_s:6.2} s  forward {forward_s:6.2} s  disable {disable_s:6.2} s  total {:6.2} s",
        build_s + enable_s + forward_s + disable_s
    );
    Ok(())
}

/// A 20 µs kernel folding what it reads into `out`.
fn kernel(
    scope: &Scope<'_, Sim>,
    views: &[View<'_, Sim>],
    out: &SimAccumulator,
) -> Result<(), BoxError> {
    let inputs: Vec<_> = views.iter().map(|v| (v.buffer(), v.byte_range())).collect();
    scope
        .device()
        .compute_for(scope.stream(), &inputs, 20_000, scope.path(), out)?;
    Ok(())
}

fn main() -> Result<(), BoxError> {
    let bytes: u64 = pipeline()?.storages().map(|(_, s)| s.bytes).sum();
    println!("a pipeline of {:.0} MB of bf16 weights", bytes as f64 / 1e6);
    time("quick", |p| Ok(Rig::quick(p)?))?;
    time("exact", |p| {
        Ok(Rig::new(p, &RunOptions::new(DeviceProfile::h200()))?)
    })?;
    Ok(())
}
