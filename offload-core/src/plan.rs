//! The offload plan (schema version 1) and the pure resolver (CONTRACT §5).
//!
//! [`resolve`] maps (pipeline description, configuration) to a
//! [`ResolvedPlan`]. It moves no tensor, installs no hook and reads no
//! communicator: every topology and combination error surfaces here, before
//! a backend mutates anything.
//!
//! # Plan schema, version 1
//!
//! ```toml
//! version = 1                                   # required; only 1 is known
//! [block_containers]                            # stack owner path -> ordered containers
//! transformer = ["transformer_blocks", "single_transformer_blocks"]
//! [extra_stacks]                                # large non-block submodules streamed as their own stack
//! transformer = ["proj_out", "norm_out"]
//! self_managed = ["audio_vae"]                  # components whose residency the pipeline manages
//! resident_leading_blocks = ["transformer"]     # DiTs that may keep leading blocks resident
//! replicated_encoders = ["text_encoder"]        # encoders identical on all ranks (may be gathered)
//! ```
//!
//! Container and extra-stack paths are relative to their owner; every other
//! path is a full dotted path. Unknown keys are errors.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::config::{
    ComponentName, ConfigError, OffloadConfig, OffloadStrategy, Selection, WeightTransfer,
};
use crate::discovery::{DiscoveredComponent, Discovery, DiscoverySource, Role, discover};
use crate::model::{ModuleId, ModuleKind, Pipeline, StorageId, join};

/// The plan schema version this library reads and writes.
pub const PLAN_SCHEMA_VERSION: u32 = 1;

/// A pipeline's optional, immutable offload declaration (schema above).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadPlan {
    /// Schema version; must be [`PLAN_SCHEMA_VERSION`].
    pub version: u32,
    /// Stack owner path → ordered block containers (relative paths).
    #[serde(default)]
    pub block_containers: BTreeMap<String, Vec<String>>,
    /// Stack owner path → large non-block submodules (relative paths) that
    /// stream as their own stack, in forward order.
    #[serde(default)]
    pub extra_stacks: BTreeMap<String, Vec<String>>,
    /// Components whose residency the pipeline manages itself.
    #[serde(default)]
    pub self_managed: Vec<String>,
    /// DiTs that may keep leading blocks resident.
    #[serde(default)]
    pub resident_leading_blocks: Vec<String>,
    /// Encoders identical on all ranks; only those may be gathered.
    #[serde(default)]
    pub replicated_encoders: Vec<String>,
}

impl Default for OffloadPlan {
    fn default() -> Self {
        Self {
            version: PLAN_SCHEMA_VERSION,
            block_containers: BTreeMap::new(),
            extra_stacks: BTreeMap::new(),
            self_managed: Vec::new(),
            resident_leading_blocks: Vec::new(),
            replicated_encoders: Vec::new(),
        }
    }
}

