//! What a GPU result that differs from the CPU's looks like, in one line a first run on a new
//! GPU can act on: how many elements are off, the first one as (row, column) of the GEMM
//! output, and where the bad ones sit in the 128 × 128 tiles (rows of the first or second
//! consumer warpgroup, the first or second 64 columns), whether the output was written at
//! all, and whether it is the CPU's transposed. A kernel that reads one operand with the wrong
//! descriptor, box order or shift shows a pattern here instead of one failing element.

/// A GPU output `gpu` against the CPU's `cpu`, both `rows × cols` row-major (the GEMM view:
/// pixels × channels for activations, output channels × (taps · input channels) for weight
/// gradients), element i allowed `tol + |cpu[i]|·eps`. `unwritten` is what the destination
/// held before the kernel ran, when it was one value (a kernel that never stored reads as it).
/// `Ok` when every element is within its bound, else the description.
pub(crate) fn check(
    gpu: &[f32],
    cpu: &[f32],
    (rows, cols): (usize, usize),
    (tol, eps): (f32, f32),
    unwritten: Option<f32>,
) -> Result<(), String> {
    if gpu.len() != cpu.len() || gpu.len() != rows * cols {
        return Err(format!(
            "lengths: gpu {}, cpu {}, {rows}×{cols} expected",
            gpu.len(),
            cpu.len()
        ));
    }
    let bad = |g: f32, c: f32| !g.is_finite() || (g - c).abs() > tol + c.abs() * eps;
    let mut count = 0usize;
    let mut first = None;
    // [first / second 64 rows of a 128-row tile][first / second 64 columns of a 128-column tile]
    let mut quadrants = [[0usize; 2]; 2];
    let (mut non_finite, mut as_before) = (0usize, 0usize);
    for (i, (&g, &c)) in gpu.iter().zip(cpu).enumerate() {
        if !bad(g, c) {
            continue;
        }
        let (r, col) = (i / cols, i % cols);
        count += 1;
        first.get_or_insert((r, col, g, c));
        quadrants[r % 128 / 64][col % 128 / 64] += 1;
        non_finite += usize::from(!g.is_finite());
        as_before += usize::from(unwritten.is_some_and(|u| g.to_bits() == u.to_bits()));
    }
    let Some((r, col, g, c)) = first else {
        return Ok(());
    };
    let mut line = format!(
        "{count} of {} elements off ({:.1} %), first at row {r} column {col}: gpu {g} vs cpu {c}; \
         by tile quarter (rows 0-63 | 64-127 × columns 0-63 | 64-127): {:?}",
        gpu.len(),
        100.0 * count as f64 / gpu.len() as f64,
        quadrants
    );
    if non_finite > 0 {
        line += &format!("; {non_finite} not finite");
    }
    if as_before > 0 {
        line += &format!("; {as_before} still hold the destination's old value (never written?)");
    }
    if gpu.iter().all(|&g| g == 0.0) {
        line += "; the output is all zeros";
    } else if rows == cols && transposed(gpu, cpu, rows, (tol, eps)) {
        line += "; it is the CPU's result transposed";
    }
    Err(line)
}

/// Whether `gpu` is `cpu` transposed (`n × n`), within the bounds.
fn transposed(gpu: &[f32], cpu: &[f32], n: usize, (tol, eps): (f32, f32)) -> bool {
    (0..n).all(|r| {
        (0..n).all(|c| {
            let (g, want) = (gpu[r * n + c], cpu[c * n + r]);
            g.is_finite() && (g - want).abs() <= tol + want.abs() * eps
        })
    })
}

/// The results of many checks, kept going past the first failure so one GPU run maps every
/// failing kernel and shape; reported together at the end.
#[derive(Default)]
pub(crate) struct Findings {
    lines: Vec<String>,
}

