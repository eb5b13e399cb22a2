//! Configuration (CONTRACT §2): the offload flags, the compact
//! `diffusion_offload_config`, the [`ParallelConfig`], strategy selection by
//! priority, and the DLO gather-group derivation.
//!
//! Parsing goes through serde with unknown keys denied; every semantic
//! rejection is a [`ConfigError`] naming the key, the value and what is
//! allowed.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use serde::{Deserialize, Serialize};

/// The one strategy a configuration selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadStrategy {
    /// No offloading.
    None,
    /// Whole components swap between host and device (CONTRACT §6).
    ModelLevel,
    /// Blocks stream through a ring of device slots (CONTRACT §7).
    Layerwise,
    /// Blocks stream as 1/G shards gathered across ranks (CONTRACT §8).
    DistributedLayerwise,
    /// A device budget, planned for the whole request (CONTRACT §7a): each
    /// component resident, swapped in for its forward, or streamed with
    /// resident blocks, by one backend that composes the model-level and
    /// ring engines.
    Planned,
}

impl OffloadStrategy {
    /// The hook name the strategy's backend registers under.
    pub const fn hook_name(self) -> &'static str {
        match self {
            OffloadStrategy::None => "none",
            OffloadStrategy::ModelLevel => "model_level_offload",
            OffloadStrategy::Layerwise => "layerwise_offload",
            OffloadStrategy::DistributedLayerwise => "distributed_layerwise_offload",
            OffloadStrategy::Planned => "planned_offload",
        }
    }
}

impl fmt::Display for OffloadStrategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            OffloadStrategy::None => "none",
            OffloadStrategy::ModelLevel => "model-level",
            OffloadStrategy::Layerwise => "layerwise",
            OffloadStrategy::DistributedLayerwise => "distributed-layerwise",
            OffloadStrategy::Planned => "planned",
        })
    }
}

/// A component name of the compact configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ComponentName {
    /// The denoising transformer(s).
    Dit,
    /// The text (and image) encoders.
    TextEncoder,
    /// The VAE.
    Vae,
}

impl ComponentName {
    /// Every name, in the order the docs list them.
    pub const ALL: [ComponentName; 3] = [
        ComponentName::Dit,
        ComponentName::TextEncoder,
        ComponentName::Vae,
    ];

    /// The key as written in configuration.
    pub const fn key(self) -> &'static str {
        match self {
            ComponentName::Dit => "dit",
            ComponentName::TextEncoder => "text_encoder",
            ComponentName::Vae => "vae",
        }
    }
}

impl fmt::Display for ComponentName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.key())
    }
}

/// `diffusion_offload_config.mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompactMode {
    /// Model-level offload.
    Module,
    /// Layerwise (or distributed layerwise) offload.
    Layer,
}

/// `layer_options.<component>.weight_transfer`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum WeightTransfer {
    /// Each rank holds 1/G of every block and the group all-gathers it.
    Allgather,
    /// Each rank holds whole blocks and copies them itself.
    RankLocal,
}

impl fmt::Display for WeightTransfer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WeightTransfer::Allgather => "allgather",
            WeightTransfer::RankLocal => "rank-local",
        })
    }
}

/// `layer_options.<component>`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerOptions {
    /// How the component's blocks reach the device; unset means rank-local.
    #[serde(default)]
    pub weight_transfer: Option<WeightTransfer>,
    /// Leading blocks kept on the device (dit only, rank-local only).
    #[serde(default)]
    pub resident_layers: u32,
}

/// The compact form, `diffusion_offload_config`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactConfig {
    /// `module` or `layer`.
    pub mode: CompactMode,
    /// The components to offload; non-empty, no duplicates.
    pub components: Vec<ComponentName>,
    /// Per-component layer options (mode `layer` only), keyed by component
    /// name (`dit`, `text_encoder`, `vae`). Keys are text so that an error
    /// inside an entry names the entry.
    #[serde(default)]
    pub layer_options: BTreeMap<String, LayerOptions>,
    /// Pin host masters (default true).
    #[serde(default)]
    pub pin_memory: Option<bool>,
}

/// The parallel facts of this process. The caller never passes an offload
/// group size: it is derived from these (see [`gather_group`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ParallelConfig {
    /// Data-parallel size.
    pub data_parallel_size: u32,
    /// Sequence-parallel size.
    pub sequence_parallel_size: u32,
    /// Tensor-parallel size.
    pub tensor_parallel_size: u32,
    /// Whether HSDP shards the DiT parameters.
    pub use_hsdp: bool,
    /// HSDP shard group size.
    pub hsdp_shard_size: u32,
    /// HSDP replicate group size.
    pub hsdp_replicate_size: u32,
    /// This process's global rank.
    pub rank: u32,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            data_parallel_size: 1,
            sequence_parallel_size: 1,
            tensor_parallel_size: 1,
            use_hsdp: false,
            hsdp_shard_size: 1,
            hsdp_replicate_size: 1,
            rank: 0,
        }
    }
}

impl ParallelConfig {
    /// A single process: every size 1.
    pub fn single() -> Self {
        Self::default()
    }

    /// A config of the given dp, sp and tp sizes, rank 0, no HSDP.
    pub fn sizes(dp: u32, sp: u32, tp: u32) -> Self {
        Self {
            data_parallel_size: dp,
            sequence_parallel_size: sp,
            tensor_parallel_size: tp,
            ..Self::default()
        }
    }

    /// dp × sp × tp.
    pub fn world_size(&self) -> u64 {
        u64::from(self.data_parallel_size)
            * u64::from(self.sequence_parallel_size)
            * u64::from(self.tensor_parallel_size)
    }