impl OffloadPlan {
    /// Parses a plan from JSON and checks its version.
    pub fn from_json_str(text: &str) -> Result<Self, PlanError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let plan: Self = serde_path_to_error::deserialize(de).map_err(|e| PlanError::Schema {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
        plan.check_version()?;
        Ok(plan)
    }

    /// Parses a plan from TOML and checks its version.
    pub fn from_toml_str(text: &str) -> Result<Self, PlanError> {
        let de = toml::Deserializer::parse(text).map_err(|e| PlanError::Schema {
            key: String::new(),
            message: e.message().to_owned(),
        })?;
        let plan: Self = serde_path_to_error::deserialize(de).map_err(|e| PlanError::Schema {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
        plan.check_version()?;
        Ok(plan)
    }

    fn check_version(&self) -> Result<(), PlanError> {
        if self.version == PLAN_SCHEMA_VERSION {
            Ok(())
        } else {
            Err(PlanError::UnsupportedVersion {
                version: self.version,
                supported: PLAN_SCHEMA_VERSION,
            })
        }
    }
}

/// Something the resolver noticed that does not stop offloading. Backends
/// log these at `warn` when they enable (see
/// [`crate::discovery::log_warnings`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum PlanWarning {
    /// The legacy scan found the components (logged once per type).
    LegacyScan {
        /// The pipeline type.
        pipeline_type: String,
    },
    /// A declared component path does not exist; it was skipped.
    MissingDeclaredPath {
        /// Its role.
        role: Role,
        /// The path.
        path: String,
    },
    /// Blocks came from the deprecated single-container declaration.
    DeprecatedBlockContainer {
        /// The stack owner.
        owner: String,
        /// The container.
        container: String,
    },
    /// A stack owner has fewer than two blocks; it is not streamed.
    TooFewBlocks {
        /// The stack owner.
        owner: String,
        /// How many blocks it has.
        blocks: usize,
    },
    /// Model-level offload found no DiT: it does nothing.
    NoDit,
    /// Model-level offload found no encoder: DiTs go to the device, nothing
    /// else moves.
    NoEncoder,
    /// A selected component is managed by the pipeline itself.
    SelfManaged {
        /// The component path.
        path: String,
    },
}

impl fmt::Display for PlanWarning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanWarning::LegacyScan { pipeline_type } => write!(
                f,
                "pipeline `{pipeline_type}` declares no components: found them by the legacy scan of well-known names; declare them explicitly"
            ),
            PlanWarning::MissingDeclaredPath { role, path } => {
                write!(
                    f,
                    "declared {role} component `{path}` does not exist; skipped"
                )
            }
            PlanWarning::DeprecatedBlockContainer { owner, container } => write!(
                f,
                "`{owner}` declares its blocks with the deprecated single container `{container}`; declare a container list"
            ),
            PlanWarning::TooFewBlocks { owner, blocks } => write!(
                f,
                "`{owner}` has {blocks} block(s); layerwise offload needs at least 2, so it stays resident"
            ),
            PlanWarning::NoDit => {
                f.write_str("model-level offload found no DiT: nothing to offload")
            }
            PlanWarning::NoEncoder => f.write_str(
                "model-level offload found no encoder: DiTs stay on the device and nothing moves",
            ),
            PlanWarning::SelfManaged { path } => {
                write!(
                    f,
                    "`{path}` manages its own residency; offload leaves it alone"
                )
            }
        }
    }
}

