//! The runtime author's pipeline end to end on the simulator: declared by
//! hand in forward order over a checkpoint in name order, configured from
//! TOML, streamed layerwise with every DiT block a window of the file (no
//! pinned copy), computing what the resident run computes, with no
//! violation seen by the device's checkers.

use std::path::Path;
use std::sync::Arc;

use offload_core::invariants::Violation;
use offload_core::runtime::{HostMasters, WeightSource};
use offload_core::{OffloadConfig, OffloadStrategy};
use offload_runtime_author::{
    self as author, BIG_BLOCKS, BIG_WIDTH, SMALL_BLOCKS, SMALL_WIDTH, TRANSFORMER,
};
use offload_safetensors::Checkpoint;
use offload_sim::DeviceProfile;
use offload_sim::harness::{Rig, RunOptions};

const REQUESTS: usize = 2;
const STEPS: usize = 3;

/// What one run of the requests saw.
struct Run {
    strategy: Option<OffloadStrategy>,
    outputs: Vec<u64>,
    /// What `enable` made of the host masters.
    masters: HostMasters,
    /// Host bytes the backend streams from.
    streamed_bytes: u64,
    /// What the device's checkers saw, leaks at disable included.
    violations: Vec<Violation>,
}

/// Enables what `config` selects over the checkpoint in `dir`, runs the
/// requests, disables.
fn run(dir: &Path, config: &OffloadConfig) -> anyhow::Result<Run> {
    let pipeline = author::pipeline()?;
    let weights: Arc<dyn WeightSource> = Arc::new(author::weights(&pipeline, dir)?);
    let mut rig = Rig::with_weights(pipeline, &RunOptions::new(DeviceProfile::h200()), weights)?;
    rig.runtime.enable_selected(config, &rig.platform)?;
    let backend = rig.runtime.backend();
    let strategy = backend.map(|b| b.strategy());
    let streamed_bytes = backend.map_or(0, |b| b.host_weight_bytes());
    let masters = rig.runtime.host_masters();
    let outputs = (0..REQUESTS)
        .map(|_| author::request(&rig.runtime, &rig.probe.output, STEPS))
        .collect::<Result<Vec<_>, _>>()?;
    rig.runtime.disable()?;
    rig.device.check_released();
    Ok(Run {
        strategy,
        outputs,
        masters,
        streamed_bytes,
        violations: rig.device.violations(),
    })
}

/// Bytes of one DiT block at `width`.
fn block_bytes(width: u64) -> u64 {
    author::dit_block(width)
        .iter()
        .map(|(_, shape)| shape.iter().product::<u64>() * 2)
        .sum()
}

#[test]
fn layerwise_streams_every_block_from_the_file_and_computes_the_resident_output()
-> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let pipeline = author::pipeline()?;
    author::write_checkpoint(&pipeline, dir.path(), 7)?;
    // The premise: the file holds each block in name order, not in the
    // order the pipeline declares it.
    let ckpt = Checkpoint::open(author::checkpoint_file(dir.path(), TRANSFORMER))?;
    let at = |name: &str| ckpt.tensors()[name].range.start;
    assert!(at("big_blocks.0.attn.to_k.weight") < at("big_blocks.0.attn.to_q.weight"));
    assert!(at("big_blocks.0.ff.net.2.weight") < at("big_blocks.0.norm1.linear.weight"));

    let resident = run(dir.path(), &OffloadConfig::default())?;
    assert_eq!(resident.strategy, Some(OffloadStrategy::None));
    assert!(resident.violations.is_empty(), "{:?}", resident.violations);

    let layerwise = run(
        dir.path(),
        &OffloadConfig::from_toml_str(author::LAYERWISE_TOML)?,
    )?;
    assert_eq!(layerwise.strategy, Some(OffloadStrategy::Layerwise));
    assert!(
        layerwise.violations.is_empty(),
        "{:?}",
        layerwise.violations
    );
    let blocks =
        BIG_BLOCKS as u64 * block_bytes(BIG_WIDTH) + SMALL_BLOCKS as u64 * block_bytes(SMALL_WIDTH);
    assert_eq!(layerwise.streamed_bytes, blocks, "the DiT's blocks stream");
    assert_eq!(
        layerwise.masters,
        HostMasters {
            in_place_units: (BIG_BLOCKS + SMALL_BLOCKS) as u64,
            in_place_bytes: blocks,
            copied_units: 0,
            copied_bytes: 0,
            staged_units: 0,
            staged_bytes: 0,
            pageable_read_units: 0,
            pageable_read_bytes: 0,
        },
        "every streamed block a window of the checkpoint: no byte copied to pinned memory"
    );
    assert_eq!(
        layerwise.outputs, resident.outputs,
        "the same bytes read in the same order"
    );
    assert!(
        resident.outputs.iter().all(|&o| o != 0),
        "{:?}",
        resident.outputs
    );
    Ok(())
}

