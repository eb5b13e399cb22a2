//! The offload plan schema (CONTRACT §5): a pipeline's optional,
//! immutable, versioned declaration of its block topology and of what its
//! components allow. Descriptions only; the resolver (`crate::plan`)
//! reads them.
//!
//! # Plan schema, version 1
//!
//! ```toml
//! version = 1                                   # required; only 1 is known
//! [block_containers]                            # stack owner path -> ordered containers
//! transformer = ["transformer_blocks", "single_transformer_blocks"]
//! [extra_stacks]                                # large non-block submodules streamed as their own stack
//! transformer = ["proj_out", "norm_out"]
//! self_managed = ["audio_vae"]                  # components whose residency the pipeline manages
//! resident_leading_blocks = ["transformer"]     # DiTs that may keep leading blocks resident
//! replicated_encoders = ["text_encoder"]        # encoders identical on all ranks (may be gathered)
//! ```
//!
//! Container and extra-stack paths are relative to their owner; every other
//! path is a full dotted path. Unknown keys are errors.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::diagnostics::PlanError;

/// The plan schema version this library reads and writes.
pub const PLAN_SCHEMA_VERSION: u32 = 1;

/// A pipeline's optional, immutable offload declaration (schema above).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OffloadPlan {
    /// Schema version; must be [`PLAN_SCHEMA_VERSION`].
    pub version: u32,
    /// Stack owner path → ordered block containers (relative paths).
    #[serde(default)]
    pub block_containers: BTreeMap<String, Vec<String>>,
    /// Stack owner path → large non-block submodules (relative paths) that
    /// stream as their own stack, in forward order.
    #[serde(default)]
    pub extra_stacks: BTreeMap<String, Vec<String>>,
    /// Components whose residency the pipeline manages itself.
    #[serde(default)]
    pub self_managed: Vec<String>,
    /// DiTs that may keep leading blocks resident.
    #[serde(default)]
    pub resident_leading_blocks: Vec<String>,
    /// Encoders identical on all ranks; only those may be gathered.
    #[serde(default)]
    pub replicated_encoders: Vec<String>,
}

impl Default for OffloadPlan {
    fn default() -> Self {
        Self {
            version: PLAN_SCHEMA_VERSION,
            block_containers: BTreeMap::new(),
            extra_stacks: BTreeMap::new(),
            self_managed: Vec::new(),
            resident_leading_blocks: Vec::new(),
            replicated_encoders: Vec::new(),
        }
    }
}

impl OffloadPlan {
    /// Parses a plan from JSON and checks its version.
    pub fn from_json_str(text: &str) -> Result<Self, PlanError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let plan: Self = serde_path_to_error::deserialize(de).map_err(|e| PlanError::Schema {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
        plan.check_version()?;
        Ok(plan)
    }

    /// Parses a plan from TOML and checks its version.
    pub fn from_toml_str(text: &str) -> Result<Self, PlanError> {
        let de = toml::Deserializer::parse(text).map_err(|e| PlanError::Schema {
            key: String::new(),
            message: e.message().to_owned(),
        })?;
        let plan: Self = serde_path_to_error::deserialize(de).map_err(|e| PlanError::Schema {
            key: e.path().to_string(),
            message: e.inner().to_string(),
        })?;
        plan.check_version()?;
        Ok(plan)
    }

    pub(crate) fn check_version(&self) -> Result<(), PlanError> {
        if self.version == PLAN_SCHEMA_VERSION {
            Ok(())
        } else {
            Err(PlanError::UnsupportedVersion {
                version: self.version,
                supported: PLAN_SCHEMA_VERSION,
            })
        }
    }
}
