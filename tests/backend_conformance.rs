//! The conformance harness the CUDA backend is checked with, run here on the CPU backend with
//! one thread against the two-thread reference (the partitions differ, so this also shows the
//! results do not depend on the thread count beyond f32 rounding; in practice they are
//! bit-identical, because every reduction uses fixed blocks independent of the thread count).

use birdtrain::backend::conformance::{check_network, check_ops, compare, Tolerance};
use birdtrain::backend::cpu::CpuBackend;
use birdtrain::backend::BackendError;
use birdtrain::model::Arch;

#[test]
fn cpu_one_thread_conforms_op_by_op() {
    let reports = check_ops(&CpuBackend::new(1).unwrap(), Tolerance::F32).unwrap();
    assert!(reports.len() > 50, "{} checks", reports.len());
    for r in &reports {
        eprintln!("{r}");
        assert!(r.worst_ratio <= 1.0);
    }
}

#[test]
fn cpu_one_thread_conforms_on_whole_steps() {
    for (arch, size) in [(Arch::ResNet8, 16), (Arch::ResNet18, 32)] {
        let reports =
            check_network(CpuBackend::new(1).unwrap(), arch, size, 3, Tolerance::F32).unwrap();
        let worst = reports.iter().fold(0.0f32, |m, r| m.max(r.worst_ratio));
        eprintln!("{arch}: {} checks, worst err/tol {worst:.3}", reports.len());
        assert!(
            reports.len() > graph_params(arch),
            "one report per gradient at least"
        );
    }
}

fn graph_params(arch: Arch) -> usize {
    birdtrain::model::Graph::new(arch, 10).params().len()
}

#[test]
fn compare_reports_the_first_element_out_of_tolerance() {
    let tol = Tolerance {
        atol: 1e-3,
        rtol: 1e-2,
    };
    let ok = compare("x", &[1.0, 2.0], &[1.005, 2.0], tol).unwrap();
    assert!(ok.worst_ratio > 0.0 && ok.worst_ratio <= 1.0);
    let err = compare("conv_forward k3", &[1.0, 2.0], &[1.0, 2.1], tol).unwrap_err();
    assert!(matches!(err, BackendError::Mismatch { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains("conv_forward k3") && msg.contains("element 1"),
        "{msg}"
    );
    assert!(compare("nan", &[f32::NAN], &[0.0], tol).is_err());
    assert!(compare("len", &[0.0], &[0.0, 1.0], tol).is_err());
}
