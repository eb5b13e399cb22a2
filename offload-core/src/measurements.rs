//! What the request planner knows of the device and of one request
//! ([`PlannerInputs`]): the host masters' bandwidth, each component's
//! forwards per request, its compute inside and outside its blocks, and
//! the activation memory each phase needs beside the weights. A warm-up
//! measures them on the device (CONTRACT §9); they can be saved as JSON
//! and reloaded so a second start skips the warm-up, or written by a
//! caller. Descriptions only: the planner (`crate::budget`) reads them.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::request::RequestShape;

/// The version of the saved form this library reads and writes.
pub const MEASUREMENTS_VERSION: u32 = 1;

/// What the request planner plans from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlannerInputs {
    /// Version of this form ([`MEASUREMENTS_VERSION`]).
    #[serde(default = "version")]
    pub version: u32,
    /// The pipeline type these were measured for (empty: any; a reloaded
    /// file for another type is refused).
    #[serde(default)]
    pub pipeline_type: String,
    /// Host→device bandwidth from the host masters, bytes per second.
    pub link_bytes_per_s: f64,
    /// Fixed cost of one copy, seconds.
    #[serde(default = "latency")]
    pub copy_latency_s: f64,
    /// How much slower a kernel runs while a copy runs beside it (0.035:
    /// 3.5 % slower). 0 for measured compute, which already ran beside the
    /// warm-up's copies.
    #[serde(default)]
    pub copy_interference: f64,
    /// The host's rate filling pinned staging buffers from pageable
    /// masters (CONTRACT §7c), bytes per second: under a host budget a
    /// staged block's fill runs at it beside the copies (the recurrence's
    /// host stage), so the planner prefers plans that stage less where it
    /// is slower than the link. `None` (unmeasured): a staged block is
    /// priced as a pinned one, at the link. The warm-up measures it where
    /// its footprint stages blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_fill_bytes_per_s: Option<f64>,
    /// The host→device rate of a staged stream (CONTRACT §7c), bytes per
    /// second: pageable bytes filled into pinned staging buffers and
    /// copied, the fills beside the copies. Both cross the host's memory,
    /// so a running fill slows the DMA (on the lent H100s of 2026-12-07
    /// and 08 it ran at 0.75–0.88 of the link). Where given, the
    /// recurrence prices each staged block's copy at it (never faster
    /// than at the link), so a plan or staged forecast whose host's
    /// memory binds says so, not "the link". `None` (unmeasured): staged
    /// copies at the link. A caller measures it (offload-bench does, as
    /// its "staged stream"); the warm-up does not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged_stream_bytes_per_s: Option<f64>,
    /// The device's decoder of coded blocks (CONTRACT §7b), bf16 bytes it
    /// writes per second: under a `device_budget` with `weight_compression`
    /// `"lossless"` or `"auto"`, each coded block's decode is priced at
    /// it (the recurrence's decode stage). The planned backend measures it
    /// at enable where it holds coded masters. `None`: coded blocks cannot
    /// be priced (the planner refuses to plan them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_bytes_per_s: Option<f64>,
    /// How much of its overlap with a running decode a kernel loses
    /// (CONTRACT §7b): 0.9 makes a kernel beside a decode of 1 ms run
    /// 0.9 ms longer. Above 1 where a decode costs the kernels beside it
    /// more than its own time.
    /// The planned backend measures it at enable where its first plan
    /// streams coded blocks (the check request, CONTRACT §9). `None`: the
    /// planner assumes `budget::DECODE_INTERFERENCE` (the H200's fit).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decode_interference: Option<f64>,
    /// The deepest prefetch the planner may choose (1 to 64).
    #[serde(default = "depth")]
    pub max_depth: usize,
    /// Denoising steps of the request planned for.
    pub steps: u32,
    /// The device allocator's granule where it rounds each allocation to
    /// a whole number of them (1: exact, or an allocator that packs
    /// allocations into chunks, such as the CUDA pool, whose slack
    /// `allocator_slack_bytes` holds). The planner rounds each unit, slot
    /// and activation up to it.
    #[serde(default = "granule")]
    pub allocation_granule_bytes: u64,
    /// Device memory the host masters' mappings take (the device's page
    /// tables for pinned and registered host memory), measured at enable,
    /// and the page tables of the pinned staging and upload buffers the
    /// plan holds: every phase carries it.
    #[serde(default)]
    pub mapping_bytes: u64,
    /// The device allocator's slack: up to a chunk less one byte of
    /// rounding where it packs allocations into chunks
    /// (`Device::allocation_chunk`), and the most it held beyond what was
    /// in use rounded up to a chunk in any phase of the warm-up (what
    /// frees left in chunks still part used), which the device's free
    /// memory counts as used: every phase carries it.
    #[serde(default)]
    pub allocator_slack_bytes: u64,
    /// Each component, by path.
    pub components: BTreeMap<String, ComponentInputs>,
    /// How these were obtained.
    #[serde(default)]
    pub source: InputSource,
}

fn version() -> u32 {
    MEASUREMENTS_VERSION
}

fn latency() -> f64 {
    10e-6
}

/// The `prefetch_depth` key's range: a ring near the crossover must run
/// further ahead than four blocks (docs/CONTRACT.md §7a).
fn depth() -> usize {
    16
}

