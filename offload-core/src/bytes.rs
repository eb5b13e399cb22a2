//! Byte counts as configuration writes them: [`ByteSize`] (`"24GiB"`,
//! `"16 GB"`, an integer of bytes) and [`DeviceBudget`] (`"auto"` or a
//! size), the forms the `device_budget` and `device_headroom` keys take.
//! Descriptions only: nothing here reads a device.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A byte count written as `24GiB`, `16 GB`, `512MiB`, `1.5TiB` or a plain
/// integer of bytes (the `device_budget` key). It remembers the unit it was
/// written in, so that it reads back in it (`"200MiB"` is 200 MiB, `"1000"`
/// is 1000 B); equality and order are of the bytes alone.
#[derive(Clone, Copy, Debug)]
pub struct ByteSize {
    bytes: u64,
    /// The unit it was written in, an index into [`UNITS`] (`None`: a size
    /// made from bytes, shown in the unit it is shortest in).
    written: Option<u8>,
}

impl PartialEq for ByteSize {
    fn eq(&self, other: &Self) -> bool {
        self.bytes == other.bytes
    }
}

impl Eq for ByteSize {}

impl PartialOrd for ByteSize {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ByteSize {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.bytes.cmp(&other.bytes)
    }
}

impl std::hash::Hash for ByteSize {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.bytes.hash(state);
    }
}

/// What [`ByteSize`] accepts, for error messages.
pub const BYTE_SIZE_FORMS: &str = "a positive byte count: an integer of bytes, or a number with a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"24GiB\" or \"16 GB\"";

impl ByteSize {
    /// `bytes`, shown in the unit they are shortest in.
    pub const fn new(bytes: u64) -> Self {
        Self {
            bytes,
            written: None,
        }
    }

    /// The byte count.
    pub const fn bytes(self) -> u64 {
        self.bytes
    }

    /// `bytes` in this size's unit: the one it was written in, if any.
    pub const fn with_bytes(self, bytes: u64) -> Self {
        Self {
            bytes,
            written: self.written,
        }
    }

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
        let written = match unit {
            "" => UNITS.len() - 1,
            other => match UNITS.iter().position(|(u, _)| *u == other) {
                Some(i) => i,
                None => {
                    return Err(format!(
                        "`{text}`: unknown unit `{other}`; allowed: {BYTE_SIZE_FORMS}"
                    ));
                }
            },
        };
        let scale = UNITS[written].1 as f64;
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
        Ok(Self {
            bytes: bytes as u64,
            written: Some(written as u8),
        })
    }
}

/// The units a size is written in, largest first (binary before decimal
/// at each step), then bytes.
const UNITS: [(&str, u64); 9] = [
    ("TiB", 1 << 40),
    ("TB", 1_000_000_000_000),
    ("GiB", 1 << 30),
    ("GB", 1_000_000_000),
    ("MiB", 1 << 20),
    ("MB", 1_000_000),
    ("KiB", 1 << 10),
    ("KB", 1_000),
    ("B", 1),
];

/// `bytes / scale` with at most three decimals, trailing zeros trimmed
/// (rounded up if `up`, else to nearest).
fn decimal(bytes: u64, scale: u64, up: bool) -> String {
    let thousandths = u128::from(bytes) * 1000;
    let scale = u128::from(scale);
    let t = if up {
        thousandths.div_ceil(scale)
    } else {
        (thousandths + scale / 2) / scale
    };
    let (whole, frac) = (t / 1000, t % 1000);
    if frac == 0 {
        return whole.to_string();
    }
    let frac = format!("{frac:03}");
    format!("{whole}.{}", frac.trim_end_matches('0'))
}

impl ByteSize {
    /// The unit [`Display`](fmt::Display) writes this size in: the one it
    /// was written in (`"200MiB"` stays 200 MiB, `"1000"` 1000 B), else
    /// the unit in which it is the shortest exact number of at most three
    /// decimals, else bytes (`("B", 1)`).
    pub fn unit(self) -> (&'static str, u64) {
        if let Some(u) = self.written.and_then(|i| UNITS.get(usize::from(i))) {
            return *u;
        }
        let b = self.bytes;
        UNITS
            .iter()
            .filter(|(_, scale)| b >= *scale && (u128::from(b) * 1000) % u128::from(*scale) == 0)
            .min_by_key(|(_, scale)| decimal(b, *scale, false).len())
            .copied()
            .unwrap_or(("B", 1))
    }