/// Every error of discovery and resolution. Each names the path or key and
/// what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The configuration was rejected.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The plan text does not match the schema.
    #[error("offload plan, at `{key}`: {message}")]
    Schema {
        /// Dotted key.
        key: String,
        /// What was wrong and what is allowed.
        message: String,
    },
    /// The plan has a version this library does not know.
    #[error("offload plan version {version} is not supported; supported: {supported}")]
    UnsupportedVersion {
        /// The version given.
        version: u32,
        /// The supported version.
        supported: u32,
    },
    /// A path the plan names does not exist.
    #[error("offload plan `{key}` names `{path}`, which is not a module of the pipeline")]
    PlanPathNotFound {
        /// The plan key.
        key: &'static str,
        /// The path.
        path: String,
    },
    /// One module declared under two roles.
    #[error("`{path}` is declared both as {first} and as {second}; a module has one role")]
    ComponentRoleConflict {
        /// The module.
        path: String,
        /// The first role.
        first: Role,
        /// The second role.
        second: Role,
    },
    /// An explicitly selected component is not in the pipeline.
    #[error(
        "component `{component}` is selected but the pipeline has no {role} module (found: {found:?})"
    )]
    ComponentNotFound {
        /// The configuration name.
        component: ComponentName,
        /// The role looked for.
        role: Role,
        /// The components that were found.
        found: Vec<String>,
    },
    /// A declared block container does not exist.
    #[error(
        "`{owner}` declares block container `{container}` (from {declared_by}), which does not exist"
    )]
    MissingContainer {
        /// The stack owner.
        owner: String,
        /// The container, relative to the owner.
        container: String,
        /// Where it was declared.
        declared_by: TopologySource,
    },
    /// A block container is not a module list.
    #[error("block container `{path}` is not a module list; a container must hold indexed blocks")]
    NotAModuleList {
        /// The container's full path.
        path: String,
    },
    /// An explicitly selected component has fewer than two blocks.
    #[error(
        "`{owner}` has {blocks} block(s) but its component was selected explicitly for layerwise offload, which needs at least 2"
    )]
    TooFewBlocks {
        /// The stack owner.
        owner: String,
        /// Block count.
        blocks: usize,
    },
    /// Two stacks claim one block (or one block lies inside another).
    #[error(
        "block `{block}` is claimed by `{first}` and by `{second}`; a block belongs to one stack"
    )]
    BlockClaimedTwice {
        /// The block.
        block: String,
        /// First claimant.
        first: String,
        /// Second claimant.
        second: String,
    },
    /// A storage is shared by a streamed block and something outside it.
    #[error(
        "tensors `{first}` and `{second}` share one storage across a block boundary; tied weights must live within one block or outside all blocks"
    )]
    StorageSharedAcrossBlocks {
        /// A tensor inside a block.
        first: String,
        /// A tensor elsewhere viewing the same storage.
        second: String,
    },
    /// Resident leading layers on a DiT the plan does not allow.
    #[error(
        "`resident_layers` = {resident_layers} for `{dit}`, but the offload plan does not list it in `resident_leading_blocks` (allowed: {allowed:?})"
    )]
    ResidentLayersNotAllowed {
        /// The DiT.
        dit: String,
        /// The count.
        resident_layers: u32,
        /// The DiTs the plan allows.
        allowed: Vec<String>,
    },
    /// Resident leading layers that leave one streaming block or exceed the
    /// stack.
    #[error(
        "`resident_layers` = {resident_layers} for `{dit}` with {blocks} blocks; allowed: 0 ≤ n ≤ {blocks}, n ≠ {one_left} (one streaming block cannot form a ring)"
    )]
    ResidentLayersCount {
        /// The DiT.
        dit: String,
        /// The count.
        resident_layers: u32,
        /// The block count.
        blocks: usize,
        /// blocks − 1.
        one_left: usize,
    },
    /// `resident_blocks` names something that is not a streamed block.
    #[error(
        "`resident_blocks` names `{path}`, which is not a block of a streamed stack; allowed: {allowed}"
    )]
    ResidentBlockUnknown {
        /// The path given.
        path: String,
        /// The stacks' blocks, first and last of each.
        allowed: String,
    },
    /// `resident_blocks` leaves a stack one streaming block.
    #[error(
        "`resident_blocks` keeps {resident} of the {blocks} blocks of `{owner}` resident, leaving one to stream; allowed: leave none or at least two (one streaming block cannot form a ring)"
    )]
    ResidentBlocksLeaveOne {
        /// The stack's owner.
        owner: String,
        /// Its blocks.
        blocks: usize,
        /// How many the list keeps resident.
        resident: usize,
    },
    /// An encoder would be gathered but is not declared identical on all
    /// ranks.
    #[error(
        "encoder `{path}` would be all-gathered across {group_size} ranks, but the offload plan does not list it in `replicated_encoders`; use weight_transfer = \"rank-local\" for text_encoder or declare it"
    )]
    EncoderNotReplicated {
        /// The encoder.
        path: String,
        /// G.
        group_size: u32,
    },
}

/// Where a stack's block topology came from (precedence: plan > declared
/// list > deprecated single container).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TopologySource {
    /// The offload plan's `block_containers`.
    Plan,
    /// The module's declared container list.
    Declared,
    /// The deprecated single container.
    DeprecatedSingle,
    /// The offload plan's `extra_stacks`.
    ExtraStack,
}

impl fmt::Display for TopologySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopologySource::Plan => "the offload plan",
            TopologySource::Declared => "the declared container list",
            TopologySource::DeprecatedSingle => "the deprecated single container",
            TopologySource::ExtraStack => "the offload plan's extra_stacks",
        })
    }
}

/// One streamed unit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Block {
    /// Its path.
    pub path: String,
    /// Its module.
    #[serde(skip)]
    pub module: ModuleId,
    /// Bytes of its distinct storages.
    pub bytes: u64,
    /// Its distinct storages.
    #[serde(skip)]
    pub storages: Vec<StorageId>,
}

/// One ring's worth of blocks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct BlockStack {
    /// The owning component module's path (or the owner of an extra stack).
    pub owner: String,
    /// The owner's module.
    #[serde(skip)]
    pub owner_module: ModuleId,
    /// The owner's role.
    pub role: Role,
    /// Where the topology came from.
    pub source: TopologySource,
    /// The blocks, in forward order (containers concatenated).
    pub blocks: Vec<Block>,
    /// Indices of blocks kept on the device while the others stream: DLO's
    /// resident leading layers, or layerwise `resident_blocks` (what the
    /// budget planner chose).
    pub resident: BTreeSet<usize>,
    /// How the blocks reach the device.
    pub weight_transfer: WeightTransfer,
}

