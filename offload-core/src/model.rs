//! The model description: a pipeline tree of modules with dotted paths, the
//! tensors they hold, the storages those tensors view, and a builder.
//!
//! Rust has no `nn.Module`, so the runtime author describes their pipeline
//! once with [`PipelineBuilder`]. Tensors are views (dtype, shape, strides
//! and offset in elements) into a [`Storage`]; two tensors that share a
//! storage are aliases (tied weights) and are moved as one storage.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::ops::Range;

use serde::{Deserialize, Serialize};

use crate::declaration::ComponentDeclaration;
use crate::request::{RequestShape, RequestShapeError};
use crate::schema::OffloadPlan;

/// Element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DType {
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// IEEE single.
    F32,
    /// IEEE double.
    F64,
    /// fp8 with 4 exponent and 3 mantissa bits.
    F8E4M3,
    /// fp8 with 5 exponent and 2 mantissa bits.
    F8E5M2,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// Unsigned byte.
    U8,
    /// Boolean, one byte.
    Bool,
}

impl DType {
    /// Bytes per element.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::Bf16 | DType::F16 => 2,
            DType::F8E4M3 | DType::F8E5M2 | DType::U8 | DType::Bool => 1,
        }
    }

    /// Every dtype, for tests and generators.
    pub const ALL: [DType; 10] = [
        DType::Bf16,
        DType::F16,
        DType::F32,
        DType::F64,
        DType::F8E4M3,
        DType::F8E5M2,
        DType::I64,
        DType::I32,
        DType::U8,
        DType::Bool,
    ];
}

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub(crate) u32);

        impl $name {
            /// The index of this id in its pipeline's table.
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }
    };
}

id_type!(
    /// A module of one [`Pipeline`].
    ModuleId
);
id_type!(
    /// A tensor of one [`Pipeline`].
    TensorId
);
id_type!(
    /// A storage of one [`Pipeline`]; aliased tensors share one.
    StorageId
);

impl fmt::Display for StorageId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "storage#{}", self.0)
    }
}

/// Parameter or buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorKind {
    /// A learned weight.
    Parameter,
    /// A buffer: persistent (in the checkpoint) or not (computed at build
    /// time, e.g. rotary tables).
    Buffer {
        /// Whether the checkpoint holds it.
        persistent: bool,
    },
}

/// A named tensor of a module: a strided view into a storage.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Tensor {
    /// Name within its module (one path segment).
    pub name: String,
    /// The module holding it.
    pub module: ModuleId,
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Element type.
    pub dtype: DType,
    /// Shape, in elements.
    pub shape: Vec<u64>,
    /// Strides, in elements, one per dimension.
    pub strides: Vec<u64>,
    /// Offset of element 0 in the storage, in elements of `dtype`.
    pub storage_offset: u64,
    /// The storage it views.
    pub storage: StorageId,
}

impl Tensor {
    /// Number of elements.
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }

    /// The bytes of the storage this view touches (empty for zero elements).
    pub fn span_bytes(&self) -> Range<u64> {
        view_span_bytes(self.dtype, &self.shape, &self.strides, self.storage_offset)
    }
}

fn view_span_bytes(dtype: DType, shape: &[u64], strides: &[u64], offset: u64) -> Range<u64> {
    let size = dtype.size_bytes();
    let start = offset.saturating_mul(size);
    if shape.contains(&0) {
        return start..start;
    }
    let last = shape
        .iter()
        .zip(strides)
        .map(|(d, s)| (d - 1).saturating_mul(*s))
        .fold(0u64, u64::saturating_add);
    start..start.saturating_add(last.saturating_add(1).saturating_mul(size))
}

fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(shape[i + 1].max(1));
    }
    strides
}

/// Untyped bytes that one or more tensors view.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Storage {
    /// Exact size in bytes.
    pub bytes: u64,
}

/// A plain module or a module list (whose children are named `0`, `1`, …).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ModuleKind {
    /// A module with named children.
    Module,
    /// A module list with indexed children.
    List,
}

