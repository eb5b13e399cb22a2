//! A [`Platform`] over any device: builds the core strategies for the
//! configuration's selection. Backends (`offload-sim`, `offload-cuda`) hand
//! it their device, compute stream and weight source.

use crate::sync::Arc;

use crate::config::{OffloadStrategy, ParallelConfig};
use crate::device::Api;
use crate::lifecycle::{BackendRequest, DeviceSpec, OffloadError, Platform};
use crate::runtime::{Backend, LayerwiseBackend, ModelLevelBackend, ResidentBackend, WeightSource};

/// Builds core backends on one device.
pub struct CorePlatform<A: Api> {
    name: String,
    device: Arc<A::Device>,
    compute: Arc<A::Stream>,
    weights: Arc<dyn WeightSource>,
    prefetch_depth: usize,
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
        }
    }

    /// Blocks the layerwise strategy keeps in flight (default 1).
    pub fn with_prefetch_depth(mut self, depth: usize) -> Self {
        self.prefetch_depth = depth.max(1);
        self
    }

    /// A layerwise backend for `config` (to plant test bugs in, or to skip
    /// the factory).
    pub fn layerwise(
        &self,
        config: crate::config::OffloadConfig,
    ) -> Result<LayerwiseBackend<A>, OffloadError> {
        LayerwiseBackend::new(
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
            config,
            self.prefetch_depth,
        )
    }

    /// The resident baseline (no offload), for comparisons.
    pub fn resident(&self) -> Result<Box<dyn Backend<A>>, OffloadError> {
        Ok(Box::new(ResidentBackend::new(
            Arc::clone(&self.device),
            Arc::clone(&self.compute),
            Arc::clone(&self.weights),
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
            OffloadStrategy::ModelLevel => Box::new(ModelLevelBackend::new(
                device,
                compute,
                weights,
                request.config,
            )?),
            OffloadStrategy::Layerwise => Box::new(LayerwiseBackend::new(
                device,
                compute,
                weights,
                request.config,
                self.prefetch_depth,
            )?),
            OffloadStrategy::None => Box::new(ResidentBackend::new(device, compute, weights)?),
            strategy @ OffloadStrategy::DistributedLayerwise => {
                return Err(OffloadError::Unsupported {
                    platform: self.name.clone(),
                    strategy,
                });
            }
        })
    }
}
