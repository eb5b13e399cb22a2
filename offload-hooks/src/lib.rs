//! Named pre/post-forward hooks around one module (CONTRACT §4).
//!
//! A [`HookRegistry`] belongs to one module. It holds named [`ModelHook`]s,
//! each registered by a [`HookOwner`]. One forward of the module is a
//! [`HookRegistry::dispatch`]:
//!
//! 1. every hook's [`ModelHook::pre_forward`] in name order (byte order of
//!    the names);
//! 2. the module's forward, or the forward of the single hook that overrides
//!    it (at most one may: registering a second is an error);
//! 3. every [`ModelHook::post_forward`] in reverse name order.
//!
//! Dispatch behaves like a stack: a hook's `post_forward` runs exactly when
//! its `pre_forward` ran, whatever happened in between. A cache-style hook
//! may answer [`PreForward::Skip`]: the remaining `pre_forward`s and the
//! forward do not run, and the hooks that already ran are told
//! [`Forwarded::Skipped`] in their `post_forward`.
//!
//! Ownership: registering under an existing name replaces the hook (with a
//! warning) only when the same owner asks; removal is only by the owner. A
//! hook never owns module memory: it sees the module only through the
//! context passed to each call.

use std::collections::BTreeMap;
use std::error::Error as StdError;
use std::fmt;

/// Boxed error a hook or a forward returns.
pub type BoxError = Box<dyn StdError + Send + Sync + 'static>;

/// Who registered a hook. Only the owner may replace or remove it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HookOwner(String);

impl HookOwner {
    /// An owner identified by `name` (for offload backends, their hook name).
    pub fn new(name: impl Into<String>) -> Self {
        Self(name.into())
    }

    /// The owner's name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for HookOwner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a hook's `pre_forward` asks dispatch to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreForward {
    /// Run the remaining pre-forwards and the forward.
    Continue,
    /// Skip the remaining pre-forwards and the forward (a cache hit).
    Skip,
}

/// What happened to the forward, as told to every `post_forward`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Forwarded {
    /// The forward (the module's or the override's) ran and succeeded.
    Ran,
    /// The hook of this name answered [`PreForward::Skip`].
    Skipped {
        /// Name of the skipping hook.
        by: String,
    },
    /// A pre-forward or the forward failed; dispatch returns that error.
    Failed,
}

/// The phase of dispatch in which an error arose.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// A hook's `pre_forward`.
    PreForward,
    /// The module's forward or the overriding hook's forward.
    Forward,
    /// A hook's `post_forward`.
    PostForward,
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Phase::PreForward => "pre_forward",
            Phase::Forward => "forward",
            Phase::PostForward => "post_forward",
        })
    }
}

/// The name [`HookError::Failed`] gives the module's own forward (the
/// closure a dispatch runs), as opposed to a hook's.
pub const MODULE_FORWARD: &str = "forward";

/// Every error of the registry, naming the hook and the rule broken.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// A second hook that overrides forward was registered.
    #[error(
        "hook `{name}` overrides forward, but hook `{existing}` already does: at most one hook per module may override forward"
    )]
    SecondForwardOverride {
        /// The hook being registered.
        name: String,
        /// The hook that already overrides forward.
        existing: String,
    },
    /// A hook name is held by another owner.
    #[error("hook `{name}` is owned by `{owner}`; `{requested_by}` may not replace or remove it")]
    NotOwner {
        /// The hook name.
        name: String,
        /// Its owner.
        owner: HookOwner,
        /// Who asked.
        requested_by: HookOwner,
    },
    /// No hook of this name is registered.
    #[error("no hook named `{name}` is registered (registered: {registered:?})")]
    NotFound {
        /// The name asked for.
        name: String,
        /// The names that are registered.
        registered: Vec<String>,
    },
    /// A hook or the forward failed.
    #[error("{phase} of `{name}` failed: {source}")]
    Failed {
        /// The hook's name, or `forward` for the module's own forward.
        name: String,
        /// Where it failed.
        phase: Phase,
        /// The error it returned.
        #[source]
        source: BoxError,
    },
}

