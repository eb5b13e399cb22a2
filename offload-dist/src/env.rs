//! [`DistEnv`]: the process's place in the group, from the variables
//! torchrun sets (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `MASTER_ADDR`,
//! `MASTER_PORT`).

use crate::DistError;

/// The largest `WORLD_SIZE` accepted.
pub const MAX_WORLD_SIZE: u32 = 65_536;

/// One process's place in a distributed group, as torchrun describes it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DistEnv {
    /// `RANK`: this process, `0..world_size`.
    pub rank: u32,
    /// `WORLD_SIZE`: the number of processes, `1..=MAX_WORLD_SIZE`.
    pub world_size: u32,
    /// `LOCAL_RANK`: this process's index on its host (its GPU).
    pub local_rank: u32,
    /// `MASTER_ADDR`: rank 0's host name or address.
    pub master_addr: String,
    /// `MASTER_PORT`: the rendezvous port on rank 0's host, `1..=65535`.
    pub master_port: u16,
}

impl DistEnv {
    /// Reads the process environment. A value that is not UTF-8 is read
    /// lossily and then rejected as invalid.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_vars(|name| std::env::var_os(name).map(|v| v.to_string_lossy().into_owned()))
    }

    /// Reads the variables through `var` (`None`: not set). Checks, in
    /// order: `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`,
    /// `MASTER_PORT`; the first problem is the error.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        let world_allowed = format!("an integer from 1 to {MAX_WORLD_SIZE}");
        let world_size = number("WORLD_SIZE", &var, &world_allowed)?;
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(DistError::InvalidVar {
                var: "WORLD_SIZE",
                value: world_size.to_string(),
                reason: "out of range".to_owned(),
                allowed: world_allowed,
            });
        }
        let in_world = format!(
            "an integer from 0 to {} (below WORLD_SIZE={world_size})",
            world_size - 1
        );
        let rank = number("RANK", &var, &in_world)?;
        if rank >= world_size {
            return Err(DistError::RankOutOfRange { rank, world_size });
        }
        let local_allowed = format!("{in_world}: the process's index on its host");
        let local_rank = number("LOCAL_RANK", &var, &local_allowed)?;
        if local_rank >= world_size {
            return Err(DistError::InvalidVar {
                var: "LOCAL_RANK",
                value: local_rank.to_string(),
                reason: "not below WORLD_SIZE".to_owned(),
                allowed: local_allowed,
            });
        }
        let master_addr = master_addr(&var)?;
        let master_port = master_port(&var)?;
        Ok(Self {
            rank,
            world_size,
            local_rank,
            master_addr,
            master_port,
        })
    }

    /// `MASTER_ADDR:MASTER_PORT`, with an IPv6 address in brackets.
    pub fn master_endpoint(&self) -> String {
        endpoint(&self.master_addr, self.master_port)
    }
}

/// `host:port`, with an IPv6 address in brackets.
pub(crate) fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

fn get(
    name: &'static str,
    var: &impl Fn(&str) -> Option<String>,
    allowed: &str,
) -> Result<String, DistError> {
    var(name).ok_or_else(|| DistError::MissingVar {
        var: name,
        allowed: allowed.to_owned(),
    })
}

fn number(
    name: &'static str,
    var: &impl Fn(&str) -> Option<String>,
    allowed: &str,
) -> Result<u32, DistError> {
    let value = get(name, var, allowed)?;
    parse_number(name, &value, allowed)
}

fn parse_number<T: std::str::FromStr>(
    name: &'static str,
    value: &str,
    allowed: &str,
) -> Result<T, DistError> {
    let invalid = |reason: &str| DistError::InvalidVar {
        var: name,
        value: value.to_owned(),
        reason: reason.to_owned(),
        allowed: allowed.to_owned(),
    };
    if value.is_empty() {
        return Err(invalid("empty"));
    }
    if !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(invalid("not a non-negative decimal integer"));
    }
    value.parse().map_err(|_| invalid("out of range"))
}

fn master_addr(var: &impl Fn(&str) -> Option<String>) -> Result<String, DistError> {
    const ALLOWED: &str = "the host name or IP address of rank 0's host (1 to 253 characters, no spaces), e.g. 127.0.0.1";
    let value = get("MASTER_ADDR", var, ALLOWED)?;
    let reason = if value.is_empty() {
        Some("empty")
    } else if value.len() > 253 {
        Some("longer than 253 characters")
    } else if value.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some("contains whitespace or control characters")
    } else {
        None
    };
    match reason {
        Some(reason) => Err(DistError::InvalidVar {
            var: "MASTER_ADDR",
            value,
            reason: reason.to_owned(),
            allowed: ALLOWED.to_owned(),
        }),
        None => Ok(value),
    }
}

fn master_port(var: &impl Fn(&str) -> Option<String>) -> Result<u16, DistError> {
    const ALLOWED: &str = "a TCP port from 1 to 65535";
    let value = get("MASTER_PORT", var, ALLOWED)?;
    let port: u16 = parse_number("MASTER_PORT", &value, ALLOWED)?;
    if port == 0 {
        return Err(DistError::InvalidVar {
            var: "MASTER_PORT",
            value,
            reason: "port 0 cannot be connected to".to_owned(),
            allowed: ALLOWED.to_owned(),
        });
    }
    Ok(port)
}