    /// Checks sizes ≥ 1, the rank against the world size, and the HSDP
    /// sizes against it.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (key, value) in [
            ("parallel.data_parallel_size", self.data_parallel_size),
            (
                "parallel.sequence_parallel_size",
                self.sequence_parallel_size,
            ),
            ("parallel.tensor_parallel_size", self.tensor_parallel_size),
            ("parallel.hsdp_shard_size", self.hsdp_shard_size),
            ("parallel.hsdp_replicate_size", self.hsdp_replicate_size),
        ] {
            if value == 0 {
                return Err(ConfigError::Invalid {
                    key: key.to_owned(),
                    value: "0".to_owned(),
                    allowed: "an integer ≥ 1".to_owned(),
                });
            }
        }
        let world = self.world_size();
        if u64::from(self.rank) >= world {
            return Err(ConfigError::Invalid {
                key: "parallel.rank".to_owned(),
                value: self.rank.to_string(),
                allowed: format!("0 ≤ rank < dp × sp × tp = {world}"),
            });
        }
        if self.use_hsdp {
            let hsdp = u64::from(self.hsdp_shard_size) * u64::from(self.hsdp_replicate_size);
            if !world.is_multiple_of(hsdp) {
                return Err(ConfigError::Invalid {
                    key: "parallel.hsdp_shard_size × parallel.hsdp_replicate_size".to_owned(),
                    value: hsdp.to_string(),
                    allowed: format!("a divisor of the world size {world}"),
                });
            }
        }
        Ok(())
    }
}

/// The process group DLO gathers weights over.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GatherAxis {
    /// No gathering: G = 1.
    None,
    /// The data-parallel group (with HSDP: shard × replicate).
    DataParallel,
    /// The sequence-parallel group.
    SequenceParallel,
}

/// The DLO gather group: which axis and its size G.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GatherGroup {
    /// The axis.
    pub axis: GatherAxis,
    /// Its size G (1 for none).
    pub size: u32,
}

impl GatherGroup {
    /// G = 1.
    pub const NONE: GatherGroup = GatherGroup {
        axis: GatherAxis::None,
        size: 1,
    };

    /// This process's rank within the group, `0..size`.
    ///
    /// Global ranks are laid out tensor-parallel fastest, then
    /// sequence-parallel, then data-parallel:
    /// `rank = (dp_index × sp + sp_index) × tp + tp_index`. The
    /// data-parallel group of a rank holds the ranks with its sp and tp
    /// indices (its rank there is `dp_index`); the sequence-parallel group
    /// the ranks with its dp and tp indices (`sp_index`).
    pub fn rank_of(&self, parallel: &ParallelConfig) -> u32 {
        let tp = parallel.tensor_parallel_size.max(1);
        let sp = parallel.sequence_parallel_size.max(1);
        match self.axis {
            GatherAxis::None => 0,
            GatherAxis::DataParallel => parallel.rank / (tp * sp),
            GatherAxis::SequenceParallel => (parallel.rank / tp) % sp,
        }
    }

    /// The global ranks of this process's group, in group-rank order (see
    /// [`Self::rank_of`] for the layout): what a caller builds the
    /// communicator of [`crate::device::Collective`] over.
    pub fn members(&self, parallel: &ParallelConfig) -> Vec<u32> {
        let tp = parallel.tensor_parallel_size.max(1);
        let sp = parallel.sequence_parallel_size.max(1);
        let r = parallel.rank;
        match self.axis {
            GatherAxis::None => vec![r],
            GatherAxis::DataParallel => {
                let within = r % (tp * sp);
                (0..self.size).map(|d| d * tp * sp + within).collect()
            }
            GatherAxis::SequenceParallel => {
                let (dp_index, tp_index) = (r / (tp * sp), r % tp);
                (0..self.size)
                    .map(|s| (dp_index * sp + s) * tp + tp_index)
                    .collect()
            }
        }
    }
}

/// The DLO gather group (CONTRACT §2): the data-parallel group if dp > 1
/// (with HSDP: shard × replicate), else the sequence-parallel group if
/// sp > 1, else none. Tensor parallelism never gathers weights; without
/// all-gather there is no group.
pub fn gather_group(parallel: &ParallelConfig, use_allgather: bool) -> GatherGroup {
    if !use_allgather {
        GatherGroup::NONE
    } else if parallel.data_parallel_size > 1 {
        let size = if parallel.use_hsdp {
            parallel.hsdp_shard_size * parallel.hsdp_replicate_size
        } else {
            parallel.data_parallel_size
        };
        GatherGroup {
            axis: GatherAxis::DataParallel,
            size,
        }
    } else if parallel.sequence_parallel_size > 1 {
        GatherGroup {
            axis: GatherAxis::SequenceParallel,
            size: parallel.sequence_parallel_size,
        }
    } else {
        GatherGroup::NONE
    }
}