/// One node of the pipeline tree.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Module {
    /// Name within its parent (`""` for the root).
    pub name: String,
    /// Full dotted path (`""` for the root).
    pub path: String,
    /// Parent module, `None` for the root.
    pub parent: Option<ModuleId>,
    /// Plain module or list.
    pub kind: ModuleKind,
    /// Children in declaration (list: index) order.
    pub children: Vec<ModuleId>,
    /// Tensors held directly by this module.
    pub tensors: Vec<TensorId>,
    /// The module lists holding this module's blocks, in forward order,
    /// relative paths ([`ModuleBuilder::block_containers`]).
    pub block_containers: Option<Vec<String>>,
    /// The deprecated single block container
    /// ([`ModuleBuilder::deprecated_block_container`]); used only when no
    /// list is declared, with a warning.
    pub deprecated_block_container: Option<String>,
}

/// A diffusion pipeline described as data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pipeline {
    type_name: String,
    modules: Vec<Module>,
    tensors: Vec<Tensor>,
    storages: Vec<Storage>,
    by_path: BTreeMap<String, ModuleId>,
    declaration: Option<ComponentDeclaration>,
    plan: Option<OffloadPlan>,
    warmup: Option<RequestShape>,
}

impl Pipeline {
    /// The pipeline's type name (used, e.g., to warn once per type).
    pub fn type_name(&self) -> &str {
        &self.type_name
    }

    /// The root module (path `""`).
    pub fn root(&self) -> ModuleId {
        ModuleId(0)
    }

    /// A module by id.
    pub fn module(&self, id: ModuleId) -> &Module {
        &self.modules[id.index()]
    }

    /// A module by dotted path.
    pub fn module_id(&self, path: &str) -> Option<ModuleId> {
        self.by_path.get(path).copied()
    }

    /// A direct child of `parent` by name.
    pub fn child(&self, parent: ModuleId, name: &str) -> Option<ModuleId> {
        let path = join(&self.module(parent).path, name);
        self.module_id(&path)
    }

    /// A tensor by its full dotted path: a lookup of its module, then of
    /// the module's own tensors (no scan of the pipeline).
    pub fn tensor_id(&self, path: &str) -> Option<TensorId> {
        let (module, name) = match path.rsplit_once('.') {
            Some((m, n)) => (self.module_id(m)?, n),
            None => (self.root(), path),
        };
        self.module(module)
            .tensors
            .iter()
            .copied()
            .find(|t| self.tensor(*t).name == name)
    }

    /// A tensor of the module `module` by its dotted path relative to it.
    pub fn tensor_in(&self, module: ModuleId, name: &str) -> Option<TensorId> {
        let (owner, name) = match name.rsplit_once('.') {
            Some((m, n)) => (self.module_id(&join(&self.module(module).path, m))?, n),
            None => (module, name),
        };
        self.module(owner)
            .tensors
            .iter()
            .copied()
            .find(|t| self.tensor(*t).name == name)
    }

    /// The path of `id` relative to its ancestor `ancestor` (`""` for
    /// itself), borrowed from the description.
    pub fn relative_path(&self, id: ModuleId, ancestor: ModuleId) -> Option<&str> {
        if !self.is_within(id, ancestor) {
            return None;
        }
        let path = self.module(id).path.as_str();
        let base = self.module(ancestor).path.as_str();
        Some(match base.len() {
            0 => path,
            n if path.len() == n => "",
            n => &path[n + 1..],
        })
    }

    /// Every module, root first, in creation order.
    pub fn modules(&self) -> impl Iterator<Item = (ModuleId, &Module)> {
        self.modules
            .iter()
            .enumerate()
            .map(|(i, m)| (ModuleId(i as u32), m))
    }

    /// A tensor by id.
    pub fn tensor(&self, id: TensorId) -> &Tensor {
        &self.tensors[id.index()]
    }