/// Behaviour attached to a module by name. `C` is the context the runtime
/// passes to one forward (for offload: the module's path, the streams, the
/// device views).
pub trait ModelHook<C: ?Sized>: Send {
    /// Runs before the forward, in name order.
    fn pre_forward(&mut self, ctx: &mut C) -> Result<PreForward, BoxError> {
        let _ = ctx;
        Ok(PreForward::Continue)
    }

    /// Runs after the forward (or after a skip or failure), in reverse name
    /// order, exactly when this hook's `pre_forward` ran.
    fn post_forward(&mut self, ctx: &mut C, forwarded: &Forwarded) -> Result<(), BoxError> {
        let _ = (ctx, forwarded);
        Ok(())
    }

    /// Whether this hook replaces the module's forward. Read once, at
    /// registration.
    fn overrides_forward(&self) -> bool {
        false
    }

    /// The replacement forward; called only when [`Self::overrides_forward`]
    /// answered `true` at registration.
    fn forward(&mut self, ctx: &mut C) -> Result<(), BoxError> {
        let _ = ctx;
        Err("this hook does not override forward".into())
    }
}

/// What [`HookRegistry::register`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Registered {
    /// The name was free.
    New,
    /// The owner's earlier hook of this name was replaced (a warning was
    /// logged).
    Replaced,
}

struct Entry<C: ?Sized> {
    owner: HookOwner,
    overrides_forward: bool,
    hook: Box<dyn ModelHook<C>>,
}

/// The hooks of one module.
pub struct HookRegistry<C: ?Sized> {
    hooks: BTreeMap<String, Entry<C>>,
}

impl<C: ?Sized> Default for HookRegistry<C> {
    fn default() -> Self {
        Self {
            hooks: BTreeMap::new(),
        }
    }
}

impl<C: ?Sized> fmt::Debug for HookRegistry<C> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map()
            .entries(self.hooks.iter().map(|(n, e)| (n, &e.owner)))
            .finish()
    }
}

impl<C: ?Sized> HookRegistry<C> {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `hook` under `name` for `owner`.
    ///
    /// Replaces the owner's earlier hook of that name with a warning. Fails
    /// when another owner holds the name, or when `hook` overrides forward
    /// and a hook of another name already does; then nothing changes.
    pub fn register(
        &mut self,
        name: impl Into<String>,
        owner: HookOwner,
        hook: Box<dyn ModelHook<C>>,
    ) -> Result<Registered, HookError> {
        let name = name.into();
        if let Some(existing) = self.hooks.get(&name)
            && existing.owner != owner
        {
            return Err(HookError::NotOwner {
                name,
                owner: existing.owner.clone(),
                requested_by: owner,
            });
        }
        let overrides_forward = hook.overrides_forward();
        if overrides_forward
            && let Some(existing) = self.forward_override()
            && existing != name
        {
            return Err(HookError::SecondForwardOverride {
                name,
                existing: existing.to_owned(),
            });
        }
        let entry = Entry {
            owner,
            overrides_forward,
            hook,
        };
        match self.hooks.insert(name.clone(), entry) {
            None => Ok(Registered::New),
            Some(_) => {
                tracing::warn!(hook = %name, "hook re-registered: the earlier hook of this name was replaced");
                Ok(Registered::Replaced)
            }
        }
    }

    /// Removes and returns the hook `name`, if `owner` owns it.
    pub fn remove(
        &mut self,
        name: &str,
        owner: &HookOwner,
    ) -> Result<Box<dyn ModelHook<C>>, HookError> {
        match self.hooks.get(name) {
            None => Err(HookError::NotFound {
                name: name.to_owned(),
                registered: self.names().map(str::to_owned).collect(),
            }),
            Some(e) if &e.owner != owner => Err(HookError::NotOwner {
                name: name.to_owned(),
                owner: e.owner.clone(),
                requested_by: owner.clone(),
            }),
            Some(_) => Ok(self
                .hooks
                .remove(name)
                .map(|e| e.hook)
                .expect("checked present above")),
        }
    }

