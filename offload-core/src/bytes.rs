//! Byte counts as configuration writes them: [`ByteSize`] (`"24GiB"`,
//! `"16 GB"`, an integer of bytes) and [`DeviceBudget`] (`"auto"` or a
//! size), the forms the `device_budget` and `device_headroom` keys take.
//! Descriptions only: nothing here reads a device.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written as `24GiB`, `16 GB`, `512MiB`, `1.5TiB` or a plain
/// integer of bytes (the `device_budget` key).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ByteSize(pub u64);

/// What [`ByteSize`] accepts, for error messages.
pub const BYTE_SIZE_FORMS: &str = "a positive byte count: an integer of bytes, or a number with a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"24GiB\" or \"16 GB\"";

impl ByteSize {
    /// Parses `text` (see [`BYTE_SIZE_FORMS`]); zero is refused.
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim();
        if t.starts_with('-') {
            return Err(format!("`{text}` is negative; allowed: {BYTE_SIZE_FORMS}"));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (number, unit) = (&t[..split], t[split..].trim());
        let scale: f64 = match unit {
            "" | "B" => 1.0,
            "KB" => 1e3,
            "MB" => 1e6,
            "GB" => 1e9,
            "TB" => 1e12,
            "KiB" => 1024.0,
            "MiB" => 1024f64.powi(2),
            "GiB" => 1024f64.powi(3),
            "TiB" => 1024f64.powi(4),
            other => {
                return Err(format!(
                    "`{text}`: unknown unit `{other}`; allowed: {BYTE_SIZE_FORMS}"
                ));
            }
        };
        let value: f64 = number
            .parse()
            .map_err(|_| format!("`{text}` is not a byte count; allowed: {BYTE_SIZE_FORMS}"))?;
        let bytes = (value * scale).round();
        if !(bytes >= 1.0 && bytes < u64::MAX as f64) {
            return Err(format!(
                "`{text}` is {} bytes; allowed: {BYTE_SIZE_FORMS}",
                if bytes < 1.0 { "zero" } else { "too many" }
            ));
        }
        Ok(Self(bytes as u64))
    }
}

/// The units a size is written in, largest first (binary before decimal
/// at each step).
const UNITS: [(&str, u64); 8] = [
    ("TiB", 1 << 40),
    ("TB", 1_000_000_000_000),
    ("GiB", 1 << 30),
    ("GB", 1_000_000_000),
    ("MiB", 1 << 20),
    ("MB", 1_000_000),
    ("KiB", 1 << 10),
    ("KB", 1_000),
];

/// `bytes / scale` with at most two decimals, trailing zeros trimmed
/// (rounded up if `up`, else to nearest).
fn decimal(bytes: u64, scale: u64, up: bool) -> String {
    let hundredths = u128::from(bytes) * 100;
    let scale = u128::from(scale);
    let h = if up {
        hundredths.div_ceil(scale)
    } else {
        (hundredths + scale / 2) / scale
    };
    let (whole, frac) = (h / 100, h % 100);
    match frac {
        0 => whole.to_string(),
        f if f % 10 == 0 => format!("{whole}.{}", f / 10),
        f => format!("{whole}.{f:02}"),
    }
}

impl ByteSize {
    /// The unit [`Display`](fmt::Display) writes this size in, as a person
    /// writes it: the unit in which it is the shortest number of at most
    /// two decimals (`"200MiB"` stays 200 MiB, `"16 GB"` 16 GB), else
    /// bytes (`("B", 1)`).
    pub fn unit(self) -> (&'static str, u64) {
        let b = self.0;
        UNITS
            .iter()
            .filter(|(_, scale)| b >= *scale && (u128::from(b) * 100) % u128::from(*scale) == 0)
            .min_by_key(|(_, scale)| decimal(b, *scale, false).len())
            .copied()
            .unwrap_or(("B", 1))
    }

    /// `bytes` in this size's unit (two decimals at most), so that figures
    /// beside a size the user wrote read in the unit they wrote it in.
    pub fn in_unit_of(self, bytes: u64) -> String {
        let (unit, scale) = self.unit();
        format!("{} {unit}", decimal(bytes, scale, false))
    }