    /// Every tensor.
    pub fn tensors(&self) -> impl Iterator<Item = (TensorId, &Tensor)> {
        self.tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (TensorId(i as u32), t))
    }

    /// A storage by id.
    pub fn storage(&self, id: StorageId) -> &Storage {
        &self.storages[id.index()]
    }

    /// Every storage.
    pub fn storages(&self) -> impl Iterator<Item = (StorageId, &Storage)> {
        self.storages
            .iter()
            .enumerate()
            .map(|(i, s)| (StorageId(i as u32), s))
    }

    /// The full dotted path of a tensor.
    pub fn tensor_path(&self, id: TensorId) -> String {
        let t = self.tensor(id);
        join(&self.module(t.module).path, &t.name)
    }

    /// The components the pipeline declares, if it declares them.
    pub fn declaration(&self) -> Option<&ComponentDeclaration> {
        self.declaration.as_ref()
    }

    /// The pipeline's offload plan, if it has one.
    pub fn offload_plan(&self) -> Option<&OffloadPlan> {
        self.plan.as_ref()
    }

    /// The request the pipeline's warm-up recipe declares (CONTRACT §9):
    /// its largest shape, which a planned backend's warm-up runs.
    pub fn warmup_request(&self) -> Option<&RequestShape> {
        self.warmup.as_ref()
    }

    /// Whether `ancestor` is `id` or one of its ancestors.
    pub fn is_within(&self, id: ModuleId, ancestor: ModuleId) -> bool {
        let mut cur = Some(id);
        while let Some(c) = cur {
            if c == ancestor {
                return true;
            }
            cur = self.module(c).parent;
        }
        false
    }

    /// Every module of the subtree rooted at `id`, `id` first, depth first.
    pub fn subtree(&self, id: ModuleId) -> Vec<ModuleId> {
        let mut out = Vec::new();
        let mut stack = vec![id];
        while let Some(m) = stack.pop() {
            out.push(m);
            stack.extend(self.module(m).children.iter().rev());
        }
        out
    }

    /// Every tensor of the subtree rooted at `id`.
    pub fn subtree_tensors(&self, id: ModuleId) -> Vec<TensorId> {
        self.subtree(id)
            .into_iter()
            .flat_map(|m| self.module(m).tensors.iter().copied())
            .collect()
    }

    /// The distinct storages of the subtree rooted at `id`.
    pub fn subtree_storages(&self, id: ModuleId) -> BTreeSet<StorageId> {
        self.subtree_tensors(id)
            .into_iter()
            .map(|t| self.tensor(t).storage)
            .collect()
    }

    /// Bytes of the distinct storages of the subtree rooted at `id`.
    pub fn subtree_bytes(&self, id: ModuleId) -> u64 {
        self.subtree_storages(id)
            .into_iter()
            .map(|s| self.storage(s).bytes)
            .sum()
    }

    /// Whether the subtree rooted at `id` holds any parameter.
    pub fn has_parameters(&self, id: ModuleId) -> bool {
        self.subtree_tensors(id)
            .into_iter()
            .any(|t| self.tensor(t).kind == TensorKind::Parameter)
    }
}

pub(crate) fn join(parent: &str, name: &str) -> String {
    if parent.is_empty() {
        name.to_owned()
    } else {
        format!("{parent}.{name}")
    }
}