    /// Removes every hook `owner` registered; returns how many.
    pub fn remove_owned_by(&mut self, owner: &HookOwner) -> usize {
        let before = self.hooks.len();
        self.hooks.retain(|_, e| &e.owner != owner);
        before - self.hooks.len()
    }

    /// Registered names, in dispatch (name) order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.hooks.keys().map(String::as_str)
    }

    /// The owner of hook `name`.
    pub fn owner_of(&self, name: &str) -> Option<&HookOwner> {
        self.hooks.get(name).map(|e| &e.owner)
    }

    /// Every `(name, owner)` pair, in name order.
    pub fn owners(&self) -> impl Iterator<Item = (&str, &HookOwner)> {
        self.hooks.iter().map(|(n, e)| (n.as_str(), &e.owner))
    }

    /// The name of the hook that overrides forward, if any.
    pub fn forward_override(&self) -> Option<&str> {
        self.hooks
            .iter()
            .find(|(_, e)| e.overrides_forward)
            .map(|(n, _)| n.as_str())
    }

    /// Number of hooks.
    pub fn len(&self) -> usize {
        self.hooks.len()
    }

    /// Whether no hook is registered.
    pub fn is_empty(&self) -> bool {
        self.hooks.is_empty()
    }

    /// Runs one forward of the module: pre-forwards in name order, the
    /// forward (`module_forward`, or the overriding hook's), post-forwards in
    /// reverse order for every hook whose pre-forward ran.
    ///
    /// Returns what happened to the forward. The first error (of a
    /// pre-forward, the forward, or a post-forward) is returned after every
    /// due post-forward has run.
    pub fn dispatch<F>(&mut self, ctx: &mut C, module_forward: F) -> Result<Forwarded, HookError>
    where
        F: FnOnce(&mut C) -> Result<(), BoxError>,
    {
        let mut entries: Vec<(&String, &mut Entry<C>)> = self.hooks.iter_mut().collect();
        let mut ran = 0;
        let mut first_error: Option<HookError> = None;
        let mut forwarded = Forwarded::Ran;

        for (name, entry) in entries.iter_mut() {
            ran += 1;
            match entry.hook.pre_forward(ctx) {
                Ok(PreForward::Continue) => {}
                Ok(PreForward::Skip) => {
                    forwarded = Forwarded::Skipped {
                        by: (*name).clone(),
                    };
                    break;
                }
                Err(source) => {
                    first_error = Some(HookError::Failed {
                        name: (*name).clone(),
                        phase: Phase::PreForward,
                        source,
                    });
                    forwarded = Forwarded::Failed;
                    break;
                }
            }
        }

        if forwarded == Forwarded::Ran {
            let result = match entries.iter_mut().find(|(_, e)| e.overrides_forward) {
                Some((name, entry)) => entry
                    .hook
                    .forward(ctx)
                    .map_err(|source| forward_failed(name, source)),
                None => {
                    module_forward(ctx).map_err(|source| forward_failed(MODULE_FORWARD, source))
                }
            };
            if let Err(e) = result {
                first_error = Some(e);
                forwarded = Forwarded::Failed;
            }
        }

        for (name, entry) in entries[..ran].iter_mut().rev() {
            if let Err(source) = entry.hook.post_forward(ctx, &forwarded) {
                first_error.get_or_insert(HookError::Failed {
                    name: (*name).clone(),
                    phase: Phase::PostForward,
                    source,
                });
            }
        }

        match first_error {
            Some(e) => Err(e),
            None => Ok(forwarded),
        }
    }
}

fn forward_failed(name: &str, source: BoxError) -> HookError {
    HookError::Failed {
        name: name.to_owned(),
        phase: Phase::Forward,
        source,
    }
}
