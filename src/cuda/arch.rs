//! GPU architectures (`sm_80`, `sm_90`, and Hopper's architecture-specific `sm_90a`) as NVRTC
//! targets.

use std::fmt;
use std::str::FromStr;

use super::error::CudaError;

/// A real GPU architecture, compute capability `major.minor`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GpuArch {
    /// Compute capability major version (8 for A100, 9 for H100).
    pub major: u32,
    /// Compute capability minor version.
    pub minor: u32,
    /// The architecture-specific target (`sm_90a`): it adds the instructions of that chip
    /// alone (Hopper's `wgmma`, `setmaxnreg`), and its code runs on that compute capability
    /// only, where plain `sm_90` code also runs on later GPUs.
    pub specific: bool,
}

impl GpuArch {
    /// The oldest architecture the kernels support: `mma.sync` with bf16 needs sm_80.
    pub const MIN: GpuArch = GpuArch::new(8, 0);

    /// The first architecture with an architecture-specific target (`sm_90a`).
    const FIRST_SPECIFIC: u32 = 9;

    /// The architectures `kernels check` compiles for when `--arch` is not given: Ampere,
    /// Hopper, and Hopper's own target (what its `wgmma` kernels need).
    pub const DEFAULT_CHECK: [GpuArch; 3] = [
        GpuArch::new(8, 0),
        GpuArch::new(9, 0),
        GpuArch::specific(9, 0),
    ];

    /// Compute capability `major.minor`, the portable target.
    pub const fn new(major: u32, minor: u32) -> GpuArch {
        GpuArch {
            major,
            minor,
            specific: false,
        }
    }

    /// Compute capability `major.minor`, the architecture-specific target (`sm_90a`).
    pub const fn specific(major: u32, minor: u32) -> GpuArch {
        GpuArch {
            major,
            minor,
            specific: true,
        }
    }

    /// Whether this is Hopper's compute capability (9.0), the one whose `wgmma` and TMA the
    /// v3 convolutions use.
    pub fn is_hopper(self) -> bool {
        (self.major, self.minor) == (9, 0)
    }

    /// The NVRTC option that targets this architecture.
    pub fn nvrtc_option(self) -> String {
        format!("--gpu-architecture={self}")
    }

    /// Parses a comma-separated list such as `sm_80,sm_90`.
    pub fn parse_list(list: &str) -> Result<Vec<GpuArch>, CudaError> {
        list.split(',')
            .filter(|s| !s.trim().is_empty())
            .map(|s| s.trim().parse())
            .collect()
    }
}

impl fmt::Display for GpuArch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let suffix = if self.specific { "a" } else { "" };
        write!(f, "sm_{}{}{suffix}", self.major, self.minor)
    }
}

impl FromStr for GpuArch {
    type Err = CudaError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let bad = || CudaError::BadArch {
            value: value.to_string(),
        };
        let digits = value.strip_prefix("sm_").ok_or_else(bad)?;
        let (digits, specific) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        let arch = GpuArch {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
            specific,
        };
        if arch < GpuArch::MIN {
            return Err(CudaError::Unsupported {
                what: format!("{arch}: the bf16 tensor-core kernels need sm_80 or newer"),
            });
        }
        if specific && arch.major < GpuArch::FIRST_SPECIFIC {
            return Err(CudaError::Unsupported {
                what: format!(
                    "{arch}: architecture-specific targets begin with sm_90a (Hopper); use sm_{major}{minor}"
                ),
            });
        }
        Ok(arch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints_architectures() {
        assert_eq!(
            GpuArch::parse_list("sm_80, sm_90,sm_90a").unwrap(),
            GpuArch::DEFAULT_CHECK.to_vec()
        );
        assert_eq!("sm_120".parse::<GpuArch>().unwrap(), GpuArch::new(12, 0));
        assert_eq!(
            GpuArch::new(9, 0).nvrtc_option(),
            "--gpu-architecture=sm_90"
        );
        let hopper = "sm_90a".parse::<GpuArch>().unwrap();
        assert_eq!(hopper, GpuArch::specific(9, 0));
        assert_eq!(hopper.to_string(), "sm_90a");
        assert_eq!(hopper.nvrtc_option(), "--gpu-architecture=sm_90a");
        // Another target than plain sm_90, so another kernel cache key; the same chip.
        assert_ne!(hopper, GpuArch::new(9, 0));
        assert!(hopper >= GpuArch::MIN);
    }

    #[test]
    fn rejects_bad_and_old_architectures() {
        for bad in ["80", "sm80", "sm_", "sm_8x", "compute_80"] {
            assert!(
                matches!(bad.parse::<GpuArch>(), Err(CudaError::BadArch { .. })),
                "{bad}"
            );
        }
        for bad in ["sm_75", "sm_80a", "sm_86a"] {
            assert!(
                matches!(bad.parse::<GpuArch>(), Err(CudaError::Unsupported { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            "sm_9a".parse::<GpuArch>(),
            Err(CudaError::BadArch { .. })
        ));
    }
}