/// Errors of [`PipelineBuilder::build`]; each names the offending path.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// The warm-up request declared is outside its ranges.
    #[error("warm-up request: {0}")]
    WarmupRequest(#[from] RequestShapeError),
    /// A name or path segment is empty or holds a character not allowed.
    #[error(
        "invalid name `{name}` at `{at}`: a path segment must be non-empty and hold only letters, digits and `_`"
    )]
    InvalidName {
        /// The name given.
        name: String,
        /// Where it was given.
        at: String,
    },
    /// Two tensors, or a tensor and a module, share a path.
    #[error("`{path}` is declared twice")]
    Duplicate {
        /// The path.
        path: String,
    },
    /// A child of a module list is not an index, or a list child was added
    /// out of order.
    #[error("module list `{list}` takes children named 0, 1, 2, … in order; got `{name}`")]
    ListChild {
        /// The list's path.
        list: String,
        /// The child name given.
        name: String,
    },
    /// A shape holds a negative dimension.
    #[error("tensor `{path}` has a negative dimension {dim}; a shape holds sizes ≥ 0")]
    NegativeDim {
        /// The tensor.
        path: String,
        /// The dimension given.
        dim: i64,
    },
    /// Shape and strides differ in length.
    #[error("tensor `{path}` has {shape_dims} shape dimensions but {stride_dims} strides")]
    StrideRank {
        /// The tensor.
        path: String,
        /// Shape length.
        shape_dims: usize,
        /// Strides length.
        stride_dims: usize,
    },
    /// A view reaches past the end of its storage.
    #[error("tensor `{path}` views bytes {needs_end_bytes} of a storage of {storage_bytes} bytes")]
    OutOfStorage {
        /// The tensor.
        path: String,
        /// End of the bytes it touches.
        needs_end_bytes: u64,
        /// The storage's size.
        storage_bytes: u64,
    },
    /// A tensor names as its storage a tensor that does not exist (yet).
    #[error("tensor `{path}` shares the storage of `{target}`, which is not declared before it")]
    AliasTarget {
        /// The tensor.
        path: String,
        /// The missing target path.
        target: String,
    },
}

/// Where a new tensor's storage comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StorageSpec {
    /// A new storage of exactly the bytes the view needs.
    Exact,
    /// A new storage of the given size (may be larger than the view).
    Bytes(u64),
    /// The storage of an already declared tensor (full dotted path): an alias.
    SharedWith(String),
}

/// Everything about a tensor to declare, for the non-contiguous cases.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Parameter or buffer.
    pub kind: TensorKind,
    /// Element type.
    pub dtype: DType,
    /// Shape.
    pub shape: Vec<u64>,
    /// Strides in elements; `None` for contiguous.
    pub strides: Option<Vec<u64>>,
    /// Offset in elements.
    pub storage_offset: u64,
    /// Storage source.
    pub storage: StorageSpec,
}

impl TensorSpec {
    /// A contiguous parameter with its own storage.
    pub fn parameter(dtype: DType, shape: &[u64]) -> Self {
        Self {
            kind: TensorKind::Parameter,
            dtype,
            shape: shape.to_vec(),
            strides: None,
            storage_offset: 0,
            storage: StorageSpec::Exact,
        }
    }

    /// A contiguous buffer with its own storage.
    pub fn buffer(dtype: DType, shape: &[u64], persistent: bool) -> Self {
        Self {
            kind: TensorKind::Buffer { persistent },
            ..Self::parameter(dtype, shape)
        }
    }
}

/// One dimension of a shape, in any integer type a runtime keeps its sizes
/// in (`usize` constants, `u64`, `i64` from a config file…); a negative
/// one is a build error.
pub trait Dim: Copy {
    /// The dimension as a `u64`, or the negative value given.
    fn to_u64(self) -> Result<u64, i64>;
}

macro_rules! dims {
    ($($t:ty),*) => {$(
        impl Dim for $t {
            #[allow(clippy::cast_lossless, irrefutable_let_patterns, unused_comparisons)]
            fn to_u64(self) -> Result<u64, i64> {
                if self < 0 as $t {
                    return Err(self as i64);
                }
                Ok(self as u64)
            }
        }
    )*};
}
dims!(u8, u16, u32, u64, usize, i32, i64);

/// A shape, in elements: a slice, an array or a vector of any [`Dim`]
/// (`&[h, 64]`, `&[N_HEADS * HEAD_DIM]`, `&shape`), so that a shape
/// written with `usize` constants needs no casts.
pub trait Dims {
    /// The dimensions as `u64`s, or the first negative one.
    fn to_dims(&self) -> Result<Vec<u64>, i64>;
}

impl<T: Dim> Dims for [T] {
    fn to_dims(&self) -> Result<Vec<u64>, i64> {
        self.iter().map(|d| d.to_u64()).collect()
    }
}

