//! What resolution reports (CONTRACT §5): the warnings that do not stop
//! offloading ([`PlanWarning`]) and the errors that do ([`PlanError`]),
//! each naming the path or key and what is allowed. Value types, below
//! the discovery and resolution logic that produce them.

use std::fmt;

use serde::Serialize;

use crate::config::{ComponentName, ConfigError};
use crate::declaration::Role;

/// Something the resolver noticed that does not change what the
/// configuration does (anything that would, such as a declared path that
/// does not exist or a stack that cannot stream, is a [`PlanError`]).
/// Backends log these at `warn` when they enable (see
/// [`crate::discovery::log_warnings`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum PlanWarning {
    /// The legacy scan found the components (logged once per type).
    LegacyScan {
        /// The pipeline type.
        pipeline_type: String,
    },
    /// Blocks came from the deprecated single-container declaration.
    DeprecatedBlockContainer {
        /// The stack owner.
        owner: String,
        /// The container.
        container: String,
    },
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
            PlanWarning::DeprecatedBlockContainer { owner, container } => write!(
                f,
                "`{owner}` declares its blocks with the deprecated single container `{container}`; declare a container list"
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
    /// A selected component is not in the pipeline.
    #[error(
        "component `{component}` is selected but the pipeline has no {role} module (its components: {found:?}); declare it with `ComponentDeclaration {{ {role}: vec![\"<its path>\".into()], .. }}` and `PipelineBuilder::declare_components`"
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
    /// A component layerwise offload streams has fewer than two blocks.
    #[error(
        "`{owner}` has {blocks} block(s), but {strategy} offload streams its blocks and needs at least 2: {fix}"
    )]
    TooFewBlocks {
        /// The stack owner.
        owner: String,
        /// Block count.
        blocks: usize,
        /// The selected strategy.
        strategy: crate::config::OffloadStrategy,
        /// What declares its blocks.
        fix: String,
    },
    /// A path of the pipeline's component declaration is not a module.
    #[error(
        "the pipeline's `ComponentDeclaration` lists {} as a {role} component, but the pipeline has no such module{hint}: fix the path in `{role}: vec![…]` (the pipeline's top-level modules: {modules})",
        if path.is_empty() { "an empty path".to_owned() } else { format!("`{path}`") }
    )]
    DeclaredComponentMissing {
        /// Its role.
        role: Role,
        /// The path.
        path: String,
        /// The nearest existing names (or nothing).
        hint: String,
        /// The pipeline's top-level modules.
        modules: String,
    },
    /// The selected strategy would move nothing.
    #[error("{strategy} offload would move nothing: {reason}")]
    NothingToOffload {
        /// The selected strategy.
        strategy: crate::config::OffloadStrategy,
        /// Why, and what to do instead.
        reason: String,
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
