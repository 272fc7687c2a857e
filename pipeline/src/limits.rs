//! What this machine can sanely be asked for: cores, decode threads, memory. The builder
//! checks its settings against these, and so does birdtrain's command line for its own flags,
//! so an absurd count is a clear error instead of a hang, a panic or an out-of-memory kill.

/// Decode threads allowed per available core. Decoding is CPU work, but reading from slow
/// network storage can leave threads waiting, so a few per core are still useful.
pub const WORKERS_PER_CORE: usize = 8;

/// Cores this process may use (cgroup quotas and affinity included), at least 1.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// The most decode threads a pipeline accepts: [`WORKERS_PER_CORE`] per core.
pub fn max_workers() -> usize {
    WORKERS_PER_CORE * cores()
}

/// Bytes of memory this process can still take: the kernel's `MemAvailable`, lowered to
/// what the cgroup (v2 or v1) limit leaves. `None` where neither can be read.
pub fn available_memory() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok();
    let system = meminfo.as_deref().and_then(|text| {
        text.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|rest| {
                rest.trim()
                    .trim_end_matches("kB")
                    .trim()
                    .parse::<u64>()
                    .ok()
            })
            .map(|kib| kib * 1024)
    });
    let read = |path: &str| -> Option<u64> {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u64>().ok())
    };
    let cgroup = match (
        read("/sys/fs/cgroup/memory.max"),
        read("/sys/fs/cgroup/memory.current"),
    ) {
        (Some(max), Some(current)) => Some(max.saturating_sub(current)),
        _ => match (
            read("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
            read("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
        ) {
            // v1 reports "no limit" as a huge number; min() below makes it harmless.
            (Some(limit), Some(usage)) => Some(limit.saturating_sub(usage)),
            _ => None,
        },
    };
    match (system, cgroup) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// A byte count for people: `1.5 GiB`, `640 KiB`.
pub fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_machine_reports_cores_and_memory() {
        assert!(cores() >= 1);
        assert_eq!(max_workers(), WORKERS_PER_CORE * cores());
        let memory = available_memory().expect("Linux has /proc/meminfo");
        assert!(memory > 16 << 20, "{memory}");
    }

    #[test]
    fn human_bytes_picks_a_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_bytes(3 << 40), "3.0 TiB");
    }
}
