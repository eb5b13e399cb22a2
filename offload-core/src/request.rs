//! The request a pipeline serves (CONTRACT §9): its largest shape, as the
//! pipeline's warm-up recipe declares it ([`RequestShape`]). The request
//! planner plans one such request (the encoders once, `steps` denoising
//! forwards, the VAE once); the warm-up runs it with `warmup_steps`
//! denoising steps to measure it. Descriptions only.

use std::fmt;

use serde::{Deserialize, Serialize};

/// The largest request a pipeline serves: what its warm-up runs and what
/// the request planner plans for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestShape {
    /// Tokens of one denoising forward (image and text), the largest the
    /// pipeline serves (Flux.1-dev at 1024²: 4,096 + 512 = 4,608).
    pub tokens: u64,
    /// Images (or videos) per request.
    #[serde(default = "one")]
    pub batch: u32,
    /// Output height in pixels (what the VAE decodes to; 0 without one).
    #[serde(default)]
    pub height: u32,
    /// Output width in pixels (0 without a VAE).
    #[serde(default)]
    pub width: u32,
    /// Frames per output (1 for an image).
    #[serde(default = "one")]
    pub frames: u32,
    /// Denoising steps of one request: what the planner plans for.
    pub steps: u32,
    /// Denoising steps the warm-up runs to measure the request (1 or 2: the
    /// second step's times are free of first-use costs).
    #[serde(default = "two")]
    pub warmup_steps: u32,
}

fn one() -> u32 {
    1
}

fn two() -> u32 {
    2
}

/// The most tokens, steps and pixels a shape may name (sums and products
/// stay far from overflow).
pub const MAX_REQUEST_TOKENS: u64 = 1 << 24;
/// The most denoising steps of a request.
pub const MAX_REQUEST_STEPS: u32 = 100_000;

/// A field of a [`RequestShape`] outside what is allowed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("request shape `{field}` = {value} is not allowed; allowed: {allowed}")]
pub struct RequestShapeError {
    /// The field.
    pub field: &'static str,
    /// Its value.
    pub value: String,
    /// What is allowed.
    pub allowed: String,
}

impl RequestShape {
    /// A request of `tokens` per denoising forward and `steps` steps, batch
    /// 1, one frame, no output size, a warm-up of 2 steps.
    pub fn new(tokens: u64, steps: u32) -> Self {
        Self {
            tokens,
            batch: 1,
            height: 0,
            width: 0,
            frames: 1,
            steps,
            warmup_steps: 2,
        }
    }

    /// The same request with an output of `height × width` pixels.
    pub fn with_output(mut self, height: u32, width: u32) -> Self {
        self.height = height;
        self.width = width;
        self
    }

    /// Checks every field against its range.
    pub fn validate(&self) -> Result<(), RequestShapeError> {
        let bad = |field, value: String, allowed: String| {
            Err(RequestShapeError {
                field,
                value,
                allowed,
            })
        };
        if !(1..=MAX_REQUEST_TOKENS).contains(&self.tokens) {
            return bad(
                "tokens",
                self.tokens.to_string(),
                format!("1 to {MAX_REQUEST_TOKENS}"),
            );
        }
        if !(1..=MAX_REQUEST_STEPS).contains(&self.steps) {
            return bad(
                "steps",
                self.steps.to_string(),
                format!("1 to {MAX_REQUEST_STEPS}"),
            );
        }
        if !(1..=2).contains(&self.warmup_steps) || self.warmup_steps > self.steps {
            return bad(
                "warmup_steps",
                self.warmup_steps.to_string(),
                format!("1 or 2, and at most steps ({})", self.steps),
            );
        }
        for (field, v) in [("batch", self.batch), ("frames", self.frames)] {
            if !(1..=65_536).contains(&v) {
                return bad(field, v.to_string(), "1 to 65536".to_owned());
            }
        }
        for (field, v) in [("height", self.height), ("width", self.width)] {
            if v > 1 << 20 {
                return bad(field, v.to_string(), "0 to 1048576 pixels".to_owned());
            }
        }
        if (self.height == 0) != (self.width == 0) {
            return bad(
                "height × width",
                format!("{} × {}", self.height, self.width),
                "both 0 (no output) or both positive".to_owned(),
            );
        }
        Ok(())
    }

    /// The request the warm-up runs: this one with `warmup_steps` steps.
    pub fn for_warmup(&self) -> Self {
        Self {
            steps: self.warmup_steps.min(self.steps).max(1),
            ..self.clone()
        }
    }

    /// Output pixels of one request (height × width × frames × batch).
    pub fn output_pixels(&self) -> u64 {
        u64::from(self.height)
            * u64::from(self.width)
            * u64::from(self.frames)
            * u64::from(self.batch)
    }
}

impl fmt::Display for RequestShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} tokens × {} steps", self.tokens, self.steps)?;
        if self.height > 0 {
            write!(f, ", {}×{}", self.width, self.height)?;
        }
        if self.frames > 1 {
            write!(f, " × {} frames", self.frames)?;
        }
        if self.batch > 1 {
            write!(f, ", batch {}", self.batch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_checked() {
        let ok = RequestShape::new(4608, 28).with_output(1024, 1024);
        assert_eq!(ok.validate(), Ok(()));
        assert_eq!(ok.for_warmup().steps, 2);
        assert_eq!(ok.output_pixels(), 1 << 20);
        for (shape, field) in [
            (RequestShape::new(0, 28), "tokens"),
            (RequestShape::new(4608, 0), "steps"),
            (
                RequestShape {
                    warmup_steps: 3,
                    ..RequestShape::new(4608, 28)
                },
                "warmup_steps",
            ),
            (
                RequestShape {
                    warmup_steps: 2,
                    ..RequestShape::new(4608, 1)
                },
                "warmup_steps",
            ),
            (
                RequestShape::new(4608, 28).with_output(1024, 0),
                "height × width",
            ),
        ] {
            let e = shape.validate().unwrap_err();
            assert_eq!(e.field, field, "{e}");
            assert!(e.to_string().contains("allowed"), "{e}");
        }
    }
}