/// The whole configuration of offloading: the flags at top level, the
/// optional compact form, and the parallel facts. Unknown keys are errors.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadConfig {
    /// Model-level offload.
    #[serde(default)]
    pub enable_cpu_offload: bool,
    /// Layerwise offload.
    #[serde(default)]
    pub enable_layerwise_offload: bool,
    /// Distributed layerwise offload.
    #[serde(default)]
    pub enable_distributed_layerwise_offload: bool,
    /// Pin host masters; default true.
    #[serde(default)]
    pub pin_cpu_memory: Option<bool>,
    /// DLO: gather shards (true, default) or copy whole blocks per rank.
    #[serde(default)]
    pub dlo_use_allgather: Option<bool>,
    /// DLO: leading DiT blocks kept on the device; default 0.
    #[serde(default)]
    pub dlo_resident_layers: Option<u32>,
    /// The compact form.
    #[serde(default)]
    pub diffusion_offload_config: Option<CompactConfig>,
    /// The parallel facts; default a single process.
    #[serde(default)]
    pub parallel: ParallelConfig,
    /// Device memory offload may use for weights and activations: `"auto"`
    /// (the device's free memory at enable less `device_headroom`) or a
    /// size (`"24GiB"`, `"16 GB"`, bytes). The request planner
    /// (`crate::budget::plan`) then chooses, for the whole request, which
    /// components stay resident, which swap in for their forward and which
    /// stream with resident blocks. It selects the planned strategy and
    /// goes with no strategy flag, compact form or residency key.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_budget: Option<crate::bytes::DeviceBudget>,
    /// What `device_budget = "auto"` leaves free (default 1 GiB): only with
    /// `"auto"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_headroom: Option<crate::bytes::ByteSize>,
    /// Blocks (by path) that stay on the device while the rest of their
    /// stack streams: what the budget planner writes (layerwise only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub resident_blocks: Vec<String>,
    /// How many blocks ahead layerwise offload copies (1 to 16; the ring
    /// has this many slots plus one). Default: the platform's
    /// (`CorePlatform::with_prefetch_depth`, 1 unless set). Layerwise and
    /// distributed layerwise only; a `device_budget` chooses its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefetch_depth: Option<u32>,
    /// How streamed blocks cross the link (CONTRACT §7b): `"none"` (the
    /// default: bf16 as stored), `"lossless"` (every streamed block coded
    /// on the host at enable, decoded on the device into its slot,
    /// bit-identical) or `"auto"` (each ring coded only where the ring
    /// recurrence, from the platform's planner inputs and a decode measured
    /// at enable, says it is faster). Layerwise offload, or the request
    /// planner under a `device_budget`, where the planner prices coded
    /// blocks and `"auto"` lets it choose per stack;
    /// both need a platform with a codec (`CorePlatform::with_codec`);
    /// layerwise's `"auto"` planner inputs too (`CorePlatform::with_planner`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_compression: Option<WeightCompression>,
    /// The most page-locked host memory offload may hold for weights
    /// (pinned copies, registrations in place, staging buffers; CONTRACT
    /// §7c): `"auto"` (what this process may still use at enable, less a
    /// headroom) or a size. Streamed blocks beyond it stay in pageable
    /// memory (the mapped checkpoint, or the heap) and stream through a
    /// ring of pinned staging buffers. Layerwise offload only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_budget: Option<crate::bytes::HostBudget>,
    /// How a staged master's bytes reach the link (CONTRACT §7c):
    /// `"fill"` (the default: host threads copy it into a pinned staging
    /// buffer, which the copy engine reads) or `"in_place"` (the device
    /// reads it where it lies, a read-only window of a mapped checkpoint,
    /// with no host copy: each byte crosses the host's memory once instead
    /// of three times; the window's pages stay in the page cache, never
    /// page-locked). `"in_place"` needs a device that reads pageable
    /// memory (`Device::reads_pageable`: CUDA with HMM or ATS), else
    /// `enable` fails with a typed error; a staged block that is not such a
    /// window (the heap's, a coded block) still streams through the staging
    /// ring, logged. `"in_place"` with layerwise offload only (a typed error
    /// elsewhere: the request planner's and model-level offload's staged
    /// masters stream through the staging ring).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub staged_reads: Option<StagedReads>,
}

/// The values `staged_reads` takes (CONTRACT §7c).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StagedReads {
    /// Host threads copy each staged master into pinned staging buffers.
    #[default]
    Fill,
    /// The device reads each staged master where it lies.
    InPlace,
}

impl std::fmt::Display for StagedReads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            StagedReads::Fill => "fill",
            StagedReads::InPlace => "in_place",
        })
    }
}

/// The values `weight_compression` takes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WeightCompression {
    /// Blocks cross the link as stored.
    #[default]
    None,
    /// Every streamed block is coded and decoded on the device.
    Lossless,
    /// The request planner chooses per streamed component.
    Auto,
}

impl std::fmt::Display for WeightCompression {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WeightCompression::None => "none",
            WeightCompression::Lossless => "lossless",
            WeightCompression::Auto => "auto",
        })
    }
}

impl OffloadConfig {
    /// `weight_compression`, `"none"` when unset.
    pub fn compression(&self) -> WeightCompression {
        self.weight_compression.unwrap_or_default()
    }
}

/// The error for `weight_compression` on a platform without a codec.
pub(crate) fn no_codec(c: WeightCompression) -> ConfigError {
    invalid(
        "weight_compression",
        format!("\"{c}\""),
        "\"none\" on this platform: it has no codec to decode blocks on the device (CorePlatform::with_codec; offload-sim and offload-cuda give one)",
    )
}

/// The error for `weight_compression = "auto"` without planner inputs.
pub(crate) fn auto_without_inputs() -> ConfigError {
    invalid(
        "weight_compression",
        "\"auto\"",
        "\"lossless\" or \"none\" on this platform: \"auto\" decides from each block's compute and the link (CorePlatform::with_planner, a warm-up's saved measurements)",
    )
}

/// Checks `weight_compression` against the strategy selected.
fn check_compression(config: &OffloadConfig, selection: &Selection) -> Result<(), ConfigError> {
    let c = config.compression();
    let value = format!("\"{c}\"");
    match (c, selection.strategy) {
        (WeightCompression::None, _) => Ok(()),
        (WeightCompression::Lossless | WeightCompression::Auto, OffloadStrategy::Layerwise) => {
            Ok(())
        }
        (_, OffloadStrategy::Planned) => Ok(()),
        (_, strategy) => Err(invalid(
            "weight_compression",
            value,
            format!(
                "with layerwise offload only (this configuration selects {strategy}; a gathered or model-level block is not decoded on the device): \"none\""
            ),
        )),
    }
}