/// Wrong declarations and the errors they must give: each fails (never a
/// layerwise run that streams nothing) with an error naming the fix, and
/// a failed `enable` leaves nothing enabled.
mod mistakes {
    use super::*;
    use offload_core::budget::{ComponentInputs, DeviceMemory, PlannerInputs};
    use offload_runtime_author::Declaration;

    fn layerwise() -> OffloadConfig {
        OffloadConfig::from_toml_str(author::LAYERWISE_TOML).expect("the example's TOML parses")
    }

    /// Enables layerwise on the pipeline `d` declares; the error's text.
    fn enable_err(d: &Declaration) -> anyhow::Result<String> {
        let dir = tempfile::tempdir()?;
        let pipeline = author::pipeline_declared(d)?;
        author::write_checkpoint(&pipeline, dir.path(), 7)?;
        let weights: Arc<dyn WeightSource> = Arc::new(author::weights(&pipeline, dir.path())?);
        let mut rig =
            Rig::with_weights(pipeline, &RunOptions::new(DeviceProfile::h200()), weights)?;
        let err = rig
            .runtime
            .enable_selected(&layerwise(), &rig.platform)
            .expect_err("a declaration offload cannot stream is refused");
        assert!(rig.runtime.backend().is_none(), "nothing is enabled");
        assert_eq!(rig.runtime.host_masters(), HostMasters::default());
        Ok(err.to_string())
    }

    fn contains_all(msg: &str, needles: &[&str]) {
        for n in needles {
            assert!(msg.contains(n), "`{msg}` lacks `{n}`");
        }
    }

    #[test]
    fn a_misspelled_dit_fails_naming_the_module() -> anyhow::Result<()> {
        let msg = enable_err(&Declaration {
            dit_declared_as: Some("transformr".into()),
            ..Declaration::default()
        })?;
        contains_all(
            &msg,
            &["`transformr`", "did you mean `transformer`?", "dit: vec!"],
        );
        // A name nothing resembles lists the modules there are.
        let msg = enable_err(&Declaration {
            dit_declared_as: Some("dit".into()),
            ..Declaration::default()
        })?;
        contains_all(
            &msg,
            &["`dit`", "top-level modules: `text_encoder`, `transformer`"],
        );
        Ok(())
    }

    #[test]
    fn a_dit_without_block_containers_fails_naming_the_call() -> anyhow::Result<()> {
        let msg = enable_err(&Declaration {
            skip_block_containers: true,
            ..Declaration::default()
        })?;
        contains_all(
            &msg,
            &[
                "`transformer` has 0 block(s)",
                "block_containers(&[\"big_blocks\", \"small_blocks\"])",
            ],
        );
        Ok(())
    }

    /// Runs `f` in the DiT's forward under layerwise offload; its error.
    fn forward_err(
        f: impl FnOnce(
            &offload_core::runtime::Scope<'_, offload_sim::Sim>,
        ) -> Result<(), offload_core::BoxError>,
    ) -> anyhow::Result<String> {
        let dir = tempfile::tempdir()?;
        let pipeline = author::pipeline()?;
        author::write_checkpoint(&pipeline, dir.path(), 7)?;
        let weights: Arc<dyn WeightSource> = Arc::new(author::weights(&pipeline, dir.path())?);
        let mut rig =
            Rig::with_weights(pipeline, &RunOptions::new(DeviceProfile::h200()), weights)?;
        rig.runtime.enable_selected(&layerwise(), &rig.platform)?;
        let err = rig
            .runtime
            .forward(TRANSFORMER, f)
            .expect_err("the forward fails");
        // The runtime is still usable: a correct request runs after it.
        author::request(&rig.runtime, &rig.probe.output, 1)?;
        rig.runtime.disable()?;
        Ok(err.to_string())
    }