impl<T: Dim, const N: usize> Dims for [T; N] {
    fn to_dims(&self) -> Result<Vec<u64>, i64> {
        self[..].to_dims()
    }
}

impl<T: Dim> Dims for Vec<T> {
    fn to_dims(&self) -> Result<Vec<u64>, i64> {
        self[..].to_dims()
    }
}

/// Builds a [`Pipeline`]. Mistakes are collected and the first is returned
/// by [`PipelineBuilder::build`], so building code reads straight.
#[derive(Debug)]
pub struct PipelineBuilder {
    p: Pipeline,
    errors: Vec<ModelError>,
}

impl PipelineBuilder {
    /// A builder for a pipeline of type `type_name`.
    pub fn new(type_name: impl Into<String>) -> Self {
        let root = Module {
            name: String::new(),
            path: String::new(),
            parent: None,
            kind: ModuleKind::Module,
            children: Vec::new(),
            tensors: Vec::new(),
            block_containers: None,
            deprecated_block_container: None,
        };
        let mut by_path = BTreeMap::new();
        by_path.insert(String::new(), ModuleId(0));
        Self {
            p: Pipeline {
                type_name: type_name.into(),
                modules: vec![root],
                tensors: Vec::new(),
                storages: Vec::new(),
                by_path,
                declaration: None,
                plan: None,
                warmup: None,
            },
            errors: Vec::new(),
        }
    }