/// Checks `host_budget` and `staged_reads` against the strategy
/// selected: layerwise offload and the request planner stage masters
/// (CONTRACT §7c).
fn check_host_budget(config: &OffloadConfig, selection: &Selection) -> Result<(), ConfigError> {
    if let Some(reads) = config.staged_reads
        && reads != StagedReads::Fill
        && selection.strategy != OffloadStrategy::Layerwise
    {
        return Err(invalid(
            "staged_reads",
            format!("\"{reads}\""),
            format!(
                "\"in_place\" with layerwise offload (enable_layerwise_offload = true) only; this configuration selects {}, whose staged masters stream through the staging ring: \"fill\", or remove staged_reads",
                selection.strategy
            ),
        ));
    }
    let Some(budget) = config.host_budget else {
        return Ok(());
    };
    if matches!(
        selection.strategy,
        OffloadStrategy::Layerwise | OffloadStrategy::Planned
    ) {
        return Ok(());
    }
    Err(invalid(
        "host_budget",
        format!("\"{budget}\""),
        format!(
            "with layerwise offload (enable_layerwise_offload = true) or a device_budget (the request planner) only; this configuration selects {}: their streamed blocks are the ones that can stay pageable and stream through staging buffers; remove host_budget",
            selection.strategy
        ),
    ))
}

/// The prefetch depths `prefetch_depth` takes.
pub const PREFETCH_DEPTHS: std::ops::RangeInclusive<u32> = 1..=16;

impl OffloadConfig {
    /// Parses a JSON object.
    pub fn from_json_str(text: &str) -> Result<Self, ConfigError> {
        // Not JSON at all is a syntax error (with a snippet); JSON that
        // does not match the schema names the key.
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(text) {
            let message = e.to_string();
            let message = message
                .rsplit_once(" at line ")
                .map_or(message.as_str(), |(m, _)| m)
                .to_owned();
            // serde_json counts the column in bytes; the snippet's caret
            // counts characters.
            let column = text
                .lines()
                .nth(e.line().wrapping_sub(1))
                .map_or(e.column(), |src| {
                    let mut end = e.column().saturating_sub(1).min(src.len());
                    while !src.is_char_boundary(end) {
                        end -= 1;
                    }
                    src[..end].chars().count() + 1
                });
            return Err(syntax("JSON", text, e.line(), column, message));
        }
        let de = &mut serde_json::Deserializer::from_str(text);
        serde_path_to_error::deserialize(de).map_err(|e| parse_error("JSON", e))
    }

    /// Parses a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let de = toml::Deserializer::parse(text).map_err(|e| {
            let (line, column) = e
                .span()
                .map_or((0, 0), |span| line_and_column(text, span.start));
            syntax("TOML", text, line, column, e.message().to_owned())
        })?;
        serde_path_to_error::deserialize(de).map_err(|e| parse_error("TOML", e))
    }

    /// Reads a `.json` or `.toml` file; an error names the file.
    pub fn from_path(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let parsed = match path.extension().and_then(|e| e.to_str()) {
            Some("json") => Self::from_json_str(&text),
            Some("toml") => Self::from_toml_str(&text),
            other => {
                return Err(ConfigError::Invalid {
                    key: "config file extension".to_owned(),
                    value: other.unwrap_or("").to_owned(),
                    allowed: "`json` or `toml`".to_owned(),
                });
            }
        };
        parsed.map_err(|e| e.in_file(path))
    }

    /// Selects the strategy; see [`select`].
    pub fn select(&self) -> Result<Selection, ConfigError> {
        select(self)
    }
}

fn parse_error<E: fmt::Display>(
    format: &'static str,
    e: serde_path_to_error::Error<E>,
) -> ConfigError {
    let key = e.path().to_string();
    ConfigError::Parse {
        format,
        file: None,
        key: if key == "." { String::new() } else { key },
        message: e.inner().to_string(),
    }
}

/// The 1-based line and column (in characters) of byte `offset` of `text`.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let mut end = offset.min(text.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    let before = &text[..end];
    let line = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    (line, before[start..].chars().count() + 1)
}

/// A syntax error at `line`:`column` (1-based; 0 when unknown) of `text`,
/// with the line and a caret under the column.
fn syntax(
    format: &'static str,
    text: &str,
    line: usize,
    column: usize,
    message: String,
) -> ConfigError {
    // The line, or 80 characters of it around the column.
    const WIDTH: usize = 80;
    let snippet = match text.lines().nth(line.wrapping_sub(1)) {
        Some(src) if line > 0 => {
            let chars: Vec<char> = src.chars().collect();
            let at = column.saturating_sub(1).min(chars.len());
            let from = at
                .saturating_sub(WIDTH / 2)
                .min(chars.len().saturating_sub(WIDTH));
            let to = (from + WIDTH).min(chars.len());
            let shown: String = chars[from..to].iter().collect();
            let (open, close) = (
                if from > 0 { "…" } else { "" },
                if to < chars.len() { "…" } else { "" },
            );
            let gutter = line.to_string();
            format!(
                "\n{pad} |\n{gutter} | {open}{shown}{close}\n{pad} | {caret}^",
                pad = " ".repeat(gutter.len()),
                caret = " ".repeat(at - from + usize::from(from > 0)),
            )
        }
        _ => String::new(),
    };
    ConfigError::Syntax {
        format,
        file: None,
        line,
        column,
        message,
        snippet,
    }
}