    /// `bytes` in this size's unit (three decimals at most; a non-zero
    /// figure too small to show is "< 0.001 …"), so that figures beside a
    /// size the user wrote read in the unit they wrote it in.
    pub fn in_unit_of(self, bytes: u64) -> String {
        let (unit, scale) = self.unit();
        let shown = decimal(bytes, scale, false);
        if bytes > 0 && shown == "0" {
            format!("< 0.001 {unit}")
        } else {
            format!("{shown} {unit}")
        }
    }

    /// `bytes` in this size's unit, rounded up: never less than `bytes`
    /// (a least budget), three decimals at most.
    pub fn in_unit_of_at_least(self, bytes: u64) -> String {
        let (unit, scale) = self.unit();
        format!("{} {unit}", decimal(bytes, scale, true))
    }

    /// `bytes` in this size's unit, rounded up, as a value of the key to
    /// write back (`"1.24GiB"`): never less than `bytes`.
    pub fn written_at_least(self, bytes: u64) -> String {
        let (unit, scale) = self.unit();
        let unit = if unit == "B" { "" } else { unit };
        format!("\"{}{unit}\"", decimal(bytes, scale, true))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (unit, scale) = self.unit();
        write!(f, "{} {unit}", decimal(self.bytes, scale, false))
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_u64(self.bytes)
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
                    Ok(ByteSize::new(v))
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
pub const DEFAULT_HEADROOM: ByteSize = ByteSize::new(1 << 30);

/// What [`DeviceBudget`] accepts, for error messages.
pub const DEVICE_BUDGET_FORMS: &str = "\"auto\" (the device's free memory at enable less device_headroom, default 1 GiB) or a positive byte count: an integer of bytes, or a number with a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"24GiB\" or \"16 GB\"";

impl DeviceBudget {
    /// Parses `"auto"` or a [`ByteSize`].
    pub fn parse(text: &str) -> Result<Self, String> {
        parse_auto_or_size(text)
    }

    /// `bytes` of a budget as errors write them: in the unit `budget` was
    /// written in, if it is a size.
    pub fn size_of(budget: Option<Self>, bytes: u64) -> ByteSize {
        match budget {
            Some(Self::Bytes(b)) => b.with_bytes(bytes),
            _ => ByteSize::new(bytes),
        }
    }

    /// The bytes, unless `"auto"`.
    pub fn bytes(self) -> Option<u64> {
        match self {
            Self::Auto => None,
            Self::Bytes(b) => Some(b.bytes),
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

/// A budget written `"auto"` or as a size ([`DeviceBudget`],
/// [`HostBudget`]): one parser, one visitor, each with its own words.
trait AutoOrSize: Sized {
    /// What the key accepts, for error messages.
    const FORMS: &'static str;
    fn auto() -> Self;
    fn sized(b: ByteSize) -> Self;
}

/// Parses `"auto"` or a [`ByteSize`] into `T`.
fn parse_auto_or_size<T: AutoOrSize>(text: &str) -> Result<T, String> {
    if text.trim() == "auto" {
        return Ok(T::auto());
    }
    ByteSize::parse(text).map(T::sized).map_err(|e| {
        // The byte count's own complaint, with the wider choice.
        let what = e.split("; allowed:").next().unwrap_or(&e);
        format!("{what} (and not \"auto\"); allowed: {}", T::FORMS)
    })
}

fn deserialize_auto_or_size<'de, T: AutoOrSize, D: Deserializer<'de>>(d: D) -> Result<T, D::Error> {
    struct V<T>(std::marker::PhantomData<T>);
    impl<T: AutoOrSize> serde::de::Visitor<'_> for V<T> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str(T::FORMS)
        }
        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<T, E> {
            if v == 0 {
                Err(E::custom(format!(
                    "`0` is zero bytes; allowed: {}",
                    T::FORMS
                )))
            } else {
                Ok(T::sized(ByteSize::new(v)))
            }
        }
        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<T, E> {
            u64::try_from(v)
                .map_err(|_| E::custom(format!("`{v}` is negative; allowed: {}", T::FORMS)))
                .and_then(|v| self.visit_u64(v))
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<T, E> {
            parse_auto_or_size(v).map_err(E::custom)
        }
    }
    d.deserialize_any(V(std::marker::PhantomData))
}

impl AutoOrSize for DeviceBudget {
    const FORMS: &'static str = DEVICE_BUDGET_FORMS;
    fn auto() -> Self {
        Self::Auto
    }
    fn sized(b: ByteSize) -> Self {
        Self::Bytes(b)
    }
}

impl<'de> Deserialize<'de> for DeviceBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_auto_or_size(d)
    }
}

/// What `host_budget` says (CONTRACT §7c): the most page-locked host
/// memory (pinned copies, registrations in place, staging buffers) offload
/// may hold, `"auto"` (what this process may still use at enable, less a
/// headroom: `crate::budget::host_limits`) or this many bytes. Masters
/// beyond it stay in pageable memory and stream through staging buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HostBudget {
    /// What this process may use at enable (the cgroup's limit less its
    /// use, else `MemAvailable`), less [`crate::budget::host::host_headroom`].
    Auto,
    /// This many bytes.
    Bytes(ByteSize),
}

/// What [`HostBudget`] accepts, for error messages.
pub const HOST_BUDGET_FORMS: &str = "\"auto\" (what this process may still use at enable: the cgroup's memory.max less its memory.current, else MemAvailable, less a headroom of 10 %, at least 2 GiB) or a positive byte count: an integer of bytes, or a number with a unit B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. \"8GiB\"";

impl AutoOrSize for HostBudget {
    const FORMS: &'static str = HOST_BUDGET_FORMS;
    fn auto() -> Self {
        Self::Auto
    }
    fn sized(b: ByteSize) -> Self {
        Self::Bytes(b)
    }
}

impl HostBudget {
    /// Parses `"auto"` or a [`ByteSize`].
    pub fn parse(text: &str) -> Result<Self, String> {
        parse_auto_or_size(text)
    }
}

impl fmt::Display for HostBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Auto => f.write_str("auto"),
            Self::Bytes(b) => b.fmt(f),
        }
    }
}