    /// The root module, to add children and tensors to.
    pub fn root(&mut self) -> ModuleBuilder<'_> {
        ModuleBuilder {
            b: self,
            id: ModuleId(0),
        }
    }

    /// The module at dotted `path`, created (with any missing ancestors) if
    /// needed.
    pub fn module(&mut self, path: &str) -> ModuleBuilder<'_> {
        let id = self.ensure_path(ModuleId(0), path, ModuleKind::Module);
        ModuleBuilder { b: self, id }
    }

    /// Declares the pipeline's components (explicit discovery).
    pub fn declare_components(&mut self, declaration: ComponentDeclaration) -> &mut Self {
        self.p.declaration = Some(declaration);
        self
    }

    /// Attaches an offload plan.
    pub fn offload_plan(&mut self, plan: OffloadPlan) -> &mut Self {
        self.p.plan = Some(plan);
        self
    }

    /// Declares the pipeline's warm-up request (CONTRACT §9): its largest
    /// shape (tokens, batch, resolution, frames), the denoising steps of a
    /// request, and how many of them the warm-up runs. A shape outside its
    /// ranges is a build error.
    pub fn warmup_request(&mut self, shape: RequestShape) -> &mut Self {
        if let Err(e) = shape.validate() {
            self.errors.push(ModelError::WarmupRequest(e));
        }
        self.p.warmup = Some(shape);
        self
    }

    /// The pipeline, or the first mistake made while building it.
    pub fn build(self) -> Result<Pipeline, ModelError> {
        match self.errors.into_iter().next() {
            Some(e) => Err(e),
            None => Ok(self.p),
        }
    }

    fn ensure_path(&mut self, from: ModuleId, path: &str, last_kind: ModuleKind) -> ModuleId {
        let mut cur = from;
        let segments: Vec<&str> = path.split('.').collect();
        if path.is_empty() {
            return cur;
        }
        for (i, seg) in segments.iter().enumerate() {
            let kind = if i + 1 == segments.len() {
                last_kind
            } else {
                ModuleKind::Module
            };
            cur = self.ensure_child(cur, seg, kind);
        }
        cur
    }

    fn ensure_child(&mut self, parent: ModuleId, name: &str, kind: ModuleKind) -> ModuleId {
        let parent_path = self.p.module(parent).path.clone();
        let path = join(&parent_path, name);
        if let Some(id) = self.p.module_id(&path) {
            return id;
        }
        if !valid_segment(name) {
            self.errors.push(ModelError::InvalidName {
                name: name.to_owned(),
                at: parent_path,
            });
        } else if self.p.module(parent).kind == ModuleKind::List
            && name != self.p.module(parent).children.len().to_string()
        {
            self.errors.push(ModelError::ListChild {
                list: parent_path,
                name: name.to_owned(),
            });
        } else if self.tensor_at(parent, name).is_some() {
            self.errors
                .push(ModelError::Duplicate { path: path.clone() });
        }
        let id = ModuleId(self.p.modules.len() as u32);
        self.p.modules.push(Module {
            name: name.to_owned(),
            path: path.clone(),
            parent: Some(parent),
            kind,
            children: Vec::new(),
            tensors: Vec::new(),
            block_containers: None,
            deprecated_block_container: None,
        });
        self.p.modules[parent.index()].children.push(id);
        self.p.by_path.insert(path, id);
        id
    }

    fn tensor_at(&self, module: ModuleId, name: &str) -> Option<TensorId> {
        self.p
            .module(module)
            .tensors
            .iter()
            .copied()
            .find(|t| self.p.tensor(*t).name == name)
    }

    fn tensor_by_path(&self, path: &str) -> Option<TensorId> {
        self.p.tensor_id(path)
    }

    fn add_tensor(&mut self, module: ModuleId, dotted: &str, spec: TensorSpec) {
        let (owner, name) = match dotted.rsplit_once('.') {
            Some((m, n)) => (self.ensure_path(module, m, ModuleKind::Module), n),
            None => (module, dotted),
        };
        let path = join(&self.p.module(owner).path, name);
        if !valid_segment(name) {
            self.errors.push(ModelError::InvalidName {
                name: name.to_owned(),
                at: self.p.module(owner).path.clone(),
            });
            return;
        }
        if self.tensor_at(owner, name).is_some() || self.p.module_id(&path).is_some() {
            self.errors.push(ModelError::Duplicate { path });
            return;
        }
        let strides = spec
            .strides
            .clone()
            .unwrap_or_else(|| contiguous_strides(&spec.shape));
        if strides.len() != spec.shape.len() {
            self.errors.push(ModelError::StrideRank {
                path,
                shape_dims: spec.shape.len(),
                stride_dims: strides.len(),
            });
            return;
        }
        let span = view_span_bytes(spec.dtype, &spec.shape, &strides, spec.storage_offset);
        let storage = match &spec.storage {
            StorageSpec::Exact => self.new_storage(span.end),
            StorageSpec::Bytes(bytes) => self.new_storage(*bytes),
            StorageSpec::SharedWith(target) => match self.tensor_by_path(target) {
                Some(t) => self.p.tensor(t).storage,
                None => {
                    self.errors.push(ModelError::AliasTarget {
                        path,
                        target: target.clone(),
                    });
                    return;
                }
            },
        };
        let storage_bytes = self.p.storage(storage).bytes;
        if span.end > storage_bytes {
            self.errors.push(ModelError::OutOfStorage {
                path,
                needs_end_bytes: span.end,
                storage_bytes,
            });
            return;
        }
        let id = TensorId(self.p.tensors.len() as u32);
        self.p.tensors.push(Tensor {
            name: name.to_owned(),
            module: owner,
            kind: spec.kind,
            dtype: spec.dtype,
            shape: spec.shape,
            strides,
            storage_offset: spec.storage_offset,
            storage,
        });
        self.p.modules[owner.index()].tensors.push(id);
    }

    fn new_storage(&mut self, bytes: u64) -> StorageId {
        let id = StorageId(self.p.storages.len() as u32);
        self.p.storages.push(Storage { bytes });
        id
    }
}

fn valid_segment(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Adds children and tensors to one module of a [`PipelineBuilder`].
#[derive(Debug)]
pub struct ModuleBuilder<'a> {
    b: &'a mut PipelineBuilder,
    id: ModuleId,
}

