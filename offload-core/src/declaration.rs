//! What a pipeline declares about its components (CONTRACT §5): the
//! explicit [`ComponentDeclaration`] of dotted paths per [`Role`].
//! Descriptions only; discovery (`crate::discovery`) reads them.

use std::fmt;

use serde::{Deserialize, Serialize};

/// What a pipeline declares about its components
/// (`SupportsComponentDiscovery`): dotted paths per role.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ComponentDeclaration {
    /// Denoising transformers (`_dit_modules`).
    pub dit: Vec<String>,
    /// Encoders (`_encoder_modules`).
    pub encoder: Vec<String>,
    /// VAEs (`_vae_modules`).
    pub vae: Vec<String>,
    /// Small modules that never move (`_resident_modules`).
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