    /// `bytes` in this size's unit, rounded up: a value of the key that
    /// is at least `bytes` (`"1.24GiB"`), to write back.
    pub fn written_at_least(self, bytes: u64) -> String {
        let (unit, scale) = self.unit();
        format!("\"{}{unit}\"", decimal(bytes, scale, true))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (unit, scale) = self.unit();
        write!(f, "{} {unit}", decimal(self.0, scale, false))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.0)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = ByteSize;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(BYTE_SIZE_FORMS)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<ByteSize, E> {
                if v == 0 {
                    Err(E::custom(format!(
                        "`0` is zero bytes; allowed: {BYTE_SIZE_FORMS}"
                    )))
                } else {
                    Ok(ByteSize(v))
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<ByteSize, E> {
                u64::try_from(v)
                    .map_err(|_| {
                        E::custom(format!("`{v}` is negative; allowed: {BYTE_SIZE_FORMS}"))
                    })
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<ByteSize, E> {
                ByteSize::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

/// What `device_budget` says: plan for the device's free memory at enable
/// less `device_headroom` (`"auto"`), or for this many bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceBudget {
    /// The device's free memory when offload is enabled, less the
    /// configuration's `device_headroom` (default [`DEFAULT_HEADROOM`]).
    Auto,
    /// This many bytes.
    Bytes(ByteSize),
}

/// What `device_budget = "auto"` leaves free by default: 1 GiB for the
/// CUDA context's growth, the caching allocator's slack and other
/// processes' small allocations (`device_headroom` replaces it).
pub const DEFAULT_HEADROOM: ByteSize = ByteSize(1 << 30);

/// What [`DeviceBudget`] accepts, for error messages.
pub const DEVICE_BUDGET_FORMS: &str = "\"auto\" (the device's free memory at enable less device_headroom, default 1 GiB) or a positive byte count: an integer of bytes, or a number with a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"24GiB\" or \"16 GB\"";

impl DeviceBudget {
    /// Parses `"auto"` or a [`ByteSize`].
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.trim() == "auto" {
            return Ok(Self::Auto);
        }
        ByteSize::parse(text).map(Self::Bytes).map_err(|e| {
            // The byte count's own complaint, with the wider choice.
            let what = e.split("; allowed:").next().unwrap_or(&e);
            format!("{what} (and not \"auto\"); allowed: {DEVICE_BUDGET_FORMS}")
        })
    }

    /// The bytes, unless `"auto"`.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Self::Auto => None,
            Self::Bytes(b) => Some(b.0),
        }
    }
}

impl From<ByteSize> for DeviceBudget {
    fn from(b: ByteSize) -> Self {
        Self::Bytes(b)
    }
}

impl fmt::Display for DeviceBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Bytes(b) => b.fmt(f),
        }
    }
}

impl Serialize for DeviceBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Bytes(b) => b.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for DeviceBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = DeviceBudget;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(DEVICE_BUDGET_FORMS)
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<DeviceBudget, E> {
                if v == 0 {
                    Err(E::custom(format!(
                        "`0` is zero bytes; allowed: {DEVICE_BUDGET_FORMS}"
                    )))
                } else {
                    Ok(DeviceBudget::Bytes(ByteSize(v)))
                }
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<DeviceBudget, E> {
                u64::try_from(v)
                    .map_err(|_| {
                        E::custom(format!("`{v}` is negative; allowed: {DEVICE_BUDGET_FORMS}"))
                    })
                    .and_then(|v| self.visit_u64(v))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<DeviceBudget, E> {
                DeviceBudget::parse(v).map_err(E::custom)
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_and_refuse() {
        assert_eq!(ByteSize::parse("24GiB"), Ok(ByteSize(24 << 30)));
        assert_eq!(ByteSize::parse("16 GB"), Ok(ByteSize(16_000_000_000)));
        assert_eq!(ByteSize::parse("512MiB"), Ok(ByteSize(512 << 20)));
        assert_eq!(ByteSize::parse("1.5 KiB"), Ok(ByteSize(1536)));
        assert_eq!(ByteSize::parse("1000"), Ok(ByteSize(1000)));
        for bad in ["", "0", "0GiB", "24 gigs", "GiB", "-3GB", "1e3", "auto"] {
            let e = ByteSize::parse(bad).unwrap_err();
            assert!(e.contains("allowed"), "{bad}: {e}");
        }
    }

    #[test]
    fn sizes_are_echoed_in_the_unit_written() {
        for (written, shown) in [
            ("200MiB", "200 MiB"),
            ("16 GB", "16 GB"),
            ("24GiB", "24 GiB"),
            ("1.5TiB", "1.5 TiB"),
            ("512MiB", "512 MiB"),
            ("1000", "1 KB"),
            ("1023", "1023 B"),
            ("2.25 GB", "2.25 GB"),
        ] {
            let b = ByteSize::parse(written).unwrap();
            assert_eq!(b.to_string(), shown, "{written}");
            assert_eq!(
                ByteSize::parse(&b.to_string()),
                Ok(b),
                "{written} round trip"
            );
        }
        let budget = ByteSize::parse("200MiB").unwrap();
        assert_eq!(budget.in_unit_of(1 << 30), "1024 MiB");
        assert_eq!(budget.written_at_least((1 << 20) + 1), "\"1.01MiB\"");
    }

    #[test]
    fn device_budgets_parse_auto_or_a_size() {
        assert_eq!(DeviceBudget::parse("auto"), Ok(DeviceBudget::Auto));
        assert_eq!(
            DeviceBudget::parse("16GiB"),
            Ok(DeviceBudget::Bytes(ByteSize(16 << 30)))
        );
        for bad in ["", "Auto", "automatic", "0", "-1GiB", "16 gigs"] {
            let e = DeviceBudget::parse(bad).unwrap_err();
            assert!(
                e.contains("\"auto\"") && e.contains("allowed"),
                "{bad}: {e}"
            );
        }
    }
}