impl Findings {
    /// Records `what` (with the kernels that ran it) as passed or failed with its detail.
    pub(crate) fn record(&mut self, what: &str, kernels: &[&str], result: Result<(), String>) {
        let kernels = kernels.join(", ");
        match result {
            Ok(()) => self.lines.push(format!("PASS {what} [{kernels}]")),
            Err(detail) => self
                .lines
                .push(format!("FAIL {what} [{kernels}]: {detail}")),
        }
    }

    /// Prints every line, then panics naming the failures, if any.
    #[track_caller]
    pub(crate) fn finish(self, test: &str) {
        for line in &self.lines {
            println!("{test}: {line}");
        }
        let failures: Vec<&str> = self
            .lines
            .iter()
            .filter(|l| l.starts_with("FAIL"))
            .map(String::as_str)
            .collect();
        assert!(
            failures.is_empty(),
            "{test}: {} of {} checks failed:\n{}",
            failures.len(),
            self.lines.len(),
            failures.join("\n")
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BOUNDS: (f32, f32) = (1e-2, 1.0 / 128.0);

    fn matrix(rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|i| (i % 97) as f32 * 0.25 - 3.0)
            .collect()
    }

    #[test]
    fn equal_outputs_pass_and_small_differences_within_the_bound_too() {
        let cpu = matrix(130, 72);
        let mut gpu = cpu.clone();
        gpu[5] += 0.009;
        assert_eq!(check(&gpu, &cpu, (130, 72), BOUNDS, None), Ok(()));
    }

    #[test]
    fn a_wrong_second_warpgroup_shows_in_its_tile_quarter() {
        let (rows, cols) = (256, 128);
        let cpu = matrix(rows, cols);
        let mut gpu = cpu.clone();
        for r in (0..rows).filter(|r| r % 128 >= 64) {
            for c in 0..cols {
                gpu[r * cols + c] += 1.0;
            }
        }
        let line = check(&gpu, &cpu, (rows, cols), BOUNDS, None).unwrap_err();
        assert!(
            line.starts_with("16384 of 32768 elements off (50.0 %)"),
            "{line}"
        );
        assert!(line.contains("first at row 64 column 0"), "{line}");
        assert!(line.contains("[[0, 0], [8192, 8192]]"), "{line}");
    }

    #[test]
    fn unwritten_non_finite_zero_and_transposed_outputs_are_named() {
        let cpu = matrix(64, 64);
        let unwritten = vec![7.0; 64 * 64];
        let line = check(&unwritten, &cpu, (64, 64), BOUNDS, Some(7.0)).unwrap_err();
        assert!(
            line.contains("still hold the destination's old value"),
            "{line}"
        );
        let zeros = vec![0.0; 64 * 64];
        let line = check(&zeros, &cpu, (64, 64), BOUNDS, None).unwrap_err();
        assert!(line.ends_with("the output is all zeros"), "{line}");
        let mut nan = cpu.clone();
        nan[3] = f32::NAN;
        let line = check(&nan, &cpu, (64, 64), BOUNDS, None).unwrap_err();
        assert!(line.contains("1 not finite"), "{line}");
        let t: Vec<f32> = (0..64 * 64).map(|i| cpu[(i % 64) * 64 + i / 64]).collect();
        let line = check(&t, &cpu, (64, 64), BOUNDS, None).unwrap_err();
        assert!(
            line.ends_with("it is the CPU's result transposed"),
            "{line}"
        );
    }

    #[test]
    fn findings_keep_going_and_fail_at_the_end_with_every_failure() {
        let mut findings = Findings::default();
        findings.record("a", &["k1"], Ok(()));
        findings.record("b", &["k2"], Err("off".into()));
        findings.record("c", &["k3"], Err("also off".into()));
        let message =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| findings.finish("t")))
                .unwrap_err();
        let message = message.downcast_ref::<String>().unwrap();
        assert!(message.contains("2 of 3 checks failed"), "{message}");
        assert!(
            message.contains("FAIL b [k2]: off\nFAIL c [k3]: also off"),
            "{message}"
        );
    }
}
