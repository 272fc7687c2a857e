//! NVRTC compilation of every kernel, the on-disk cache and the error paths. Needs libnvrtc
//! (scripts/test.sh installs it); without it each test prints why it skipped. No GPU needed.

use birdtrain::cli::kernels::check;
use birdtrain::cuda::{
    self, CudaError, GpuArch, KernelCache, KernelCompiler, KernelFile, KERNEL_FILES,
};

/// The CUDA include folder, or `None` (with the reason printed) when NVRTC is not installed.
fn nvrtc_include() -> Option<std::path::PathBuf> {
    if let Err(e) = cuda::library::require_nvrtc() {
        eprintln!("skipped: {e}");
        return None;
    }
    cuda::nvrtc::version().expect("nvrtc loads");
    Some(
        cuda::nvrtc::find_include()
            .expect("CUDA headers next to NVRTC (run `. scripts/cuda-env.sh`)"),
    )
}

#[test]
fn every_kernel_file_compiles_for_sm80_sm90_and_sm90a() {
    if nvrtc_include().is_none() {
        return;
    }
    let mut seen = Vec::new();
    let lines = check(&GpuArch::DEFAULT_CHECK, |line| seen.push(line.to_string())).unwrap();
    assert_eq!(
        lines.len(),
        KERNEL_FILES.len() * GpuArch::DEFAULT_CHECK.len()
    );
    assert_eq!(seen.len(), lines.len());
    for line in &lines {
        assert!(
            line.kernels > 0 && line.ptx_bytes > 0 && line.cubin_bytes > 0,
            "{line}"
        );
    }
    // The PTX really holds every kernel the file declares.
    let include = nvrtc_include().unwrap();
    for &file in KERNEL_FILES {
        let built = cuda::nvrtc::compile_file(file, GpuArch::new(9, 0), &include).unwrap();
        for name in &built.kernels {
            assert!(
                built.image.ptx.contains(&format!(".entry {name}(")),
                "{name} missing from {}",
                file.name
            );
        }
    }
}

#[test]
fn second_build_hits_the_disk_cache() {
    let Some(include) = nvrtc_include() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let compiler =
        KernelCompiler::new(include, "none".into(), Some(KernelCache::new(dir.path()))).unwrap();
    let file = KernelFile::by_name("pool.cu").unwrap();
    let arch = GpuArch::new(8, 0);
    let first = compiler.build(file, arch).unwrap();
    assert!(!first.from_cache);
    let second = compiler.build(file, arch).unwrap();
    assert!(second.from_cache);
    assert_eq!(first.image, second.image);
    // Another architecture is another key: compiled, not served from the sm_80 entry.
    let other = compiler.build(file, GpuArch::new(9, 0)).unwrap();
    assert!(!other.from_cache);
    assert_ne!(
        compiler.key(file, arch),
        compiler.key(file, GpuArch::new(9, 0))
    );
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 2);
}

#[test]
fn syntax_error_reports_the_compiler_log() {
    let Some(include) = nvrtc_include() else {
        return;
    };
    let source = "extern \"C\" __global__ void broken(float* x) { x[0] = undeclared_name; }";
    let err = cuda::nvrtc::compile("broken.cu", source, GpuArch::new(8, 0), &include).unwrap_err();
    match &err {
        CudaError::Compile {
            file, arch, log, ..
        } => {
            assert_eq!(file, "broken.cu");
            assert_eq!(arch, "sm_80");
            assert!(log.contains("undeclared_name"), "log: {log}");
        }
        other => panic!("expected a compile error, got {other}"),
    }
    assert!(err.to_string().contains("undeclared_name"));
}

#[test]
fn missing_headers_name_the_searched_folders() {
    let dir = tempfile::tempdir().unwrap();
    let err = cuda::nvrtc::find_include_in(&[dir.path().to_path_buf()]).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("cuda_bf16.h") && text.contains(&dir.path().display().to_string()),
        "{text}"
    );
    assert!(text.contains("BIRDTRAIN_CUDA_INCLUDE"), "{text}");
}

#[test]
fn missing_nvrtc_gives_install_instructions() {
    let err =
        cuda::library::require_nvrtc_from(&["libnvrtc-bogus-for-test.so.13".into()]).unwrap_err();
    assert!(matches!(err, CudaError::NvrtcMissing { .. }));
    let text = err.to_string();
    assert!(
        text.contains("bash scripts/install-cuda-tools.sh && . scripts/cuda-env.sh"),
        "{text}"
    );
    assert!(text.contains("nvidia-cuda-nvrtc==13.0.88"), "{text}");
}

#[test]
fn kernels_check_rejects_bad_architectures() {
    use birdtrain::cli::kernels::{run, KernelsArgs};
    let err = run(KernelsArgs {
        arch: "sm80".into(),
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("sm80") && err.contains("sm_80"), "{err}");
    assert!(
        run(KernelsArgs {
            arch: "sm_70".into()
        })
        .is_err(),
        "pre-Ampere has no bf16 mma"
    );
    assert!(run(KernelsArgs { arch: ",".into() }).is_err());
}