impl BlockStack {
    /// The largest block, in bytes.
    pub fn largest_block_bytes(&self) -> u64 {
        self.blocks.iter().map(|b| b.bytes).max().unwrap_or(0)
    }

    /// Bytes of the blocks that stream (all but the resident ones).
    pub fn streamed_bytes(&self) -> u64 {
        self.streamed().map(|b| b.bytes).sum()
    }

    /// The blocks that stream, in forward order.
    pub fn streamed(&self) -> impl Iterator<Item = &Block> {
        self.blocks
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.resident.contains(i))
            .map(|(_, b)| b)
    }

    /// The largest block that streams, in bytes (the slot size).
    pub fn largest_streamed_bytes(&self) -> u64 {
        self.streamed().map(|b| b.bytes).max().unwrap_or(0)
    }
}

/// A component and what the plan does with it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ResolvedComponent {
    /// Role.
    pub role: Role,
    /// Path.
    pub path: String,
    /// Module.
    #[serde(skip)]
    pub module: ModuleId,
    /// Whether the strategy moves it (model level) or streams its blocks
    /// (layer strategies).
    pub offloaded: bool,
    /// Whether the pipeline manages its residency itself.
    pub self_managed: bool,
    /// Bytes of its distinct storages.
    pub bytes: u64,
}

/// The resolved plan: everything a backend needs, decided before anything
/// is mutated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ResolvedPlan {
    /// Plan schema version.
    pub schema_version: u32,
    /// Pipeline type.
    pub pipeline_type: String,
    /// The configuration's selection.
    pub selection: Selection,
    /// Where the components came from.
    pub discovery_source: DiscoverySource,
    /// Every discovered component.
    pub components: Vec<ResolvedComponent>,
    /// The block stacks (layer strategies).
    pub stacks: Vec<BlockStack>,
    /// Warnings to log at enable.
    pub warnings: Vec<PlanWarning>,
}

impl ResolvedPlan {
    /// The selected strategy.
    pub fn strategy(&self) -> OffloadStrategy {
        self.selection.strategy
    }

    /// The largest block of any stack, in bytes (the slot size).
    pub fn largest_block_bytes(&self) -> u64 {
        self.stacks
            .iter()
            .map(BlockStack::largest_block_bytes)
            .max()
            .unwrap_or(0)
    }

    /// The largest streamed block of any stack, in bytes (the slot size
    /// when some blocks stay resident).
    pub fn largest_streamed_bytes(&self) -> u64 {
        self.stacks
            .iter()
            .map(BlockStack::largest_streamed_bytes)
            .max()
            .unwrap_or(0)
    }

    /// Bytes streamed per forward over every stack.
    pub fn streamed_bytes(&self) -> u64 {
        self.stacks.iter().map(BlockStack::streamed_bytes).sum()
    }
}

fn role_of(component: ComponentName) -> Role {
    match component {
        ComponentName::Dit => Role::Dit,
        ComponentName::TextEncoder => Role::Encoder,
        ComponentName::Vae => Role::Vae,
    }
}

fn component_of(role: Role) -> Option<ComponentName> {
    match role {
        Role::Dit => Some(ComponentName::Dit),
        Role::Encoder => Some(ComponentName::TextEncoder),
        Role::Vae => Some(ComponentName::Vae),
        Role::Resident => None,
    }
}