/// Where a configuration came from, for its errors: the file, or the
/// format of a string.
fn origin(format: &str, file: Option<&String>) -> String {
    match file {
        Some(f) => format!("configuration file `{f}`"),
        None => format!("{format} configuration"),
    }
}

/// `, line L, column C`, or nothing where the parser gave no position.
fn position(line: usize, column: usize) -> String {
    match (line, column) {
        (0, _) => String::new(),
        (l, 0) => format!(", line {l}"),
        (l, c) => format!(", line {l}, column {c}"),
    }
}

/// `, at `key``, or nothing at the top level.
fn at_key(key: &str) -> String {
    if key.is_empty() {
        String::new()
    } else {
        format!(", at `{key}`")
    }
}

impl ConfigError {
    /// This error as read from the file at `path`: parse and syntax
    /// errors name it.
    pub fn in_file(mut self, path: &Path) -> Self {
        if let ConfigError::Parse { file, .. } | ConfigError::Syntax { file, .. } = &mut self {
            *file = Some(path.display().to_string());
        }
        self
    }
}

/// Every rejection of the configuration. Each names the key, the value and
/// what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The text is not valid JSON/TOML for the schema: wrong type, unknown
    /// key, unknown choice. `message` comes from serde and names the allowed
    /// keys or choices.
    #[error("{}{}: {message}", origin(format, file.as_ref()), at_key(key))]
    Parse {
        /// `JSON` or `TOML`.
        format: &'static str,
        /// The file it was read from, if any.
        file: Option<String>,
        /// Dotted path of the offending key (empty at top level).
        key: String,
        /// What was wrong and what is allowed.
        message: String,
    },
    /// The text is not JSON/TOML at all.
    #[error("{}{}: {message}{snippet}", origin(format, file.as_ref()), position(*line, *column))]
    Syntax {
        /// `JSON` or `TOML`.
        format: &'static str,
        /// The file it was read from, if any.
        file: Option<String>,
        /// 1-based line (0 when unknown).
        line: usize,
        /// 1-based column, in characters (0 when unknown).
        column: usize,
        /// What was wrong.
        message: String,
        /// The line, with a caret under the column.
        snippet: String,
    },
    /// The file could not be read.
    #[error("cannot read configuration file `{path}`: {message}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        message: String,
    },
    /// A value outside what is allowed.
    #[error("`{key}` = {value} is not allowed; allowed: {allowed}")]
    Invalid {
        /// The key.
        key: String,
        /// The value given.
        value: String,
        /// What is allowed.
        allowed: String,
    },
    /// Two keys that may not be set together.
    #[error("`{key}` = {value} conflicts with `{other_key}` = {other_value}: {allowed}")]
    Conflict {
        /// The first key.
        key: String,
        /// Its value.
        value: String,
        /// The conflicting key.
        other_key: String,
        /// Its value.
        other_value: String,
        /// What is allowed instead.
        allowed: String,
    },
}

fn invalid(
    key: impl Into<String>,
    value: impl fmt::Display,
    allowed: impl Into<String>,
) -> ConfigError {
    ConfigError::Invalid {
        key: key.into(),
        value: value.to_string(),
        allowed: allowed.into(),
    }
}

fn conflict(
    (key, value): (impl Into<String>, impl fmt::Display),
    (other_key, other_value): (impl Into<String>, impl fmt::Display),
    allowed: impl Into<String>,
) -> ConfigError {
    ConfigError::Conflict {
        key: key.into(),
        value: value.to_string(),
        other_key: other_key.into(),
        other_value: other_value.to_string(),
        allowed: allowed.into(),
    }
}

/// How one component's blocks stream under a layer mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerSettings {
    /// Gathered or rank-local.
    pub weight_transfer: WeightTransfer,
    /// Leading blocks kept resident (dit only).
    pub resident_layers: u32,
}

/// Which form of the configuration chose the strategy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SelectionSource {
    /// Nothing enabled.
    Default,
    /// The `enable_*` flags.
    Flags,
    /// `diffusion_offload_config`.
    Compact,
    /// `device_budget` alone.
    Budget,
}

/// A lower-priority flag that selection turned off.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DisabledFlag {
    /// The flag's key.
    pub flag: &'static str,
    /// The strategy that won.
    pub by: OffloadStrategy,
}

impl fmt::Display for DisabledFlag {
    /// The line selection logs for it (and the main job prints).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "offload flag `{}` disabled: `{}` offload has priority",
            self.flag, self.by
        )
    }
}

/// The outcome of [`select`]: one strategy and everything it needs from the
/// configuration.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Selection {
    /// The strategy.
    pub strategy: OffloadStrategy,
    /// Which form chose it.
    pub source: SelectionSource,
    /// The components it offloads.
    pub components: BTreeSet<ComponentName>,
    /// Whether the user named the components (the compact form); then a
    /// component that cannot be offloaded is an error instead of a warning.
    pub components_explicit: bool,
    /// Pin host masters.
    pub pin_memory: bool,
    /// Per-component streaming settings (layer strategies only).
    pub layer: BTreeMap<ComponentName, LayerSettings>,
    /// The gather group (G = 1 unless some component all-gathers).
    pub gather_group: GatherGroup,
    /// Flags turned off by priority; each was logged at `info`.
    pub disabled_flags: Vec<DisabledFlag>,
}

impl Selection {
    /// Whether any component all-gathers.
    pub fn uses_allgather(&self) -> bool {
        self.layer
            .values()
            .any(|l| l.weight_transfer == WeightTransfer::Allgather)
    }

