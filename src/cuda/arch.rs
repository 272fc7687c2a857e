//! GPU architectures (`sm_80`, `sm_90`) as NVRTC targets.

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
}

impl GpuArch {
    /// The oldest architecture the kernels support: `mma.sync` with bf16 needs sm_80.
    pub const MIN: GpuArch = GpuArch { major: 8, minor: 0 };

    /// The architectures `kernels check` compiles for when `--arch` is not given.
    pub const DEFAULT_CHECK: [GpuArch; 2] = [
        GpuArch { major: 8, minor: 0 },
        GpuArch { major: 9, minor: 0 },
    ];

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
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

impl FromStr for GpuArch {
    type Err = CudaError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let bad = || CudaError::BadArch {
            value: value.to_string(),
        };
        let digits = value.strip_prefix("sm_").ok_or_else(bad)?;
        if digits.len() < 2 || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let (major, minor) = digits.split_at(digits.len() - 1);
        let arch = GpuArch {
            major: major.parse().map_err(|_| bad())?,
            minor: minor.parse().map_err(|_| bad())?,
        };
        if arch < GpuArch::MIN {
            return Err(CudaError::Unsupported {
                what: format!("{arch}: the bf16 tensor-core kernels need sm_80 or newer"),
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
            GpuArch::parse_list("sm_80, sm_90").unwrap(),
            GpuArch::DEFAULT_CHECK.to_vec()
        );
        assert_eq!(
            "sm_120".parse::<GpuArch>().unwrap(),
            GpuArch {
                major: 12,
                minor: 0
            }
        );
        assert_eq!(
            GpuArch { major: 9, minor: 0 }.nvrtc_option(),
            "--gpu-architecture=sm_90"
        );
    }

    #[test]
    fn rejects_bad_and_old_architectures() {
        for bad in ["80", "sm80", "sm_", "sm_8x", "compute_80"] {
            assert!(
                matches!(bad.parse::<GpuArch>(), Err(CudaError::BadArch { .. })),
                "{bad}"
            );
        }
        assert!(matches!(
            "sm_75".parse::<GpuArch>(),
            Err(CudaError::Unsupported { .. })
        ));
    }
}
