//! The rendezvous address, `host:port`, and how a flag or variable gives it.

use std::fmt;

use super::LaunchError;

/// A rendezvous address, `host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MasterAddr {
    /// Host name or IP address (IPv6 without brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
}

impl MasterAddr {
    /// Parses `host:port` or `[v6addr]:port`.
    pub fn parse(value: &str, source_name: &'static str) -> Result<Self, LaunchError> {
        let bad = |reason| LaunchError::InvalidMaster {
            value: value.to_string(),
            source_name,
            reason,
        };
        let (host, port) = value.rsplit_once(':').ok_or_else(|| bad("no port"))?;
        let host = host
            .strip_prefix('[')
            .and_then(|h| h.strip_suffix(']'))
            .unwrap_or(host);
        if host.is_empty() {
            return Err(bad("empty host"));
        }
        let port: u16 = port
            .parse()
            .map_err(|_| bad("the port is not a number 1-65535"))?;
        if port == 0 {
            return Err(bad("port 0 cannot be connected to"));
        }
        Ok(MasterAddr {
            host: host.to_string(),
            port,
        })
    }
}

impl fmt::Display for MasterAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}
