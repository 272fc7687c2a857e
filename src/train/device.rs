//! Which device trains: the launch plan's GPUs, or the CPU when it has none. The plan comes
//! from the `--gpus` flag, the launcher's variables and the GPUs the one probe found
//! ([`crate::dist::launch::resolve`] over [`crate::dist::launch::probe_gpus`]), so the choice
//! is a pure function of the flag and the devices found.

use crate::dist::launch::LaunchPlan;

/// Where a run computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceChoice {
    /// The CPU reference backend (`--gpus 0`).
    Cpu,
    /// This many CUDA devices of this machine.
    Cuda(usize),
}

impl DeviceChoice {
    /// Where the run of a launch plan computes: its GPUs, or the CPU when it drives none.
    pub fn of_plan(plan: &LaunchPlan) -> Self {
        match plan.devices.len() {
            0 => Self::Cpu,
            n => Self::Cuda(n),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::launch::{resolve, Device, GpuCount, LaunchError, LaunchFlags, VisibleGpus};

    #[test]
    fn a_plan_without_devices_trains_on_the_cpu() {
        let plan = LaunchPlan::single_node(Vec::new());
        assert_eq!(DeviceChoice::of_plan(&plan), DeviceChoice::Cpu);
        let plan = LaunchPlan::single_node(vec![2]);
        assert_eq!(DeviceChoice::of_plan(&plan), DeviceChoice::Cuda(1));
    }

    /// The device flag against the devices found, both branches on any machine: the GPUs are
    /// given here, never asked of the driver.
    #[test]
    fn the_device_flag_resolves_against_the_gpus_found_with_or_without_any() {
        let found = |n: usize| {
            VisibleGpus::Listed(
                (0..n)
                    .map(|ordinal| Device {
                        ordinal,
                        name: "a GPU".into(),
                    })
                    .collect(),
            )
        };
        let none = VisibleGpus::Missing("no CUDA driver library".into());
        let choose = |gpus: Option<GpuCount>, visible: &VisibleGpus| {
            let flags = LaunchFlags {
                gpus,
                ..LaunchFlags::default()
            };
            resolve(&flags, &|_| None, visible).map(|plan| (DeviceChoice::of_plan(&plan), plan))
        };
        // GPUs found: no flag or `all` takes every one, a count the first N, 0 the CPU.
        let (device, plan) = choose(None, &found(2)).unwrap();
        assert_eq!((device, plan.devices), (DeviceChoice::Cuda(2), vec![0, 1]));
        assert_eq!(plan.cpu_fallback, None);
        assert_eq!(
            choose(Some(GpuCount::All), &found(3)).unwrap().0,
            DeviceChoice::Cuda(3)
        );
        assert_eq!(
            choose(Some(GpuCount::Count(1)), &found(2))
                .unwrap()
                .1
                .devices,
            vec![0]
        );
        assert_eq!(
            choose(Some(GpuCount::Count(0)), &found(2)).unwrap().0,
            DeviceChoice::Cpu
        );
        // None found: no flag falls back to the CPU and says why; asking for GPUs is refused.
        let (device, plan) = choose(None, &none).unwrap();
        assert_eq!(device, DeviceChoice::Cpu);
        let note = plan.cpu_fallback.unwrap();
        assert!(note.contains("no CUDA driver library"), "{note}");
        assert_eq!(
            choose(Some(GpuCount::Count(0)), &none).unwrap().0,
            DeviceChoice::Cpu
        );
        for asked in [GpuCount::All, GpuCount::Count(1)] {
            let e = choose(Some(asked), &none).unwrap_err();
            assert!(matches!(e, LaunchError::NoDevices { .. }), "{e}");
        }
        // More than found: refused, naming how many there are.
        let e = choose(Some(GpuCount::Count(3)), &found(2)).unwrap_err();
        assert!(
            matches!(
                e,
                LaunchError::TooManyGpus {
                    requested: 3,
                    present: 2,
                    ..
                }
            ),
            "{e}"
        );
    }
}