fn granule() -> u64 {
    1
}

/// One component's forwards, compute and activations.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ComponentInputs {
    /// Forwards per denoising step when `per_step` (a DiT: 1, or 2 with
    /// classifier-free guidance, 0.5 for each of two experts that split
    /// the steps), else per request (an encoder or a VAE: 1).
    pub forwards: f64,
    /// Whether `forwards` counts per denoising step.
    #[serde(default)]
    pub per_step: bool,
    /// Compute of one forward outside the component's blocks, seconds.
    #[serde(default)]
    pub own_compute_s: f64,
    /// Compute of one forward of each block, seconds, by block path.
    /// Blocks not listed cost nothing (a transfer-only model).
    #[serde(default)]
    pub block_compute_s: BTreeMap<String, f64>,
    /// The coded bytes of each block that has a coded master (CONTRACT
    /// §7b), by block path: what its copy moves when it streams coded (and
    /// what the staging buffers it decodes from must hold). A block not
    /// listed streams as stored. Filled at enable from the masters (the
    /// codec's output, or a coded-block file's windows).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub coded_block_bytes: BTreeMap<String, u64>,
    /// Device memory the component's forward needs beside the weights
    /// (activations, scratch, workspaces) at its high-water mark.
    pub activation_bytes: u64,
}

/// Where a set of [`PlannerInputs`] came from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum InputSource {
    /// Written by a caller (or a test).
    #[default]
    Given,
    /// A model of the device and the pipeline (the simulator's kernel and
    /// activation models), not a measurement.
    Estimated,
    /// Measured by the warm-up at enable.
    Warmup {
        /// The request the warm-up ran.
        shape: RequestShape,
        /// Host time the warm-up took (its enable, request and disable),
        /// and the check request's where one ran (CONTRACT §9).
        seconds: f64,
        /// The device's total memory.
        device_total_bytes: u64,
        /// Its free memory when offload was enabled.
        device_free_bytes: u64,
    },
}

impl PlannerInputs {
    /// Inputs over `link_bytes_per_s` for a request of `steps` denoising
    /// steps, with no component yet (add them with [`Self::component`]).
    pub fn new(link_bytes_per_s: f64, steps: u32) -> Self {
        Self {
            version: MEASUREMENTS_VERSION,
            pipeline_type: String::new(),
            link_bytes_per_s,
            copy_latency_s: latency(),
            copy_interference: 0.0,
            host_fill_bytes_per_s: None,
            staged_stream_bytes_per_s: None,
            decode_bytes_per_s: None,
            decode_interference: None,
            max_depth: depth(),
            steps,
            allocation_granule_bytes: granule(),
            mapping_bytes: 0,
            allocator_slack_bytes: 0,
            components: BTreeMap::new(),
            source: InputSource::Given,
        }
    }

    /// Adds (or replaces) the inputs of component `path`.
    pub fn component(mut self, path: impl Into<String>, inputs: ComponentInputs) -> Self {
        self.components.insert(path.into(), inputs);
        self
    }

    /// The saved form (JSON).
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default()
    }

    /// Reads the saved form; errors name the key and what is allowed.
    pub fn from_json_str(text: &str) -> Result<Self, String> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let inputs: Self = serde_path_to_error::deserialize(de)
            .map_err(|e| format!("planner inputs, at `{}`: {}", e.path(), e.inner()))?;
        if inputs.version != MEASUREMENTS_VERSION {
            return Err(format!(
                "planner inputs version {} is not supported; supported: {MEASUREMENTS_VERSION}",
                inputs.version
            ));
        }
        Ok(inputs)
    }

    /// Forwards of component `c` in a request of `steps` steps.
    pub fn forwards_per_request(c: &ComponentInputs, steps: u32) -> f64 {
        if c.per_step {
            c.forwards * f64::from(steps)
        } else {
            c.forwards
        }
    }
}

impl ComponentInputs {
    /// A component run `forwards` times per request (per step when
    /// `per_step`), with `activation_bytes` beside its weights and no
    /// compute (transfer only).
    pub fn new(forwards: f64, per_step: bool, activation_bytes: u64) -> Self {
        Self {
            forwards,
            per_step,
            own_compute_s: 0.0,
            block_compute_s: BTreeMap::new(),
            coded_block_bytes: BTreeMap::new(),
            activation_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_round_trip_and_refuse_other_versions() {
        let inputs = PlannerInputs::new(55e9, 28).component(
            "transformer",
            ComponentInputs {
                own_compute_s: 1e-3,
                block_compute_s: [("transformer.blocks.0".to_owned(), 2e-3)].into(),
                ..ComponentInputs::new(1.0, true, 460_000_000)
            },
        );
        let text = inputs.to_json();
        assert_eq!(PlannerInputs::from_json_str(&text), Ok(inputs));
        let e = PlannerInputs::from_json_str(&text.replace("\"version\": 1", "\"version\": 7"))
            .unwrap_err();
        assert!(e.contains("version 7") && e.contains("supported: 1"), "{e}");
        let e = PlannerInputs::from_json_str(
            r#"{"link_bytes_per_s": 1, "steps": 1, "components": {}, "bogus": 1}"#,
        )
        .unwrap_err();
        assert!(e.contains("bogus"), "{e}");
    }
}