    #[test]
    fn a_block_weight_read_from_the_dit_scope_names_the_child_to_read_it_in() -> anyhow::Result<()>
    {
        let msg = forward_err(|dit| {
            dit.view("big_blocks.2.attn.to_q.weight")?;
            Ok(())
        })?;
        contains_all(
            &msg,
            &[
                "transformer.big_blocks.2.attn.to_q.weight",
                "child(\"big_blocks.2\", …)",
            ],
        );
        assert!(!msg.contains("``"), "no empty name: {msg}");
        Ok(())
    }

    #[test]
    fn a_misspelled_child_or_tensor_names_the_nearest() -> anyhow::Result<()> {
        let msg = forward_err(|dit| {
            dit.child("big_block.0", |_| Ok(()))?;
            Ok(())
        })?;
        contains_all(
            &msg,
            &["big_block", "did you mean `big_blocks`?", "`small_blocks`"],
        );
        let msg = forward_err(|dit| {
            dit.child("big_blocks.0", |b| {
                b.view("attn.to_q.weigth")?;
                Ok(())
            })?;
            Ok(())
        })?;
        // Named once, by the scope that lacks it.
        assert!(
            msg.starts_with("forward of `transformer.big_blocks.0`: no tensor `attn.to_q.weigth`; did you mean `attn.to_q.weight`?"),
            "{msg}"
        );
        assert!(!msg.contains("forward of `forward`"), "{msg}");
        Ok(())
    }

    #[test]
    fn a_block_compute_key_that_names_no_block_lists_the_blocks() -> anyhow::Result<()> {
        let pipeline = author::pipeline()?;
        let mut dit = ComponentInputs::new(1.0, true, 1 << 20);
        dit.block_compute_s
            .insert("transformer.big_block.0".to_owned(), 1e-3);
        let inputs = PlannerInputs::new(55e9, 4)
            .component(TRANSFORMER, dit)
            .component(
                author::TEXT_ENCODER,
                ComponentInputs::new(1.0, false, 1 << 20),
            );
        let config = OffloadConfig::from_toml_str(r#"device_budget = "200MiB""#)?;
        let memory = DeviceMemory {
            total_bytes: 1 << 40,
            free_bytes: 1 << 40,
        };
        let msg = offload_core::budget::plan(&pipeline, &config, &inputs, memory)
            .expect_err("a time for a block that does not exist")
            .to_string();
        contains_all(
            &msg,
            &[
                "`transformer.big_block.0`",
                "did you mean `transformer.big_blocks.0`?",
                "12 blocks",
                "`transformer.big_blocks.0` … `transformer.small_blocks.5`",
            ],
        );
        Ok(())
    }

    /// A size comes back in the unit it was written in, with no other
    /// figure of it beside: `"200KiB"` is "200 KiB", and every part of the
    /// least budget reads in KiB (it came back as bytes, GB and GiB).
    #[test]
    fn a_budget_too_small_reads_in_the_unit_written() -> anyhow::Result<()> {
        let pipeline = author::pipeline()?;
        let inputs = PlannerInputs::new(55e9, 4)
            .component(TRANSFORMER, ComponentInputs::new(1.0, true, 1 << 16))
            .component(
                author::TEXT_ENCODER,
                ComponentInputs::new(1.0, false, 1 << 16),
            );
        let config = OffloadConfig::from_toml_str(r#"device_budget = "200KiB""#)?;
        let memory = DeviceMemory {
            total_bytes: 1 << 40,
            free_bytes: 1 << 40,
        };
        let msg = offload_core::budget::plan(&pipeline, &config, &inputs, memory)
            .expect_err("200 KiB holds no phase of this pipeline")
            .to_string();
        contains_all(
            &msg,
            &[
                "`device_budget` = 200 KiB does not fit",
                "KiB outside every component",
                "device_budget ≥ \"",
            ],
        );
        for other in [" B ", " GB", " GiB", "204800"] {
            assert!(!msg.contains(other), "`{msg}` has `{other}`");
        }
        Ok(())
    }
}