/// Resolves the plan: a pure function of the pipeline description and the
/// configuration (with its parallel facts). Every error of CONTRACT §2 and
/// §5 is returned here.
pub fn resolve(pipeline: &Pipeline, config: &OffloadConfig) -> Result<ResolvedPlan, PlanError> {
    let selection = config.select()?;
    let plan = pipeline.offload_plan();
    if let Some(plan) = plan {
        plan.check_version()?;
        check_plan_paths(pipeline, plan)?;
    }
    let Discovery {
        source,
        components: discovered,
        mut warnings,
    } = discover(pipeline)?;

    let self_managed: BTreeSet<&str> = plan
        .map(|p| p.self_managed.iter().map(String::as_str).collect())
        .unwrap_or_default();

    if selection.components_explicit {
        for component in &selection.components {
            let role = role_of(*component);
            if !discovered.iter().any(|c| c.role == role) {
                return Err(PlanError::ComponentNotFound {
                    component: *component,
                    role,
                    found: discovered.iter().map(|c| c.path.clone()).collect(),
                });
            }
        }
    }

    let selected = |c: &DiscoveredComponent| {
        component_of(c.role).is_some_and(|n| selection.components.contains(&n))
    };
    let mut components: Vec<ResolvedComponent> = discovered
        .iter()
        .map(|c| {
            let managed = self_managed.contains(c.path.as_str());
            if managed && selected(c) {
                warnings.push(PlanWarning::SelfManaged {
                    path: c.path.clone(),
                });
            }
            ResolvedComponent {
                role: c.role,
                path: c.path.clone(),
                module: c.module,
                offloaded: selection.strategy != OffloadStrategy::None && selected(c) && !managed,
                self_managed: managed,
                bytes: pipeline.subtree_bytes(c.module),
            }
        })
        .collect();

    let mut stacks = Vec::new();
    match selection.strategy {
        OffloadStrategy::None => {}
        OffloadStrategy::ModelLevel => {
            if !components.iter().any(|c| c.role == Role::Dit) {
                warnings.push(PlanWarning::NoDit);
                components.iter_mut().for_each(|c| c.offloaded = false);
            } else if !components.iter().any(|c| c.role == Role::Encoder) {
                warnings.push(PlanWarning::NoEncoder);
            }
        }
        OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => {
            for component in components.iter_mut().filter(|c| c.offloaded) {
                let name = component_of(component.role).expect("offloaded components have a name");
                let settings =
                    selection
                        .layer
                        .get(&name)
                        .copied()
                        .unwrap_or(crate::config::LayerSettings {
                            weight_transfer: WeightTransfer::RankLocal,
                            resident_layers: 0,
                        });
                let owner_stacks = resolve_stacks(pipeline, component, plan, &mut warnings)?;
                if owner_stacks.is_empty() {
                    if selection.components_explicit {
                        let blocks = count_declared_blocks(pipeline, component, plan);
                        return Err(PlanError::TooFewBlocks {
                            owner: component.path.clone(),
                            blocks,
                        });
                    }
                    component.offloaded = false;
                    continue;
                }
                for mut stack in owner_stacks {
                    stack.weight_transfer = settings.weight_transfer;
                    if stack.source != TopologySource::ExtraStack {
                        let lead = check_resident_layers(&stack, settings.resident_layers, plan)?;
                        stack.resident = (0..lead as usize).collect();
                    }
                    if component.role == Role::Encoder
                        && settings.weight_transfer == WeightTransfer::Allgather
                        && selection.gather_group.size > 1
                        && !plan.is_some_and(|p| p.replicated_encoders.contains(&component.path))
                    {
                        return Err(PlanError::EncoderNotReplicated {
                            path: component.path.clone(),
                            group_size: selection.gather_group.size,
                        });
                    }
                    stacks.push(stack);
                }
            }
            check_block_claims(pipeline, &stacks)?;
            apply_resident_blocks(&mut stacks, &config.resident_blocks)?;
        }
    }

    Ok(ResolvedPlan {
        schema_version: PLAN_SCHEMA_VERSION,
        pipeline_type: pipeline.type_name().to_owned(),
        selection,
        discovery_source: source,
        components,
        stacks,
        warnings,
    })
}