    /// Refuses unpinned host masters where the strategy has no staging
    /// transport (distributed layerwise: its shards are gathered from
    /// pinned masters): a pageable host→device copy runs at 6–8 GB/s
    /// against 55 GB/s pinned on the lent H200 (8× slower), and would stage
    /// through the driver. Layerwise, model-level and planned offload stage
    /// them themselves (CONTRACT §7c) and never call this.
    pub fn require_pinned(&self) -> Result<(), ConfigError> {
        if self.pin_memory {
            return Ok(());
        }
        let key = match self.source {
            SelectionSource::Compact => "diffusion_offload_config.pin_memory",
            _ => "pin_cpu_memory",
        };
        Err(invalid(
            key,
            false,
            format!(
                "true with {}: its host masters are pinned once at enable; false (every master staged through pinned staging buffers) with layerwise offload, model-level offload (enable_cpu_offload) or a device_budget only",
                self.strategy
            ),
        ))
    }

    /// Leading resident layers for the DiT (0 unless set).
    pub fn dit_resident_layers(&self) -> u32 {
        self.layer
            .get(&ComponentName::Dit)
            .map_or(0, |l| l.resident_layers)
    }
}

const FLAG_PRIORITY: [(&str, OffloadStrategy); 3] = [
    (
        "enable_distributed_layerwise_offload",
        OffloadStrategy::DistributedLayerwise,
    ),
    ("enable_layerwise_offload", OffloadStrategy::Layerwise),
    ("enable_cpu_offload", OffloadStrategy::ModelLevel),
];

fn flag_value(config: &OffloadConfig, flag: &str) -> bool {
    match flag {
        "enable_distributed_layerwise_offload" => config.enable_distributed_layerwise_offload,
        "enable_layerwise_offload" => config.enable_layerwise_offload,
        _ => config.enable_cpu_offload,
    }
}

