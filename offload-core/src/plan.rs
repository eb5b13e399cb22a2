//! The offload plan (schema version 1) and the pure resolver (CONTRACT §5).
//!
//! [`resolve`] maps (pipeline description, configuration) to a
//! [`ResolvedPlan`]. It moves no tensor, installs no hook and reads no
//! communicator: every topology and combination error surfaces here, before
//! a backend mutates anything.
//!
//! The plan schema itself is [`crate::schema`] (re-exported here).

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::config::{ComponentName, OffloadConfig, OffloadStrategy, Selection, WeightTransfer};
pub use crate::diagnostics::{PlanError, PlanWarning, TopologySource};
use crate::discovery::{DiscoveredComponent, Discovery, DiscoverySource, Role, discover};
use crate::model::{ModuleId, ModuleKind, Pipeline, StorageId, join};
pub use crate::schema::{OffloadPlan, PLAN_SCHEMA_VERSION};

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
            let of = |role| {
                components
                    .iter()
                    .filter(move |c: &&ResolvedComponent| c.role == role)
            };
            let found = || crate::suggest::listed(components.iter().map(|c| c.path.as_str()), 8);
            let missing = if of(Role::Dit).next().is_none() {
                Some("DiT")
            } else if of(Role::Encoder).next().is_none() {
                Some("encoder")
            } else {
                None
            };
            if let Some(missing) = missing {
                return Err(PlanError::NothingToOffload {
                    strategy: selection.strategy,
                    reason: format!(
                        "it swaps the DiTs with the encoders, and the pipeline has no {missing} (its components: {}); declare the pipeline's components (`ComponentDeclaration`), or stream the DiT's blocks (`enable_layerwise_offload = true`), or plan a `device_budget`",
                        found()
                    ),
                });
            }
        }
        OffloadStrategy::Layerwise
        | OffloadStrategy::DistributedLayerwise
        | OffloadStrategy::Planned => {
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
                let (owner_stacks, short) =
                    resolve_stacks(pipeline, component, plan, &mut warnings)?;
                // The planner swaps or keeps whole a component it cannot
                // stream; a layer strategy that was asked to stream it
                // cannot, and says what declares its blocks.
                if selection.strategy != OffloadStrategy::Planned
                    && let Some((owner, blocks, fix)) = short.into_iter().next()
                {
                    return Err(PlanError::TooFewBlocks {
                        owner,
                        blocks,
                        strategy: selection.strategy,
                        fix,
                    });
                }
                if owner_stacks.is_empty() {
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
            let moved = match selection.strategy {
                OffloadStrategy::Planned => components.iter().any(|c| c.offloaded),
                _ => !stacks.is_empty(),
            };
            if !moved {
                let wanted: Vec<String> =
                    selection.components.iter().map(|c| c.to_string()).collect();
                let managed: Vec<&str> = components
                    .iter()
                    .filter(|c| c.self_managed && selected_role(c.role, &selection))
                    .map(|c| c.path.as_str())
                    .collect();
                let reason = if managed.is_empty() {
                    format!(
                        "it offloads the {} component(s), and the pipeline has none (its components: {}); declare them with `ComponentDeclaration` and `PipelineBuilder::declare_components`",
                        wanted.join(", "),
                        crate::suggest::listed(components.iter().map(|c| c.path.as_str()), 8),
                    )
                } else {
                    format!(
                        "its {} component(s) {} are listed in the offload plan's `self_managed` (the pipeline moves them itself); remove them from `self_managed`, or do not select offload",
                        wanted.join(", "),
                        crate::suggest::listed(managed, 8),
                    )
                };
                return Err(PlanError::NothingToOffload {
                    strategy: selection.strategy,
                    reason,
                });
            }
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

fn selected_role(role: Role, selection: &Selection) -> bool {
    component_of(role).is_some_and(|n| selection.components.contains(&n))
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
    topology_of(pipeline, owner.module, plan)
}

fn topology_of(
    pipeline: &Pipeline,
    owner: ModuleId,
    plan: Option<&OffloadPlan>,
) -> Option<(TopologySource, Vec<String>)> {
    let module = pipeline.module(owner);
    if let Some(containers) = plan.and_then(|p| p.block_containers.get(&module.path)) {
        return Some((TopologySource::Plan, containers.clone()));
    }
    match (&module.block_containers, &module.deprecated_block_container) {
        (Some(list), _) => Some((TopologySource::Declared, list.clone())),
        (None, Some(one)) => Some((TopologySource::DeprecatedSingle, vec![one.clone()])),
        (None, None) => None,
    }
}

/// The block containers of `module` (relative paths, forward order) as
/// resolution reads them: the pipeline's offload plan, else the module's
/// declared list, else its deprecated single container; `None` if it
/// declares none.
pub fn block_containers_of(pipeline: &Pipeline, module: ModuleId) -> Option<Vec<String>> {
    topology_of(pipeline, module, pipeline.offload_plan()).map(|(_, c)| c)
}

/// The module lists of `owner`'s subtree that are not inside another list
/// (candidate block containers), relative to it, with their lengths.
fn module_lists(pipeline: &Pipeline, owner: ModuleId) -> Vec<(String, usize)> {
    let base = &pipeline.module(owner).path;
    let mut out = Vec::new();
    let mut stack = vec![owner];
    while let Some(m) = stack.pop() {
        let module = pipeline.module(m);
        if m != owner && module.kind == ModuleKind::List {
            let rel = module
                .path
                .strip_prefix(base.as_str())
                .unwrap_or(&module.path);
            out.push((
                rel.trim_start_matches('.').to_owned(),
                module.children.len(),
            ));
            continue;
        }
        stack.extend(module.children.iter().rev());
    }
    out
}

/// What declares `owner`'s blocks, for an error that found too few.
fn blocks_fix(
    pipeline: &Pipeline,
    owner: &ResolvedComponent,
    declared: Option<&[String]>,
) -> String {
    let lists = module_lists(pipeline, owner.module);
    let listed = lists
        .iter()
        .map(|(p, n)| format!("`{p}` ({n} blocks)"))
        .collect::<Vec<_>>()
        .join(", ");
    match (declared, lists.is_empty()) {
        (None, false) => format!(
            "it declares no block containers; name them in forward order with `block_containers(&[{}])` on the module builder of `{}` (its module lists: {listed})",
            lists
                .iter()
                .map(|(p, _)| format!("\"{p}\""))
                .collect::<Vec<_>>()
                .join(", "),
            owner.path,
        ),
        (None, true) => format!(
            "it has no blocks: build its repeated blocks as a module list (`list(\"blocks\", n, …)` on the module builder of `{}`) and name the list with `block_containers(&[\"blocks\"])`; a component without blocks is swapped whole by model-level offload or a `device_budget`",
            owner.path
        ),
        (Some(containers), _) => format!(
            "its block containers {} hold too few; name the module lists of its repeated blocks (its module lists: {}), or swap it whole with model-level offload or a `device_budget`",
            containers
                .iter()
                .map(|c| format!("`{c}`"))
                .collect::<Vec<_>>()
                .join(", "),
            if listed.is_empty() {
                "none".to_owned()
            } else {
                listed
            },
        ),
    }
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

/// A stack that cannot stream: its owner (as named in errors), its block
/// count, and what declares its blocks.
type ShortStack = (String, usize, String);

/// The stacks of `owner`, and those of its declarations that hold fewer
/// than two blocks (a layer strategy refuses them; the planner swaps the
/// component whole instead).
fn resolve_stacks(
    pipeline: &Pipeline,
    owner: &ResolvedComponent,
    plan: Option<&OffloadPlan>,
    warnings: &mut Vec<PlanWarning>,
) -> Result<(Vec<BlockStack>, Vec<ShortStack>), PlanError> {
    let mut short = Vec::new();
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
    let topo = topology(pipeline, owner, plan);
    if let Some((source, containers)) = &topo {
        let source = *source;
        let mut blocks = Vec::new();
        for container in containers {
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
        let declared = topo.as_ref().map(|(_, c)| c.as_slice());
        short.push((
            owner.path.clone(),
            block_count,
            blocks_fix(pipeline, owner, declared),
        ));
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
            short.push((
                format!("{} (extra_stacks)", owner.path),
                blocks.len(),
                "an extra stack of the offload plan names at least 2 submodules".to_owned(),
            ));
        }
    }
    Ok((stacks, short))
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
