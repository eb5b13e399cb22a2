//! [`Secret`]: the job's rendezvous secret (`OFFLOAD_DIST_SECRET`), the
//! HMAC-SHA256 proofs made with it, and the random nonces they cover.

use std::fmt;
use std::io::Read;

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::DistError;

/// The variable that holds the job's secret. `offload-launch` sets it to
/// a fresh random value for its ranks; under torchrun, set it yourself to
/// the same value on every rank (e.g. `openssl rand -hex 32`).
pub const SECRET_VAR: &str = "OFFLOAD_DIST_SECRET";

/// The shortest secret accepted, in bytes.
pub const MIN_SECRET_BYTES: usize = 16;
/// The longest secret accepted, in bytes.
pub const MAX_SECRET_BYTES: usize = 1024;

/// Bytes of a nonce and of a proof (HMAC-SHA256).
pub(crate) const NONCE_LEN: usize = 32;
pub(crate) const MAC_LEN: usize = 32;

const ALLOWED: &str = "16 to 1024 bytes, the same on every rank (offload-launch makes one; under torchrun e.g. `openssl rand -hex 32`)";

/// A job's rendezvous secret: every hello proves it (HMAC-SHA256 over the
/// hello and a nonce of rank 0), and rank 0's answer proves it back. Its
/// `Debug` never shows the bytes.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes, redacted)", self.0.len())
    }
}

impl Secret {
    /// A secret from `bytes`: 16 to 1024 of them.
    pub fn new(bytes: impl Into<Vec<u8>>) -> Result<Self, DistError> {
        let bytes = bytes.into();
        let reason = if bytes.len() < MIN_SECRET_BYTES {
            Some(format!("{} bytes is too short", bytes.len()))
        } else if bytes.len() > MAX_SECRET_BYTES {
            Some(format!("{} bytes is too long", bytes.len()))
        } else {
            None
        };
        match reason {
            Some(reason) => Err(DistError::InvalidVar {
                var: SECRET_VAR,
                value: "(redacted)".to_owned(),
                reason,
                allowed: ALLOWED.to_owned(),
            }),
            None => Ok(Self(bytes)),
        }
    }

    /// A fresh random secret (32 bytes from the OS, as 64 hex digits so it
    /// travels in an environment variable).
    pub fn generate() -> Result<Self, DistError> {
        let bytes: [u8; 32] = random_bytes()?;
        Ok(Self(hex(&bytes).into_bytes()))
    }

    /// The secret as the text to put in [`SECRET_VAR`] (what
    /// [`Self::generate`] made; a secret given as bytes that are not
    /// UTF-8 comes out lossily).
    pub fn to_env_value(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    /// `OFFLOAD_DIST_SECRET` from the process environment: `None` where it
    /// is unset (the rendezvous is then open, and says so once).
    pub fn from_env() -> Result<Option<Self>, DistError> {
        use std::os::unix::ffi::OsStringExt;
        Self::from_value(std::env::var_os(SECRET_VAR).map(OsStringExt::into_vec))
    }

    /// The secret from a variable's value (`None`: unset). Set but empty,
    /// too short or too long is an error naming the variable.
    pub fn from_value(value: Option<Vec<u8>>) -> Result<Option<Self>, DistError> {
        match value {
            None => Ok(None),
            Some(v) if v.is_empty() => Err(DistError::InvalidVar {
                var: SECRET_VAR,
                value: String::new(),
                reason: "set but empty".to_owned(),
                allowed: format!("{ALLOWED}, or unset for an open rendezvous"),
            }),
            Some(v) => Self::new(v).map(Some),
        }
    }

    fn key(&self) -> &[u8] {
        &self.0
    }
}

/// The key of a proof: the secret, or the empty key of an open
/// rendezvous (anyone can make that proof: it only catches corruption).
pub(crate) fn key(secret: Option<&Secret>) -> &[u8] {
    secret.map_or(&[], Secret::key)
}

/// HMAC-SHA256 under `key` over `parts`, one after the other.
pub(crate) fn mac(key: &[u8], parts: &[&[u8]]) -> Result<[u8; MAC_LEN], DistError> {
    let mut m = new_mac(key).ok_or_else(|| DistError::Usage {
        what: format!("an HMAC key of {} bytes", key.len()),
        allowed: ALLOWED.to_owned(),
    })?;
    for p in parts {
        m.update(p);
    }
    Ok(m.finalize().into_bytes().into())
}

/// Whether `proof` is HMAC-SHA256 under `key` over `parts`, compared in
/// constant time (`hmac`'s `verify_slice`).
pub(crate) fn verify(key: &[u8], parts: &[&[u8]], proof: &[u8]) -> bool {
    let Some(mut m) = new_mac(key) else {
        return false;
    };
    for p in parts {
        m.update(p);
    }
    m.verify_slice(proof).is_ok()
}

/// HMAC takes a key of any length (a longer one is hashed first), so this
/// is always `Some`; the `Option` only keeps the code free of panics.
fn new_mac(key: &[u8]) -> Option<Hmac<Sha256>> {
    <Hmac<Sha256> as Mac>::new_from_slice(key).ok()
}

/// `N` random bytes from the OS (`/dev/urandom`).
pub(crate) fn random_bytes<const N: usize>() -> Result<[u8; N], DistError> {
    let mut b = [0u8; N];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut b))
        .map_err(|source| DistError::Io {
            what: "reading random bytes from /dev/urandom".to_owned(),
            source,
        })?;
    Ok(b)
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}