impl ModuleBuilder<'_> {
    /// The module being built.
    pub fn id(&self) -> ModuleId {
        self.id
    }

    /// Adds a contiguous parameter; a dotted `name` creates submodules.
    /// `shape` is any slice, array or vector of integers ([`Dims`]).
    pub fn parameter(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &(impl Dims + ?Sized),
    ) -> &mut Self {
        match self.dims(name, shape) {
            Some(shape) => self.tensor(name, TensorSpec::parameter(dtype, &shape)),
            None => self,
        }
    }

    /// Adds a contiguous buffer; a dotted `name` creates submodules.
    pub fn buffer(
        &mut self,
        name: &str,
        dtype: DType,
        shape: &(impl Dims + ?Sized),
        persistent: bool,
    ) -> &mut Self {
        match self.dims(name, shape) {
            Some(shape) => self.tensor(name, TensorSpec::buffer(dtype, &shape, persistent)),
            None => self,
        }
    }

    /// `shape` as `u64`s, or `None` with a build error for a negative one.
    fn dims(&mut self, name: &str, shape: &(impl Dims + ?Sized)) -> Option<Vec<u64>> {
        match shape.to_dims() {
            Ok(dims) => Some(dims),
            Err(negative) => {
                let path = join(&self.b.p.module(self.id).path, name);
                self.b.errors.push(ModelError::NegativeDim {
                    path,
                    dim: negative,
                });
                None
            }
        }
    }

    /// Adds a tensor described in full.
    pub fn tensor(&mut self, name: &str, spec: TensorSpec) -> &mut Self {
        self.b.add_tensor(self.id, name, spec);
        self
    }

    /// Adds `name` as a tied alias of the already declared tensor at the
    /// full dotted path `target`: same storage, dtype, shape and strides.
    pub fn tie(&mut self, name: &str, target: &str) -> &mut Self {
        let spec = match self.b.tensor_by_path(target) {
            Some(t) => {
                let t = self.b.p.tensor(t);
                TensorSpec {
                    kind: t.kind,
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    strides: Some(t.strides.clone()),
                    storage_offset: t.storage_offset,
                    storage: StorageSpec::SharedWith(target.to_owned()),
                }
            }
            None => TensorSpec {
                storage: StorageSpec::SharedWith(target.to_owned()),
                ..TensorSpec::parameter(DType::U8, &[])
            },
        };
        self.tensor(name, spec)
    }

    /// A (possibly new) child module; a dotted `name` creates a chain.
    pub fn child(&mut self, name: &str) -> ModuleBuilder<'_> {
        let id = self.b.ensure_path(self.id, name, ModuleKind::Module);
        ModuleBuilder { b: self.b, id }
    }

    /// A module list `name` of `len` children, each built by `build(i, child)`.
    pub fn list(
        &mut self,
        name: &str,
        len: usize,
        mut build: impl FnMut(usize, &mut ModuleBuilder<'_>),
    ) -> &mut Self {
        let list = self.b.ensure_path(self.id, name, ModuleKind::List);
        for i in 0..len {
            let child = self
                .b
                .ensure_child(list, &i.to_string(), ModuleKind::Module);
            build(
                i,
                &mut ModuleBuilder {
                    b: self.b,
                    id: child,
                },
            );
        }
        self
    }

    /// Names this module's block containers, in forward order: the module
    /// lists (relative paths, built with [`Self::list`]) whose entries are
    /// its repeated transformer blocks, e.g. `["transformer_blocks",
    /// "single_transformer_blocks"]` for Flux. Their concatenation is the
    /// block stack layerwise offload streams through a ring of device
    /// slots and the planner may stream; without it the component has no
    /// blocks (layerwise offload of it is an error at resolve that says to
    /// call this).
    pub fn block_containers(&mut self, names: &[&str]) -> &mut Self {
        self.b.p.modules[self.id.index()].block_containers =
            Some(names.iter().map(|s| (*s).to_owned()).collect());
        self
    }

    /// Names a single block container, the deprecated way (resolution
    /// warns): use [`Self::block_containers`].
    pub fn deprecated_block_container(&mut self, name: &str) -> &mut Self {
        self.b.p.modules[self.id.index()].deprecated_block_container = Some(name.to_owned());
        self
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = serde_json::to_value(self).map_err(|_| fmt::Error)?;
        f.write_str(s.as_str().unwrap_or("?"))
    }
}
