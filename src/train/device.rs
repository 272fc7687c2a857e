//! Which device trains: `--gpus N|all`, with the CPU as the default when no GPU exists.

/// Where a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU reference backend (`--gpus 0`).
    Cpu,
    /// This many CUDA devices of this machine.
    Cuda(usize),
}

/// The CUDA devices present, or why there are none (no driver library, driver error).
///
/// The driver is loaded dynamically, so a machine without CUDA answers `Err` instead of
/// failing to start.
pub fn cuda_device_count() -> Result<usize, String> {
    // SAFETY: only probes whether the driver library can be opened; loads nothing else.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err("no CUDA driver library (libcuda) on this machine".into());
    }
    // The driver library exists; a failing init is reported, never unwrapped.
    match crate::panics::catch_expected(cudarc::driver::CudaContext::device_count) {
        Ok(Ok(n)) => Ok(n.max(0) as usize),
        Ok(Err(e)) => Err(format!("the CUDA driver reports {e}")),
        Err(_) => Err("the CUDA driver library could not be used".into()),
    }
}

impl DeviceChoice {
    /// Resolves `--gpus`: `None` picks every GPU present or, with none, the CPU (and says so
    /// in the returned note); `Some(0)` is the CPU; `Some(n)` needs n devices; `all` is every
    /// device (at least one).
    pub fn resolve(gpus: Option<&str>) -> Result<(Self, Option<String>), super::TrainError> {
        let count = cuda_device_count();
        let found = *count.as_ref().unwrap_or(&0);
        let why = match &count {
            Ok(_) => String::new(),
            Err(reason) => format!("; {reason}"),
        };
        let not_enough = |requested: &str| super::TrainError::NotEnoughGpus {
            requested: requested.to_string(),
            found,
            extra: why.clone(),
        };
        match gpus.map(str::trim) {
            None => {
                if found == 0 {
                    Ok((
                        Self::Cpu,
                        Some(format!("no GPU found{why}: training on the CPU (--gpus 0)")),
                    ))
                } else {
                    Ok((Self::Cuda(found), None))
                }
            }
            Some("all") => {
                if found == 0 {
                    Err(not_enough("all"))
                } else {
                    Ok((Self::Cuda(found), None))
                }
            }
            Some(text) => {
                let n: usize = text.parse().map_err(|_| super::TrainError::InvalidConfig {
                    flag: "--gpus",
                    value: text.to_string(),
                    hint: "a number of GPUs (0 = CPU) or `all`".into(),
                })?;
                if n == 0 {
                    Ok((Self::Cpu, None))
                } else if n > found {
                    Err(not_enough(text))
                } else {
                    Ok((Self::Cuda(n), None))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpus_flag_values() {
        assert_eq!(
            DeviceChoice::resolve(Some("0")).unwrap().0,
            DeviceChoice::Cpu
        );
        let err = DeviceChoice::resolve(Some("two")).unwrap_err().to_string();
        assert!(err.contains("--gpus") && err.contains("two"), "{err}");
        let found = cuda_device_count().unwrap_or(0);
        let err = DeviceChoice::resolve(Some(&(found + 1).to_string()))
            .unwrap_err()
            .to_string();
        assert!(err.contains("--gpus 0 trains on the CPU"), "{err}");
        if found == 0 {
            let (choice, note) = DeviceChoice::resolve(None).unwrap();
            assert_eq!(choice, DeviceChoice::Cpu);
            assert!(note.unwrap().contains("training on the CPU"));
            let err = DeviceChoice::resolve(Some("all")).unwrap_err().to_string();
            assert!(err.starts_with("--gpus all:"), "{err}");
        }
    }
}
