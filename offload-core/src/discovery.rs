//! Component discovery (CONTRACT §5): the pipeline's explicit declaration
//! of dotted paths, else the legacy fallback scan of well-known names.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

pub use crate::declaration::{ComponentDeclaration, Role};
use crate::diagnostics::{PlanError, PlanWarning};
use crate::model::{ModuleId, Pipeline};
use crate::sync::{Mutex, OnceLock, lock};

/// Where the components came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiscoverySource {
    /// The pipeline's [`ComponentDeclaration`].
    Declared,
    /// The legacy scan of well-known names.
    LegacyScan,
}

/// One discovered component.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DiscoveredComponent {
    /// Its role.
    pub role: Role,
    /// Its dotted path.
    pub path: String,
    /// Its module.
    pub module: ModuleId,
}

/// The discovered components, in declaration (or scan) order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Discovery {
    /// Where they came from.
    pub source: DiscoverySource,
    /// The components.
    pub components: Vec<DiscoveredComponent>,
    /// Warnings (missing declared paths, the legacy scan).
    pub warnings: Vec<PlanWarning>,
}

impl Discovery {
    /// The components of one role.
    pub fn of_role(&self, role: Role) -> impl Iterator<Item = &DiscoveredComponent> {
        self.components.iter().filter(move |c| c.role == role)
    }
}

/// Legacy scan: well-known DiT attribute names, in priority order.
pub const LEGACY_DIT_NAMES: [&str; 7] = [
    "transformer",
    "transformer_2",
    "dit",
    "sr_dit",
    "language_model",
    "transformer_blocks",
    "model",
];
/// Legacy scan: well-known encoder attribute names.
pub const LEGACY_ENCODER_NAMES: [&str; 5] = [
    "text_encoder",
    "text_encoder_2",
    "text_encoder_3",
    "image_encoder",
    "mllm",
];
/// Legacy scan: well-known VAE attribute names.
pub const LEGACY_VAE_NAMES: [&str; 2] = ["vae", "audio_vae"];

/// Discovers the pipeline's components. Pure: it reads the description
/// only; warnings are returned, not logged.
pub fn discover(pipeline: &Pipeline) -> Result<Discovery, PlanError> {
    match pipeline.declaration() {
        Some(decl) => discover_declared(pipeline, decl),
        None => Ok(legacy_scan(pipeline)),
    }
}

fn discover_declared(
    pipeline: &Pipeline,
    decl: &ComponentDeclaration,
) -> Result<Discovery, PlanError> {
    let mut components = Vec::new();
    let mut claimed: BTreeMap<ModuleId, Role> = BTreeMap::new();
    for (role, paths) in [
        (Role::Dit, &decl.dit),
        (Role::Encoder, &decl.encoder),
        (Role::Vae, &decl.vae),
        (Role::Resident, &decl.resident),
    ] {
        for path in paths {
            let Some(module) = pipeline.module_id(path).filter(|_| !path.is_empty()) else {
                return Err(missing_declared(pipeline, role, path));
            };
            match claimed.get(&module) {
                Some(first) if *first == role => continue,
                Some(first) => {
                    return Err(PlanError::ComponentRoleConflict {
                        path: path.clone(),
                        first: *first,
                        second: role,
                    });
                }
                None => {}
            }
            claimed.insert(module, role);
            components.push(DiscoveredComponent {
                role,
                path: path.clone(),
                module,
            });
        }
    }
    Ok(Discovery {
        source: DiscoverySource::Declared,
        components,
        warnings: Vec::new(),
    })
}

/// The error for a declared path that is no module: the nearest modules
/// under its deepest existing ancestor, and the top-level modules.
fn missing_declared(pipeline: &Pipeline, role: Role, path: &str) -> PlanError {
    let (parent, last) = match path.rsplit_once('.') {
        Some((parent, last)) => (pipeline.module_id(parent), last),
        None => (Some(pipeline.root()), path),
    };
    let names = |m: ModuleId| -> Vec<&str> {
        pipeline
            .module(m)
            .children
            .iter()
            .map(|c| pipeline.module(*c).path.as_str())
            .collect()
    };
    let hint = match parent {
        Some(parent) => {
            let children = names(parent);
            let near = crate::suggest::nearest(
                last,
                children
                    .iter()
                    .map(|c| c.rsplit_once('.').map_or(*c, |(_, n)| n)),
            );
            let prefix = &pipeline.module(parent).path;
            let quoted: Vec<String> = near
                .iter()
                .map(|n| format!("`{}`", crate::model::join(prefix, n)))
                .collect();
            if quoted.is_empty() {
                String::new()
            } else {
                format!(" (did you mean {}?)", quoted.join(" or "))
            }
        }
        None => String::new(),
    };
    PlanError::DeclaredComponentMissing {
        role,
        path: path.to_owned(),
        hint,
        modules: crate::suggest::listed(names(pipeline.root()), 12),
    }
}

fn legacy_scan(pipeline: &Pipeline) -> Discovery {
    let mut components = Vec::new();
    for (role, names) in [
        (Role::Dit, &LEGACY_DIT_NAMES[..]),
        (Role::Encoder, &LEGACY_ENCODER_NAMES[..]),
        (Role::Vae, &LEGACY_VAE_NAMES[..]),
    ] {
        for name in names {
            if let Some(module) = pipeline.child(pipeline.root(), name) {
                components.push(DiscoveredComponent {
                    role,
                    path: (*name).to_owned(),
                    module,
                });
            }
        }
    }
    Discovery {
        source: DiscoverySource::LegacyScan,
        components,
        warnings: vec![PlanWarning::LegacyScan {
            pipeline_type: pipeline.type_name().to_owned(),
        }],
    }
}

/// Remembers which keys were already warned about; shared by every thread
/// that enables a backend.
#[derive(Debug, Default)]
pub(crate) struct WarnOnce(Mutex<BTreeSet<String>>);

impl WarnOnce {
    /// Whether this is the first time `key` is seen (then it is recorded).
    pub(crate) fn first(&self, key: &str) -> bool {
        lock(&self.0).insert(key.to_owned())
    }
}

static LEGACY_WARNED: OnceLock<WarnOnce> = OnceLock::new();

/// Logs `warnings` at `warn` level. The legacy-scan warning is logged once
/// per pipeline type per process; returns the warnings actually logged.
pub fn log_warnings(warnings: &[PlanWarning]) -> Vec<&PlanWarning> {
    let mut logged = Vec::new();
    for w in warnings {
        if let PlanWarning::LegacyScan { pipeline_type } = w
            && !LEGACY_WARNED
                .get_or_init(WarnOnce::default)
                .first(pipeline_type)
        {
            continue;
        }
        tracing::warn!("{w}");
        logged.push(w);
    }
    logged
}

#[cfg(loom)]
mod loom_models {
    use super::WarnOnce;
    use loom::sync::Arc;

    /// Two threads enable backends of the same legacy pipeline type at once:
    /// exactly one of them logs the legacy-scan warning.
    #[test]
    fn legacy_warning_is_logged_exactly_once() {
        loom::model(|| {
            let once = Arc::new(WarnOnce::default());
            let other = Arc::clone(&once);
            let t = loom::thread::spawn(move || other.first("FluxPipeline"));
            let here = once.first("FluxPipeline");
            let there = t.join().unwrap();
            assert!(here ^ there, "exactly one first: {here} {there}");
            assert!(!once.first("FluxPipeline"));
        });
    }
}
