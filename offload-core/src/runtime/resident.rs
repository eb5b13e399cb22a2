//! Everything on the device, no hooks: the "no offload" baseline that
//! offloaded runs are compared with (INV-8), and what a pipeline gets when
//! it fits.

use crate::sync::Arc;

use crate::config::{OffloadConfig, OffloadStrategy};
use crate::device::Api;
use crate::lifecycle::{
    DisableStep, EnableStep, Lifecycle, LifecycleState, OffloadBackend, OffloadError,
};
use crate::model::StorageId;
use crate::residency::Residency;
use crate::runtime::backend::{Backend, DeviceLocation, WeightSource};
use crate::runtime::bugs::{Bugs, PlantedBug};
use crate::runtime::hooks::Model;
use crate::runtime::shared::{Handles, Placement, bytes_of, plan_and_partition};

/// Uploads every weight once; keeps them resident until `disable` (or a
/// drop, which drains the streams first).
pub struct ResidentBackend<A: Api> {
    handles: Handles<A>,
    bugs: Bugs,
    lifecycle: Lifecycle,
    placement: Option<Placement<A>>,
    buffers: Vec<Arc<A::DeviceBuffer>>,
}

impl<A: Api> ResidentBackend<A> {
    /// A resident backend on `device`, reading weights from `weights`.
    pub fn new(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
    ) -> Result<Self, OffloadError> {
        Self::with_bugs(device, compute, weights, Bugs::default())
    }

    pub(crate) fn with_bugs(
        device: Arc<A::Device>,
        compute: Arc<A::Stream>,
        weights: Arc<dyn WeightSource>,
        bugs: Bugs,
    ) -> Result<Self, OffloadError> {
        Ok(Self {
            handles: Handles::new(device, compute, weights)?,
            bugs,
            lifecycle: Lifecycle::new(OffloadStrategy::None),
            placement: None,
            buffers: Vec::new(),
        })
    }

    /// Frees every buffer after draining (see `Handles::release`).
    fn release(&mut self, drain: bool) -> Result<(), OffloadError> {
        // Placement holds references to the buffers: drop it first.
        self.placement = None;
        let buffers = std::mem::take(&mut self.buffers);
        let h = &self.handles;
        h.release("resident", buffers, drain, |buffers, first| {
            h.free_all(buffers, "resident unit", first);
        })
    }
}

impl<A: Api> Drop for ResidentBackend<A> {
    fn drop(&mut self) {
        if self.buffers.is_empty() {
            return;
        }
        let drain = !self.bugs.has(PlantedBug::DropWithoutDrain);
        if let Err(e) = self.release(drain) {
            tracing::error!("dropping an enabled resident backend: {e}");
        }
    }
}

impl<A: Api> OffloadBackend for ResidentBackend<A> {
    fn strategy(&self) -> OffloadStrategy {
        OffloadStrategy::None
    }

    fn enable(&mut self, model: &mut Model) -> Result<(), OffloadError> {
        let _span = crate::runtime::shared::enable_span(OffloadStrategy::None, model).entered();
        if self.lifecycle.begin_enable()? == EnableStep::AlreadyEnabled {
            return Ok(());
        }
        let (_, partition) = plan_and_partition(
            &model.pipeline,
            &OffloadConfig::default(),
            Some(&*self.handles.weights),
        )?;
        let mut placement = Placement::new(&model.pipeline, OffloadStrategy::None);
        let result = partition.all().try_for_each(|unit| {
            let buffer = Arc::new(self.handles.upload(unit, &Default::default())?);
            self.buffers.push(Arc::clone(&buffer));
            placement.resident(unit, &buffer)
        });
        if let Err(e) = result {
            let _ = self.release(true);
            return Err(e);
        }
        self.placement = Some(placement);
        self.lifecycle.finish_enable();
        Ok(())
    }

    fn disable(&mut self, _model: &mut Model) -> Result<(), OffloadError> {
        if self.lifecycle.begin_disable() == DisableStep::NothingToDo {
            return Ok(());
        }
        let result = self.release(true);
        self.lifecycle.finish_disable();
        result
    }

    fn is_enabled(&self) -> bool {
        self.lifecycle.is_enabled()
    }

    fn state(&self) -> LifecycleState {
        self.lifecycle.state().clone()
    }
}

impl<A: Api> Backend<A> for ResidentBackend<A> {
    fn locate(&self, storage: StorageId) -> Option<DeviceLocation<A>> {
        self.placement.as_ref()?.locate(storage)
    }

    fn residency(&self, storage: StorageId) -> Option<Residency> {
        self.placement.as_ref()?.residency_of(storage)
    }

    fn device_weight_bytes(&self) -> u64 {
        bytes_of::<A>(&self.buffers)
    }

    fn host_weight_bytes(&self) -> u64 {
        0
    }
}
