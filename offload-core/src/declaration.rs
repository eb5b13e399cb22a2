//! What a pipeline declares about its components (CONTRACT §5): the
//! explicit [`ComponentDeclaration`] of dotted paths per [`Role`].
//! Descriptions only; discovery (`crate::discovery`) reads them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Which of a pipeline's modules are its components, by role: the dotted
/// paths of the modules (from the pipeline's root) that are its denoising
/// transformers, encoders, VAEs and always-resident modules. Every path
/// must name a module of the pipeline: one that does not is an error at
/// resolve (with the nearest names), never a silent skip. A component's
/// blocks are named on its module with
/// [`ModuleBuilder::block_containers`](crate::model::ModuleBuilder::block_containers).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComponentDeclaration {
    /// Denoising transformers: layerwise offload streams their blocks, and
    /// the planner runs them once per denoising step.
    pub dit: Vec<String>,
    /// Text and image encoders: run once per request.
    pub encoder: Vec<String>,
    /// VAEs: run once per request, after the DiTs.
    pub vae: Vec<String>,
    /// Small modules that never move (embedders, schedulers' tables).
    pub resident: Vec<String>,
}

/// The role of a component in a diffusion pipeline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A denoising transformer.
    Dit,
    /// A text or image encoder.
    Encoder,
    /// A VAE.
    Vae,
    /// A module that stays on the device.
    Resident,
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Role::Dit => "dit",
            Role::Encoder => "encoder",
            Role::Vae => "vae",
            Role::Resident => "resident",
        })
    }
}
