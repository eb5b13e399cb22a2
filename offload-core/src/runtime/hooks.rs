//! A pipeline being run: its description and the hooks on its modules
//! ([`Model`]), and what every hook of a forward sees ([`ForwardCtx`]).

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;

use offload_hooks::HookRegistry;

use crate::model::{ModuleId, Pipeline};

/// What every hook of a forward sees.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardCtx {
    /// The module whose forward runs.
    pub module: ModuleId,
}

/// The hooks of every module.
pub type HookMap = BTreeMap<ModuleId, RefCell<HookRegistry<ForwardCtx>>>;

/// A pipeline being run: its description and the hooks installed on its
/// modules. Backends install and remove their hooks here.
pub struct Model {
    /// The description.
    pub pipeline: Pipeline,
    /// Hooks per module.
    pub hooks: HookMap,
}

impl fmt::Debug for Model {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Model")
            .field("pipeline", &self.pipeline.type_name())
            .field("hooks", &self.hook_claims())
            .finish()
    }
}

impl Model {
    /// A model with no hooks.
    pub fn new(pipeline: Pipeline) -> Self {
        Self {
            pipeline,
            hooks: BTreeMap::new(),
        }
    }

    /// Every installed hook as (module path, hook name, owner), sorted: the
    /// observable hook state (INV-1, INV-5).
    pub fn hook_claims(&self) -> Vec<(String, String, String)> {
        let mut out = Vec::new();
        for (module, registry) in &self.hooks {
            let path = self.pipeline.module(*module).path.clone();
            for (name, owner) in registry.borrow().owners() {
                out.push((path.clone(), name.to_owned(), owner.as_str().to_owned()));
            }
        }
        out
    }

    /// The registry of `module`, created empty if needed.
    pub fn hooks_of(&mut self, module: ModuleId) -> &mut HookRegistry<ForwardCtx> {
        self.hooks.entry(module).or_default().get_mut()
    }
}
