//! A [`Platform`] over any device: builds the core strategies for the
//! configuration's selection. Backends (`offload-sim`, `offload-cuda`) hand
//! it their device, compute stream and weight source.

use crate::sync::Arc;

use crate::config::{OffloadStrategy, ParallelConfig};
use crate::device::{Api, Codec, Collective};
use crate::lifecycle::{BackendRequest, DeviceSpec, OffloadError, Platform, get_offload_backend};
use crate::runtime::backend::{Backend, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::layerwise::LayerwiseBackend;
use crate::runtime::model_level::ModelLevelBackend;
use crate::runtime::planned::PlannedBackend;
use crate::runtime::resident::ResidentBackend;

/// Builds core backends on one device.
pub struct CorePlatform<A: Api> {
    name: String,
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    weights: Arc<dyn WeightSource>,
    prefetch_depth: usize,
    planner: Option<crate::budget::PlannerInputs>,
    request: Option<crate::request::RequestShape>,
    collective: Option<Arc<dyn Collective<A>>>,
    codec: Option<Arc<dyn Codec<A>>>,
    bugs: Vec<PlantedBug>,
}

impl<A: Api> CorePlatform<A> {
    /// A platform named `name` on `device`.
    pub fn new(
        name: impl Into<String>,
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
    ) -> Self {
        Self {
            name: name.into(),
            device,
            compute,
            weights,
            prefetch_depth: 1,
            planner: None,
            request: None,
            collective: None,
            codec: None,
            bugs: Vec::new(),
        }
    }

    /// Plants `bugs` in every backend this platform builds, so that a test
    /// can see the invariant checkers catch them (test-only switch).
    #[cfg(feature = "planted-bugs")]
    #[doc(hidden)]
    pub fn with_planted_bugs(mut self, bugs: &[PlantedBug]) -> Self {
        self.bugs = bugs.to_vec();
        self
    }

    fn bugs(&self) -> Bugs {
        Bugs::new(&self.bugs)
    }

    /// Blocks the layerwise strategy keeps in flight (default 1).
    pub fn with_prefetch_depth(mut self, depth: usize) -> Self {
        self.prefetch_depth = depth.max(1);
        self
    }

    /// What the request planner plans a `device_budget` from, given
    /// instead of measured: a caller's [`crate::budget::PlannerInputs`],
    /// or a previous warm-up's, saved and reloaded
    /// ([`crate::budget::PlannerInputs::from_json_str`]). Without it, the
    /// planned backend's `enable` leaves a warm-up to run (see
    /// [`crate::runtime::Runtime::set_request`]).
    pub fn with_planner(mut self, inputs: crate::budget::PlannerInputs) -> Self {
        self.planner = Some(inputs);
        self
    }

    /// The request to plan a `device_budget` for (its shape and denoising
    /// steps), instead of the pipeline's declared warm-up request.
    pub fn with_request(mut self, shape: crate::request::RequestShape) -> Self {
        self.request = Some(shape);
        self
    }

    /// [`Self::with_request`] in place.
    pub fn set_request(&mut self, shape: crate::request::RequestShape) {
        self.request = Some(shape);
    }

    /// [`Self::with_planner`] in place.
    pub fn set_planner(&mut self, inputs: crate::budget::PlannerInputs) {
        self.planner = Some(inputs);
    }

    /// This rank's handle on the gather group distributed layerwise
    /// offload all-gathers over (its size and rank must match what the
    /// configuration's `parallel` section derives, CONTRACT §2). Without
    /// it, distributed layerwise runs only with G = 1 (rank-local).
    pub fn with_collective(mut self, collective: Arc<dyn Collective<A>>) -> Self {
        self.collective = Some(collective);
        self
    }

    /// The device's lossless block codec (CONTRACT §7b): what
    /// `weight_compression = "lossless"` codes streamed blocks with.
    /// Without it, that key is refused.
    pub fn with_codec(mut self, codec: Arc<dyn Codec<A>>) -> Self {
        self.codec = Some(codec);
        self
    }

    /// A layerwise or distributed layerwise backend for `config` (whichever
    /// it selects; to plant test bugs in, or to skip the factory).
    pub fn layerwise(
        &self,
        config: crate::config::OffloadConfig,
    ) -> Result<LayerwiseBackend<A>, OffloadError> {
        let mut backend = LayerwiseBackend::build_backend(
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
            config,
            self.prefetch_depth,
            (self.collective.clone(), self.codec.clone()),
            self.bugs(),
        )?;
        backend.auto_inputs = self.planner.clone();
        if backend.auto_inputs.is_none()
            && backend.compression() == crate::config::WeightCompression::Auto
        {
            // Before anything is encoded or pinned.
            return Err(OffloadError::Config(Box::new(
                crate::config::auto_without_inputs(),
            )));
        }
        Ok(backend)
    }

    /// A planned backend for `config` (a `device_budget` configuration).
    pub fn planned(
        &self,
        config: crate::config::OffloadConfig,
    ) -> Result<PlannedBackend<A>, OffloadError> {
        PlannedBackend::with_bugs(
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
            config,
            (self.planner.clone(), self.request.clone()),
            self.bugs(),
            self.codec.clone(),
        )
    }

    /// The backend `config` selects, or, where it selects no offload (or
    /// [`get_offload_backend`] returns `None` for another reason), the
    /// resident backend: `None` means the pipeline runs as it is, every
    /// weight on the device (CONTRACT §3). A rejected configuration is an
    /// `Err`, as from [`get_offload_backend`]. Nothing is installed here.
    pub fn backend_for(
        &self,
        config: &crate::config::OffloadConfig,
    ) -> Result<Box<dyn Backend<A>>, OffloadError> {
        match get_offload_backend(config, self)? {
            Some(backend) => Ok(backend),
            None => self.resident(),
        }
    }

    /// The resident baseline (no offload), for comparisons.
    pub fn resident(&self) -> Result<Box<dyn Backend<A>>, OffloadError> {
        Ok(Box::new(ResidentBackend::with_bugs(
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
            self.bugs(),
        )?))
    }
}

impl<A: Api> Platform for CorePlatform<A> {
    type Backend = dyn Backend<A>;

    fn name(&self) -> &str {
        &self.name
    }

    fn supports_offload(&self) -> bool {
        true
    }

    fn resolve_device(&self, parallel: &ParallelConfig) -> Result<DeviceSpec, OffloadError> {
        Ok(DeviceSpec {
            ordinal: parallel.rank,
            name: self.name.clone(),
        })
    }

    fn create_backend(&self, request: BackendRequest) -> Result<Box<dyn Backend<A>>, OffloadError> {
        let (device, compute, weights) = (
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
        );
        Ok(match request.selection.strategy {
            OffloadStrategy::ModelLevel => Box::new(ModelLevelBackend::with_bugs(
                device,
                compute,
                weights,
                request.config,
                self.bugs(),
            )?),
            OffloadStrategy::Layerwise | OffloadStrategy::DistributedLayerwise => {
                Box::new(self.layerwise(request.config)?)
            }
            OffloadStrategy::Planned => Box::new(self.planned(request.config)?),
            OffloadStrategy::None => Box::new(ResidentBackend::with_bugs(
                device,
                compute,
                weights,
                self.bugs(),
            )?),
        })
    }
}