fn check_plan_paths(pipeline: &Pipeline, plan: &OffloadPlan) -> Result<(), PlanError> {
    let lists: [(&'static str, Vec<&String>); 5] = [
        ("block_containers", plan.block_containers.keys().collect()),
        ("extra_stacks", plan.extra_stacks.keys().collect()),
        ("self_managed", plan.self_managed.iter().collect()),
        (
            "resident_leading_blocks",
            plan.resident_leading_blocks.iter().collect(),
        ),
        (
            "replicated_encoders",
            plan.replicated_encoders.iter().collect(),
        ),
    ];
    for (key, paths) in lists {
        for path in paths {
            if path.is_empty() || pipeline.module_id(path).is_none() {
                return Err(PlanError::PlanPathNotFound {
                    key,
                    path: path.clone(),
                });
            }
        }
    }
    Ok(())
}

/// The block containers of a stack owner, by precedence.
fn topology(
    pipeline: &Pipeline,
    owner: &ResolvedComponent,
    plan: Option<&OffloadPlan>,
) -> Option<(TopologySource, Vec<String>)> {
    if let Some(containers) = plan.and_then(|p| p.block_containers.get(&owner.path)) {
        return Some((TopologySource::Plan, containers.clone()));
    }
    let module = pipeline.module(owner.module);
    match (&module.block_containers, &module.deprecated_block_container) {
        (Some(list), _) => Some((TopologySource::Declared, list.clone())),
        (None, Some(one)) => Some((TopologySource::DeprecatedSingle, vec![one.clone()])),
        (None, None) => None,
    }
}

fn count_declared_blocks(
    pipeline: &Pipeline,
    owner: &ResolvedComponent,
    plan: Option<&OffloadPlan>,
) -> usize {
    topology(pipeline, owner, plan)
        .map(|(_, containers)| {
            containers
                .iter()
                .filter_map(|c| pipeline.module_id(&join(&owner.path, c)))
                .map(|m| pipeline.module(m).children.len())
                .sum()
        })
        .unwrap_or(0)
}

fn block_of(pipeline: &Pipeline, module: ModuleId) -> Block {
    let storages: Vec<StorageId> = pipeline.subtree_storages(module).into_iter().collect();
    Block {
        path: pipeline.module(module).path.clone(),
        module,
        bytes: storages.iter().map(|s| pipeline.storage(*s).bytes).sum(),
        storages,
    }
}

fn resolve_stacks(
    pipeline: &Pipeline,
    owner: &ResolvedComponent,
    plan: Option<&OffloadPlan>,
    warnings: &mut Vec<PlanWarning>,
) -> Result<Vec<BlockStack>, PlanError> {
    let mut stacks = Vec::new();
    let new_stack = |source, blocks| BlockStack {
        owner: owner.path.clone(),
        owner_module: owner.module,
        role: owner.role,
        source,
        blocks,
        resident: BTreeSet::new(),
        weight_transfer: WeightTransfer::RankLocal,
    };

    let mut block_count = 0;
    if let Some((source, containers)) = topology(pipeline, owner, plan) {
        let mut blocks = Vec::new();
        for container in &containers {
            let path = join(&owner.path, container);
            let Some(list) = pipeline.module_id(&path) else {
                return Err(PlanError::MissingContainer {
                    owner: owner.path.clone(),
                    container: container.clone(),
                    declared_by: source,
                });
            };
            if pipeline.module(list).kind != ModuleKind::List {
                return Err(PlanError::NotAModuleList { path });
            }
            if source == TopologySource::DeprecatedSingle {
                warnings.push(PlanWarning::DeprecatedBlockContainer {
                    owner: owner.path.clone(),
                    container: container.clone(),
                });
            }
            blocks.extend(
                pipeline
                    .module(list)
                    .children
                    .iter()
                    .map(|b| block_of(pipeline, *b)),
            );
        }
        block_count = blocks.len();
        if blocks.len() >= 2 {
            stacks.push(new_stack(source, blocks));
        }
    }
    if block_count < 2 {
        warnings.push(PlanWarning::TooFewBlocks {
            owner: owner.path.clone(),
            blocks: block_count,
        });
    }

    if let Some(extra) = plan.and_then(|p| p.extra_stacks.get(&owner.path)) {
        let mut blocks = Vec::new();
        for rel in extra {
            let path = join(&owner.path, rel);
            let Some(module) = pipeline.module_id(&path) else {
                return Err(PlanError::MissingContainer {
                    owner: owner.path.clone(),
                    container: rel.clone(),
                    declared_by: TopologySource::ExtraStack,
                });
            };
            blocks.push(block_of(pipeline, module));
        }
        if blocks.len() >= 2 {
            stacks.push(new_stack(TopologySource::ExtraStack, blocks));
        } else {
            warnings.push(PlanWarning::TooFewBlocks {
                owner: format!("{} (extra_stacks)", owner.path),
                blocks: blocks.len(),
            });
        }
    }
    Ok(stacks)
}

/// Marks `resident_blocks` resident in their stacks: each must name a
/// streamed block, and no stack may be left with one streaming block.
fn apply_resident_blocks(stacks: &mut [BlockStack], paths: &[String]) -> Result<(), PlanError> {
    for path in paths {
        let found = stacks.iter_mut().find_map(|s| {
            let i = s.blocks.iter().position(|b| &b.path == path)?;
            Some((s, i))
        });
        let Some((stack, i)) = found else {
            let allowed = stacks
                .iter()
                .filter_map(|s| {
                    let first = s.blocks.first()?;
                    let last = s.blocks.last()?;
                    Some(format!(
                        "`{}` … `{}` ({} blocks of `{}`)",
                        first.path,
                        last.path,
                        s.blocks.len(),
                        s.owner
                    ))
                })
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PlanError::ResidentBlockUnknown {
                path: path.clone(),
                allowed,
            });
        };
        stack.resident.insert(i);
    }
    if let Some(stack) = stacks
        .iter()
        .find(|s| s.blocks.len() - s.resident.len() == 1)
    {
        return Err(PlanError::ResidentBlocksLeaveOne {
            owner: stack.owner.clone(),
            blocks: stack.blocks.len(),
            resident: stack.resident.len(),
        });
    }
    Ok(())
}

