//! `birdtrain env`: the report of what the binary finds, and the library discovery behind it
//! run end to end in a real process: NVRTC (with its builtins) and the CUDA headers found in
//! a pip-wheel layout through `python3`'s site-packages alone, with no `LD_LIBRARY_PATH`,
//! `CUDA_HOME` or header variable, as on a machine where PyTorch brought NVIDIA's wheels.

use crate::cli_support;

use std::path::{Path, PathBuf};
use std::process::Command;

use cli_support::{assert_no_panic, birdtrain, s};
use serde_json::Value;

fn json(out: &std::process::Output) -> Value {
    serde_json::from_slice(&out.stdout).expect("env --json prints one JSON object")
}

/// A usable part has no error; an unusable one has one line saying why.
fn assert_consistent(what: &str, part: &Value) {
    let ok = part["ok"].as_bool().expect("ok is a bool");
    let error = part["error"].as_str();
    if ok {
        assert!(error.is_none(), "{what}: usable but with an error: {part}");
    } else {
        let error = error.unwrap_or_else(|| panic!("{what}: unusable without a reason: {part}"));
        assert!(
            !error.is_empty() && !error.contains('\n'),
            "{what}: {error:?}"
        );
    }
}

#[test]
fn env_reports_every_part_in_json_and_as_a_table() {
    let report = json(&birdtrain(&["env", "--json"]));
    assert_eq!(report["birdtrain"], env!("CARGO_PKG_VERSION"));
    assert!(report["cpu"]["threads"].as_u64().unwrap() >= 1, "{report}");
    let simd = report["cpu"]["simd"].as_str().unwrap();
    assert!(
        ["portable", "avx2", "avx512"].contains(&simd),
        "unknown vector level {simd:?}"
    );
    for part in ["driver", "nvrtc", "cuda_headers", "kernel_compile", "nccl"] {
        assert_consistent(part, &report[part]);
    }
    let gpus = report["gpus"].as_array().unwrap();
    if report["driver"]["ok"] == false {
        assert!(gpus.is_empty(), "GPUs listed without a driver: {report}");
        assert!(
            report["driver"]["error"]
                .as_str()
                .unwrap()
                .contains("--gpus 0"),
            "{report}"
        );
    }
    // The compile probe runs exactly when NVRTC and its headers were found.
    assert_eq!(
        report["kernel_compile"]["ok"], report["cuda_headers"]["ok"],
        "{report}"
    );

    let text = String::from_utf8(birdtrain(&["env"]).stdout).unwrap();
    for row in [
        "birdtrain",
        "cpu",
        "cuda driver",
        "nvrtc",
        "cuda headers",
        "kernel compile",
        "nccl",
        "kernel cache",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(row)),
            "row `{row}` missing:\n{text}"
        );
    }
}

/// The pip install of NVRTC that `scripts/install-cuda-tools.sh` makes: a site-packages-like
/// folder holding `nvidia/cu13/lib/libnvrtc.so.13` and `nvidia/cu13/include/cuda_bf16.h`.
fn wheel_site() -> Option<PathBuf> {
    let site = Path::new(env!("CARGO_MANIFEST_DIR")).join(".tools/cuda");
    let lib = site.join("nvidia/cu13/lib/libnvrtc.so.13");
    (lib.is_file() && site.join("nvidia/cu13/include/cuda_bf16.h").is_file()).then_some(site)
}

/// `birdtrain env --json` in an environment with none of the CUDA variables, whose `python3`
/// reports `site` as its only site-packages folder.
fn env_with_python_site(tmp: &Path, site: &Path) -> Value {
    let bin = tmp.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let python = bin.join("python3");
    std::fs::write(&python, format!("#!/bin/sh\necho '{}'\n", s(site))).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&python, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let args = ["env", "--json"];
    let out = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(args)
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("BIRDTRAIN_CUDA_INCLUDE")
        .env_remove("CUDA_HOME")
        .env_remove("CUDA_PATH")
        .env("PATH", format!("{}:/usr/bin:/bin", s(&bin)))
        .output()
        .expect("the birdtrain binary runs");
    assert_no_panic(&args, &out);
    assert!(out.status.success(), "{out:?}");
    json(&out)
}

#[test]
fn nvrtc_and_headers_are_found_in_python3_site_packages_without_any_variable() {
    let Some(site) = wheel_site() else {
        eprintln!("skipped: .tools/cuda has no NVRTC wheel (scripts/install-cuda-tools.sh)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();

    // With an empty site-packages, NVRTC must be missing, or this machine has it elsewhere
    // (a system toolkit) and the site-packages search cannot be told apart.
    let empty = tmp.path().join("empty-site");
    std::fs::create_dir_all(&empty).unwrap();
    let without = env_with_python_site(tmp.path(), &empty);
    if without["nvrtc"]["ok"] == true {
        eprintln!("skipped: NVRTC loads without the site-packages search on this machine");
        return;
    }
    let error = without["nvrtc"]["error"].as_str().unwrap();
    assert!(
        error.contains("python3 site-packages") && error.contains(s(&empty)),
        "the error names the site-packages folders searched: {error}"
    );
    let nccl = without["nccl"]["error"].as_str().unwrap_or_default();
    if without["nccl"]["ok"] == false {
        assert!(
            nccl.contains(&format!("{}/nvidia/nccl/lib", s(&empty))),
            "NCCL's error names the wheel folder it looked in: {nccl}"
        );
    }

    let with = env_with_python_site(tmp.path(), &site);
    assert_eq!(with["nvrtc"]["ok"], true, "{with}");
    let lib = with["nvrtc"]["path"].as_str().unwrap();
    assert!(
        lib.starts_with(s(&site)) && lib.contains("nvidia/cu13/lib/libnvrtc.so"),
        "NVRTC loaded from the wheel: {lib}"
    );
    let headers = with["cuda_headers"]["path"].as_str().unwrap();
    assert!(
        Path::new(headers).join("cuda_bf16.h").is_file() && headers.starts_with(s(&site)),
        "headers next to the wheel's NVRTC: {headers}"
    );
    // Compiling needs libnvrtc-builtins, which libnvrtc opens by bare name.
    assert_eq!(with["kernel_compile"]["ok"], true, "{with}");
}