/// Selects exactly one strategy from the configuration (CONTRACT §2).
///
/// Priority is DLO > Layerwise > ModelLevel > None; every lower-priority
/// flag that was set and lost is listed in [`Selection::disabled_flags`]
/// (pure: the factory, [`crate::get_offload_backend`], logs them once at
/// `info`). Every rejection of §2 is an `Err`.
pub fn select(config: &OffloadConfig) -> Result<Selection, ConfigError> {
    config.parallel.validate()?;
    let set_flags: Vec<(&'static str, OffloadStrategy)> = FLAG_PRIORITY
        .iter()
        .copied()
        .filter(|(flag, _)| flag_value(config, flag))
        .collect();

    if let Some(depth) = config.prefetch_depth
        && !PREFETCH_DEPTHS.contains(&depth)
    {
        return Err(invalid(
            "prefetch_depth",
            depth,
            format!(
                "{} to {} (blocks copied ahead of the one computing)",
                PREFETCH_DEPTHS.start(),
                PREFETCH_DEPTHS.end()
            ),
        ));
    }
    if let Some(budget) = config.device_budget {
        if let Some(depth) = config.prefetch_depth {
            return Err(conflict(
                ("prefetch_depth", depth),
                ("device_budget", format!("\"{budget}\"")),
                "the request planner chooses each streamed component's depth under a budget: remove prefetch_depth",
            ));
        }
        let selection = select_budget(config, budget, &set_flags)?;
        check_compression(config, &selection)?;
        check_host_budget(config, &selection)?;
        return Ok(selection);
    }
    if let Some(headroom) = config.device_headroom {
        return Err(invalid(
            "device_headroom",
            format!("\"{headroom}\""),
            "with device_budget = \"auto\" only (it is what \"auto\" leaves free)",
        ));
    }
    let mut selection = match &config.diffusion_offload_config {
        Some(compact) => select_compact(config, compact, &set_flags)?,
        None => select_flags(config, &set_flags)?,
    };

    check_residency_keys(config, &selection)?;
    check_compression(config, &selection)?;
    check_host_budget(config, &selection)?;
    if let Some(depth) = config.prefetch_depth
        && !matches!(
            selection.strategy,
            OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise
        )
    {
        return Err(invalid(
            "prefetch_depth",
            depth,
            format!(
                "with layerwise or distributed layerwise offload only (this configuration selects {}): set enable_layerwise_offload = true, or remove prefetch_depth",
                selection.strategy
            ),
        ));
    }
    if selection.strategy == OffloadStrategy::DistributedLayerwise {
        if selection.uses_allgather() && config.parallel.use_hsdp {
            let key = match selection.source {
                SelectionSource::Compact => {
                    "diffusion_offload_config.layer_options.*.weight_transfer"
                }
                _ => "dlo_use_allgather",
            };
            return Err(conflict(
                (key, "allgather"),
                ("parallel.use_hsdp", true),
                "HSDP already shards the DiT parameters: use rank-local weight transfer with HSDP",
            ));
        }
        selection.gather_group = gather_group(&config.parallel, selection.uses_allgather());
    }

    Ok(selection)
}

/// A device budget selects the planned strategy over every component (the
/// planner decides what each one does), and goes with nothing that would
/// decide it instead: a strategy flag, the compact form, `resident_blocks`,
/// `dlo_*` keys. `device_headroom` goes with `"auto"` only.
fn select_budget(
    config: &OffloadConfig,
    budget: crate::bytes::DeviceBudget,
    set_flags: &[(&'static str, OffloadStrategy)],
) -> Result<Selection, ConfigError> {
    let value = format!("\"{budget}\"");
    const WHY: &str = "a device budget is planned for the whole request (which components stay resident, swap or stream): set device_budget alone, or a strategy without it";
    if let Some((flag, _)) = set_flags.first() {
        return Err(conflict(("device_budget", &value), (*flag, true), WHY));
    }
    if config.diffusion_offload_config.is_some() {
        return Err(conflict(
            ("device_budget", &value),
            ("diffusion_offload_config", "set"),
            WHY,
        ));
    }
    if !config.resident_blocks.is_empty() {
        return Err(conflict(
            ("device_budget", &value),
            ("resident_blocks", format!("{:?}", config.resident_blocks)),
            "the budget planner writes resident_blocks from device_budget: set one of them",
        ));
    }
    for (key, set) in [
        ("dlo_use_allgather", config.dlo_use_allgather.is_some()),
        ("dlo_resident_layers", config.dlo_resident_layers.is_some()),
    ] {
        if set {
            return Err(conflict(("device_budget", &value), (key, "set"), WHY));
        }
    }
    if let (Some(headroom), crate::bytes::DeviceBudget::Bytes(_)) = (config.device_headroom, budget)
    {
        return Err(conflict(
            ("device_headroom", format!("\"{headroom}\"")),
            ("device_budget", &value),
            "device_headroom is what device_budget = \"auto\" leaves free: remove it, or set device_budget = \"auto\"",
        ));
    }
    let mut selection = base_selection(OffloadStrategy::Planned, SelectionSource::Budget);
    selection.components = ComponentName::ALL.into();
    selection.pin_memory = config.pin_cpu_memory.unwrap_or(true);
    for c in ComponentName::ALL {
        selection.layer.insert(
            c,
            LayerSettings {
                weight_transfer: WeightTransfer::RankLocal,
                resident_layers: 0,
            },
        );
    }
    Ok(selection)
}

/// `device_budget` and `resident_blocks` plan layerwise residency: neither
/// goes with another strategy, with resident leading layers, or with the
/// other.
fn check_residency_keys(config: &OffloadConfig, selection: &Selection) -> Result<(), ConfigError> {
    let keys: Vec<(&str, String)> = [
        config
            .device_budget
            .map(|b| ("device_budget", format!("\"{b}\""))),
        (!config.resident_blocks.is_empty())
            .then(|| ("resident_blocks", format!("{:?}", config.resident_blocks))),
    ]
    .into_iter()
    .flatten()
    .collect();
    if let [(a, av), (b, bv)] = &keys[..] {
        return Err(conflict(
            (*a, av),
            (*b, bv),
            "the budget planner writes resident_blocks from device_budget: set one of them",
        ));
    }
    let Some((key, value)) = keys.first() else {
        return Ok(());
    };
    if selection.source == SelectionSource::Default {
        return Err(invalid(
            *key,
            value,
            "with a layerwise strategy: set enable_layerwise_offload = true (or mode = \"layer\")",
        ));
    }
    if selection.strategy != OffloadStrategy::Layerwise {
        let (other, other_value) = match selection.source {
            SelectionSource::Compact => (
                "diffusion_offload_config.mode".to_owned(),
                selection.strategy.to_string(),
            ),
            _ => (
                FLAG_PRIORITY
                    .iter()
                    .find(|(_, s)| *s == selection.strategy)
                    .map_or("enable_*", |(f, _)| *f)
                    .to_owned(),
                "true".to_owned(),
            ),
        };
        return Err(conflict(
            (*key, value),
            (other, other_value),
            "resident blocks are planned for layerwise offload only: use enable_layerwise_offload (or mode = \"layer\" with rank-local weight transfer and no resident_layers)",
        ));
    }
    if selection.dit_resident_layers() > 0 {
        return Err(conflict(
            (*key, value),
            ("resident_layers", selection.dit_resident_layers()),
            "resident_layers keeps the leading blocks; the planner or resident_blocks chooses any blocks: set one of them",
        ));
    }
    Ok(())
}

fn base_selection(strategy: OffloadStrategy, source: SelectionSource) -> Selection {
    Selection {
        strategy,
        source,
        components: BTreeSet::new(),
        components_explicit: false,
        pin_memory: true,
        layer: BTreeMap::new(),
        gather_group: GatherGroup::NONE,
        disabled_flags: Vec::new(),
    }
}

fn select_flags(
    config: &OffloadConfig,
    set_flags: &[(&'static str, OffloadStrategy)],
) -> Result<Selection, ConfigError> {
    let Some(&(_, strategy)) = set_flags.first() else {
        return Ok(base_selection(
            OffloadStrategy::None,
            SelectionSource::Default,
        ));
    };
    let mut selection = base_selection(strategy, SelectionSource::Flags);
    selection.pin_memory = config.pin_cpu_memory.unwrap_or(true);
    selection.disabled_flags = set_flags[1..]
        .iter()
        .map(|(flag, _)| DisabledFlag { flag, by: strategy })
        .collect();
    match strategy {
        OffloadStrategy::ModelLevel => {
            selection.components = [ComponentName::Dit, ComponentName::TextEncoder].into();
        }
        OffloadStrategy::Layerwise => {
            selection.components = [ComponentName::Dit].into();
            selection.layer.insert(
                ComponentName::Dit,
                LayerSettings {
                    weight_transfer: WeightTransfer::RankLocal,
                    resident_layers: 0,
                },
            );
        }
        OffloadStrategy::DistributedLayerwise => {
            let allgather = config.dlo_use_allgather.unwrap_or(true);
            let resident_layers = config.dlo_resident_layers.unwrap_or(0);
            if allgather && resident_layers > 0 {
                return Err(conflict(
                    ("dlo_resident_layers", resident_layers),
                    ("dlo_use_allgather", allgather),
                    "resident leading layers are rank-local only: set dlo_use_allgather = false, or dlo_resident_layers = 0",
                ));
            }
            selection.components = [ComponentName::Dit].into();
            selection.layer.insert(
                ComponentName::Dit,
                LayerSettings {
                    weight_transfer: if allgather {
                        WeightTransfer::Allgather
                    } else {
                        WeightTransfer::RankLocal
                    },
                    resident_layers,
                },
            );
        }
        OffloadStrategy::None | OffloadStrategy::Planned => {
            unreachable!("flags select a streaming or model-level strategy")
        }
    }
    if strategy != OffloadStrategy::DistributedLayerwise {
        for (key, set) in [
            ("dlo_use_allgather", config.dlo_use_allgather.is_some()),
            ("dlo_resident_layers", config.dlo_resident_layers.is_some()),
        ] {
            if set {
                return Err(conflict(
                    (key, "set"),
                    ("selected strategy", strategy),
                    "dlo_* keys tune distributed layerwise offload only: remove them or set enable_distributed_layerwise_offload",
                ));
            }
        }
    }
    Ok(selection)
}

fn select_compact(
    config: &OffloadConfig,
    compact: &CompactConfig,
    set_flags: &[(&'static str, OffloadStrategy)],
) -> Result<Selection, ConfigError> {
    const ALLOWED_COMPONENTS: &str = "a non-empty list of distinct `dit`, `text_encoder`, `vae`";
    if compact.components.is_empty() {
        return Err(invalid(
            "diffusion_offload_config.components",
            "[]",
            ALLOWED_COMPONENTS,
        ));
    }
    let mut components = BTreeSet::new();
    for c in &compact.components {
        if !components.insert(*c) {
            return Err(invalid(
                "diffusion_offload_config.components",
                format!("{c} listed twice"),
                ALLOWED_COMPONENTS,
            ));
        }
    }

    let mut layer = BTreeMap::new();
    for (name, options) in &compact.layer_options {
        let key = format!("diffusion_offload_config.layer_options.{name}");
        let Some(component) = ComponentName::ALL.iter().find(|c| c.key() == name) else {
            return Err(invalid(
                key,
                format!("unknown component `{name}`"),
                "one of `dit`, `text_encoder`, `vae`",
            ));
        };
        if compact.mode == CompactMode::Module {
            return Err(conflict(
                (key, "set"),
                ("diffusion_offload_config.mode", "module"),
                "layer_options apply to mode = \"layer\" only",
            ));
        }
        if !components.contains(component) {
            return Err(invalid(
                key,
                "options for a component not in `components`",
                format!(
                    "options only for the selected components: {}",
                    names(&components)
                ),
            ));
        }
        if options.resident_layers > 0 && *component != ComponentName::Dit {
            return Err(invalid(
                format!("{key}.resident_layers"),
                options.resident_layers,
                "0: resident leading layers apply to `dit` only",
            ));
        }
        let transfer = options.weight_transfer.unwrap_or(WeightTransfer::RankLocal);
        if options.resident_layers > 0 && transfer == WeightTransfer::Allgather {
            return Err(conflict(
                (format!("{key}.resident_layers"), options.resident_layers),
                (format!("{key}.weight_transfer"), "allgather"),
                "resident leading layers are rank-local only: use weight_transfer = \"rank-local\" or resident_layers = 0",
            ));
        }
        layer.insert(
            *component,
            LayerSettings {
                weight_transfer: transfer,
                resident_layers: options.resident_layers,
            },
        );
    }

    let strategy = match compact.mode {
        CompactMode::Module => OffloadStrategy::ModelLevel,
        CompactMode::Layer => {
            for c in &components {
                layer.entry(*c).or_insert(LayerSettings {
                    weight_transfer: WeightTransfer::RankLocal,
                    resident_layers: 0,
                });
            }
            let distributed = layer
                .values()
                .any(|l| l.weight_transfer == WeightTransfer::Allgather || l.resident_layers > 0);
            if distributed {
                OffloadStrategy::DistributedLayerwise
            } else {
                OffloadStrategy::Layerwise
            }
        }
    };

    if let Some((flag, flag_strategy)) = set_flags.iter().find(|(_, s)| *s != strategy) {
        return Err(conflict(
            (*flag, format!("true (selects {flag_strategy})")),
            (
                "diffusion_offload_config",
                format!("mode = {:?} (selects {strategy})", compact.mode),
            ),
            "use one form, or set only the flag of the strategy the compact config selects",
        ));
    }
    for (key, set) in [
        ("dlo_use_allgather", config.dlo_use_allgather.is_some()),
        ("dlo_resident_layers", config.dlo_resident_layers.is_some()),
    ] {
        if set {
            return Err(conflict(
                (key, "set"),
                ("diffusion_offload_config", "set"),
                "with the compact form, tune DLO in diffusion_offload_config.layer_options",
            ));
        }
    }
    if let (Some(flag), Some(compact_pin)) = (config.pin_cpu_memory, compact.pin_memory)
        && flag != compact_pin
    {
        return Err(conflict(
            ("pin_cpu_memory", flag),
            ("diffusion_offload_config.pin_memory", compact_pin),
            "the same value, or only one of the two",
        ));
    }

    let mut selection = base_selection(strategy, SelectionSource::Compact);
    selection.components = components;
    selection.components_explicit = true;
    selection.pin_memory = compact.pin_memory.or(config.pin_cpu_memory).unwrap_or(true);
    selection.layer = layer;
    Ok(selection)
}

fn names(components: &BTreeSet<ComponentName>) -> String {
    components
        .iter()
        .map(|c| format!("`{c}`"))
        .collect::<Vec<_>>()
        .join(", ")
}