impl Serialize for HostBudget {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Self::Auto => s.serialize_str("auto"),
            Self::Bytes(b) => b.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for HostBudget {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        deserialize_auto_or_size(d)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_sizes_parse_and_refuse() {
        assert_eq!(ByteSize::parse("24GiB"), Ok(ByteSize::new(24 << 30)));
        assert_eq!(ByteSize::parse("16 GB"), Ok(ByteSize::new(16_000_000_000)));
        assert_eq!(ByteSize::parse("512MiB"), Ok(ByteSize::new(512 << 20)));
        assert_eq!(ByteSize::parse("1.5 KiB"), Ok(ByteSize::new(1536)));
        assert_eq!(ByteSize::parse("1000"), Ok(ByteSize::new(1000)));
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
            ("2048MiB", "2048 MiB"),
            ("0.5GiB", "0.5 GiB"),
            ("0.1GiB", "0.1 GiB"),
            ("1.234GiB", "1.234 GiB"),
            ("1.999GiB", "1.999 GiB"),
            ("1000", "1000 B"),
            ("1023 B", "1023 B"),
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
        // Sizes made from bytes: the unit they are shortest in.
        assert_eq!(ByteSize::new(16 << 30).to_string(), "16 GiB");
        assert_eq!(ByteSize::new(1000).to_string(), "1 KB");
        assert_eq!(ByteSize::new(1023).to_string(), "1023 B");
        assert_eq!(
            ByteSize::new(u64::MAX).to_string(),
            "18446744073709551615 B"
        );
        let budget = ByteSize::parse("200MiB").unwrap();
        assert_eq!(budget.in_unit_of(1 << 30), "1024 MiB");
        assert_eq!(budget.in_unit_of(3000), "0.003 MiB");
        assert_eq!(budget.in_unit_of(300), "< 0.001 MiB");
        assert_eq!(budget.in_unit_of(0), "0 MiB");
        // A least budget never reads as the budget it exceeds.
        assert_eq!(budget.in_unit_of_at_least((200 << 20) + 1), "200.001 MiB");
        assert_eq!(budget.written_at_least((1 << 20) + 1), "\"1.001MiB\"");
        assert_eq!(
            ByteSize::parse("1000").unwrap().written_at_least(1001),
            "\"1001\""
        );
    }

    #[test]
    fn host_budgets_parse_auto_or_a_size() {
        assert_eq!(HostBudget::parse("auto"), Ok(HostBudget::Auto));
        assert_eq!(
            HostBudget::parse("8GiB"),
            Ok(HostBudget::Bytes(ByteSize::new(8 << 30)))
        );
        for bad in ["", "Auto", "0", "-1GiB", "8 gigs"] {
            let e = HostBudget::parse(bad).unwrap_err();
            assert!(
                e.contains("MemAvailable") && e.contains("allowed"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn device_budgets_parse_auto_or_a_size() {
        assert_eq!(DeviceBudget::parse("auto"), Ok(DeviceBudget::Auto));
        assert_eq!(
            DeviceBudget::parse("16GiB"),
            Ok(DeviceBudget::Bytes(ByteSize::new(16 << 30)))
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