fn check_resident_layers(
    stack: &BlockStack,
    resident_layers: u32,
    plan: Option<&OffloadPlan>,
) -> Result<u32, PlanError> {
    if resident_layers == 0 {
        return Ok(0);
    }
    if let Some(plan) = plan
        && !plan.resident_leading_blocks.contains(&stack.owner)
    {
        return Err(PlanError::ResidentLayersNotAllowed {
            dit: stack.owner.clone(),
            resident_layers,
            allowed: plan.resident_leading_blocks.clone(),
        });
    }
    let blocks = stack.blocks.len();
    let n = resident_layers as usize;
    if n > blocks || blocks - n == 1 {
        return Err(PlanError::ResidentLayersCount {
            dit: stack.owner.clone(),
            resident_layers,
            blocks,
            one_left: blocks - 1,
        });
    }
    Ok(resident_layers)
}

/// Two stacks may not claim one block, blocks may not nest, and a storage
/// may not be shared across a block boundary.
fn check_block_claims(pipeline: &Pipeline, stacks: &[BlockStack]) -> Result<(), PlanError> {
    let mut owner_of_block: BTreeMap<ModuleId, &str> = BTreeMap::new();
    for stack in stacks {
        for block in &stack.blocks {
            if let Some(first) = owner_of_block.insert(block.module, &stack.owner) {
                return Err(PlanError::BlockClaimedTwice {
                    block: block.path.clone(),
                    first: first.to_owned(),
                    second: stack.owner.clone(),
                });
            }
        }
    }
    // Nesting: a block inside another block.
    let blocks: Vec<(ModuleId, &str)> = owner_of_block.iter().map(|(m, o)| (*m, *o)).collect();
    for (module, owner) in &blocks {
        let mut up = pipeline.module(*module).parent;
        while let Some(a) = up {
            if let Some(outer) = owner_of_block.get(&a) {
                return Err(PlanError::BlockClaimedTwice {
                    block: pipeline.module(*module).path.clone(),
                    first: format!("{outer} (inside block `{}`)", pipeline.module(a).path),
                    second: (*owner).to_owned(),
                });
            }
            up = pipeline.module(a).parent;
        }
    }
    // Storage sharing across a block boundary.
    let mut block_of_tensor = vec![None; pipeline.tensors().count()];
    for (module, _) in &blocks {
        for t in pipeline.subtree_tensors(*module) {
            block_of_tensor[t.index()] = Some(*module);
        }
    }
    let mut first_user: BTreeMap<StorageId, (Option<ModuleId>, crate::model::TensorId)> =
        BTreeMap::new();
    for (t, tensor) in pipeline.tensors() {
        let here = block_of_tensor[t.index()];
        match first_user.get(&tensor.storage) {
            None => {
                first_user.insert(tensor.storage, (here, t));
            }
            Some((there, other)) if *there != here => {
                let (inside, outside) = if here.is_some() {
                    (t, *other)
                } else {
                    (*other, t)
                };
                return Err(PlanError::StorageSharedAcrossBlocks {
                    first: pipeline.tensor_path(inside),
                    second: pipeline.tensor_path(outside),
                });
            }
            Some(_) => {}
        }
    }
    Ok(())
}
