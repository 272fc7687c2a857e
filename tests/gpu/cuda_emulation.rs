//! The CUDA kernels, executed without a GPU: g++ compiles each kernel file against the host
//! emulator in kernels/emu/ (threads, barriers, warp shuffles and the bf16 `mma.sync` fragment
//! layouts emulated) and checks every kernel against f64 references that follow the CPU
//! backend's rules. Catches indexing, tiling, masking and reduction bugs before a GPU session.
//! The v2 convolutions (conv2.cu) run with their cp.async pipeline emulated, and copies with
//! one index deliberately broken (the epilogues, the paired stem) must fail, so the check is
//! known to catch such bugs; the kernels that apply a batch norm as they load their input have
//! their own test against bn_apply followed by the plain kernels. The
//! Hopper kernels (conv3.cu) run with wgmma, TMA and mbarrier emulated (kernels/emu/hopper.h),
//! and copies with a missing wait or a wrong descriptor must fail.
//! Skips (printing why) when no C++20 compiler is installed.

use std::path::{Path, PathBuf};
use std::process::Command;

use birdtrain::cuda::sources::expand_common;
use birdtrain::cuda::{KernelFile, KERNEL_FILES};

const INCLUDE: &str = "#include \"common.cuh\"";

fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "g++".to_string())
}

/// Whether the compiler builds C++20 with <barrier> (the emulator needs it).
fn cxx20_available(dir: &Path) -> bool {
    let probe = dir.join("probe.cpp");
    std::fs::write(
        &probe,
        "#include <barrier>\nint main() { std::barrier b(1); b.arrive_and_wait(); }\n",
    )
    .unwrap();
    Command::new(compiler())
        .args(["-std=c++20", "-pthread", "-o"])
        .arg(dir.join("probe"))
        .arg(&probe)
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Compiles kernels/emu/`check`.cpp against the translation units in `dir` and runs it:
/// (whether it passed, its output).
fn build_and_try(dir: &Path, check: &str) -> (bool, String) {
    build_and_try_args(dir, check, &[])
}

/// [`build_and_try`] with arguments for the check program.
fn build_and_try_args(dir: &Path, check: &str, args: &[&str]) -> (bool, String) {
    let emu = Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu");
    let exe: PathBuf = dir.join(check);
    let out = Command::new(compiler())
        .args(["-std=c++20", "-O1", "-pthread", "-w", "-I"])
        .arg(dir)
        .arg(emu.join(format!("{check}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "{check} does not compile:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe)
        .args(args)
        .output()
        .expect("run the emulated kernels");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    (run.status.success(), text)
}

fn build_and_run(dir: &Path, check: &str) -> String {
    let (ok, text) = build_and_try(dir, check);
    assert!(ok, "{check} found kernel errors:\n{text}");
    text
}

/// One folder per bug under `dir` (`{prefix}_{i}`), each with conv2.cu's `text` expanded (its
/// common.cuh included) where the one occurrence of `right` becomes `wrong`, beside bn.cu's
/// namespace `bn_ns`.
fn broken_conv2_copies(
    dir: &Path,
    prefix: &str,
    text: &str,
    bugs: &[(&str, &str)],
    bn_ns: &str,
) -> Vec<std::path::PathBuf> {
    let mut broken = Vec::new();
    let expanded = expand_common(text);
    for (i, (right, wrong)) in bugs.iter().enumerate() {
        assert!(
            expanded.matches(right).count() == 1,
            "conv2.cu or common.cuh changed ({right}): update this test"
        );
        let d = dir.join(format!("{prefix}_{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("conv2_x.cu"), expanded.replace(right, wrong)).unwrap();
        std::fs::write(d.join("bn_ns.cu"), bn_ns).unwrap();
        broken.push(d);
    }
    broken
}

/// The v1, v2 and v3 convolution files are emulated alone (they share helper names).
const ALONE: [&str; 3] = ["conv.cu", "conv2.cu", "conv3.cu"];

#[test]
fn kernels_match_references_under_emulation() {
    let dir = tempfile::tempdir().unwrap();
    if !cxx20_available(dir.path()) {
        eprintln!(
            "skipped: no C++20 compiler ({}); install g++ ≥ 11 to emulate the kernels",
            compiler()
        );
        return;
    }
    // conv.cu alone; every other file in its own namespace (they share helper names).
    let conv = KernelFile::by_name("conv.cu").unwrap();
    std::fs::write(dir.path().join("conv_x.cu"), conv.expanded()).unwrap();
    let mut rest = expand_common(INCLUDE);
    let conv2 = KernelFile::by_name("conv2.cu").unwrap();
    std::fs::write(dir.path().join("conv2_x.cu"), conv2.expanded()).unwrap();
    for file in KERNEL_FILES.iter().filter(|f| !ALONE.contains(&f.name)) {
        let stem = file.name.trim_end_matches(".cu");
        rest.push_str(&format!(
            "namespace k_{stem} {{\n{}\n}}\n",
            file.text.replace(INCLUDE, "")
        ));
    }
    std::fs::write(dir.path().join("rest_x.cu"), rest).unwrap();
    // bn.cu's merges and finalize, for the fused epilogues' end-to-end checks in conv2_check.
    let bn = KernelFile::by_name("bn.cu").unwrap();
    let bn_ns = format!("namespace k_bn {{\n{}\n}}\n", bn.text.replace(INCLUDE, ""));
    std::fs::write(dir.path().join("bn_ns.cu"), &bn_ns).unwrap();
    // A copy of conv2.cu with one index broken (the epilogue's fragment row: the lower 8 rows
    // of every 16-row mma tile are never staged), which the v2 check must catch.
    let broken = dir.path().join("broken");
    std::fs::create_dir_all(&broken).unwrap();
    let correct_row = "g + (e >= 2 ? 8 : 0), col";
    assert!(
        conv2.text.contains(correct_row),
        "conv2.cu's epilogue changed: update this test"
    );
    std::fs::write(
        broken.join("conv2_x.cu"),
        expand_common(&conv2.text.replace(correct_row, "g, col")),
    )
    .unwrap();
    std::fs::write(broken.join("bn_ns.cu"), &bn_ns).unwrap();
    // Copies with one bug each in the batch-norm epilogues or the paired stem, which the check
    // must catch.
    let conv2_bugs = [
        // the forward statistics divide a tail tile's sum by the full tile height
        ("mean0 = t0 / (float)rows", "mean0 = t0 / (float)T::BM"),
        // the dgrad sums read every row's x̂ at the first row of the thread's span
        ("ep.bn_x + row_out[r0 + i] + c", "ep.bn_x + row_out[r0] + c"),
        // the paired stem's weight copied without its lead slot
        (
            "const int s = 2 * j + px - lead;",
            "const int s = 2 * j + px;",
        ),
        // the paired stem's forward reading the columns at the rows' stride and padding
        (
            "wx = x * a.stride_w - a.pad_w;",
            "wx = x * a.stride - a.pad;",
        ),
        // the paired stem's weight gradient gathering at the rows' column padding
        (
            "{ return OWN_COLUMNS ? a.pad_w : a.pad; }",
            "{ return a.pad; }",
        ),
        // the paired stem's weight gradient written back without the lead slot
        (
            "const int s = a.pair_lead >= 0 ? 2 * t + px - a.pair_lead : t;",
            "const int s = a.pair_lead >= 0 ? 2 * t + px : t;",
        ),
    ];
    let broken_conv2 =
        broken_conv2_copies(dir.path(), "broken_conv2", conv2.text, &conv2_bugs, &bn_ns);
    // conv3.cu (Hopper: wgmma, TMA, mbarrier) and copies of it with one synchronisation or
    // layout bug each, which its check (run under both TMA timings) must catch.
    let conv3 = KernelFile::by_name("conv3.cu").unwrap();
    std::fs::write(dir.path().join("conv3_x.cu"), conv3.expanded()).unwrap();
    let conv3_bugs = [
        // a consumer that reads a stage without waiting for its TMA loads
        (
            "c3_mbar_wait(full0 + 8 * s, (unsigned)(ring / STAGES) & 1u);",
            "",
        ),
        // a producer that refills a stage its consumers have not released
        (
            "if (round > 0) c3_mbar_wait(empty0 + 8 * s, (unsigned)(round - 1) & 1u);",
            "",
        ),
        // a stage released while its wgmma may still read it
        ("c3_wgmma_wait<1>(acc);", "c3_wgmma_wait<2>(acc);"),
        // K-major descriptors without the 128-byte swizzle the TMA loads wrote
        ("           (1ull << 62);", "           (0ull << 62);"),
        // MN-major descriptors with the 8-k atoms 512 bytes apart instead of 1024
        (
            "((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);",
            "((unsigned long long)(512 >> 4) << 32) | (1ull << 62);",
        ),
        // the k-step advanced by 8 channels instead of 16 inside the swizzle atom
        ("c3_desc(a_rows + kk * 32)", "c3_desc(a_rows + kk * 16)"),
        // the MN-major k-step advanced by 8 pixels instead of 16 (wgrad)
        (
            "c3_desc_mn(a_rows + kk * 2048)",
            "c3_desc_mn(a_rows + kk * 1024)",
        ),
        // the dgrad's Σg·x̂ reading every row's x̂ at the first row of the thread's span
        (
            "ep.bn_x + c3_pixel<TAPS>(a, t, false, r0 + i) * N + cn",
            "ep.bn_x + c3_pixel<TAPS>(a, t, false, r0) * N + cn",
        ),
        // the 3×3 tile's rows mapped to pixels with the columns and rows swapped
        (
            "h = h0 + row % per_image / a.tile_w, w = w0 + row % a.tile_w;",
            "h = h0 + row % a.tile_h, w = w0 + row % per_image / a.tile_h;",
        ),
        // the 3×3 weight gradient's second 64 columns loaded with the first's tap and channels
        (
            "const int col = n0 + 64 * j, tap = col / channels, c0 = col % channels;",
            "const int col = n0, tap = col / channels, c0 = col % channels;",
        ),
        // the 3×3 data gradient's boxes shifted like the forward's (no flip)
        (
            "const int dr = a.flip ? a.pad - r : r - a.pad, dt = a.flip ? a.pad - t : t - a.pad;",
            "const int dr = r - a.pad, dt = t - a.pad;",
        ),
        // the tap's column shift of the 3×3 input box taken from its row
        (
            "c3_tma_load_4d(stage, map_a, c0, w0 * a.stride + dt, h0 * a.stride + dr, img0, full);",
            "c3_tma_load_4d(stage, map_a, c0, w0 * a.stride + dr, h0 * a.stride + dr, img0, full);",
        ),
        // the stride ignored in the box coordinate: a stride-2 forward's tiles read the input
        // at their output pixel instead of output pixel × 2
        (
            "c3_tma_load_4d(stage, map_a, c0, w0 * a.stride + dt, h0 * a.stride + dr, img0, full);",
            "c3_tma_load_4d(stage, map_a, c0, w0 + dt, h0 + dr, img0, full);",
        ),
        // the stride ignored in the weight gradient's x box: the rows of a stride-2 tile read
        // at the output row instead of output row × 2
        (
            "th0 * a.stride + r - a.pad, ti0, full);",
            "th0 + r - a.pad, ti0, full);",
        ),
        // the weight gradient's 64-row twin: consumer 1 multiplying B's first box, not its own
        (
            "const unsigned b_rows = stage + A_BYTES + (SPLIT_N ? c * C3_BOX_BYTES : 0);",
            "const unsigned b_rows = stage + A_BYTES + (SPLIT_N ? 0 : 0);",
        ),
        // the 64-row twin's stage announced with a 128-row A tile's bytes (a phase that never
        // completes)
        (
            "c3_mbar_arrive_expect_tx(full, STAGE);",
            "c3_mbar_arrive_expect_tx(full, C3_TILE_BYTES + BN * C3_BK * 2);",
        ),
        // the 64-row twin's consumers writing the same 64 columns of dw
        ("col_base = n0 + (SPLIT_N ? c * 64 : 0);", "col_base = n0;"),
        // the strided 1×1's data gradient scattering dy's pixel (p, q) to dx's (2p, 2q + 1)
        (
            "* a.width + (long)q * a.stride;",
            "* a.width + (long)q * a.stride + 1;",
        ),
        // the strided 1×1's data gradient leaving the cells' other pixels unwritten
        ("if (scatter && !a.accumulate) {", "if (false) {"),
        // the data gradient's mask recomputed from x with the pair's first channel's statistics
        // for both
        (
            "applied_bn2(x, make_float2(mu0, mu1), make_float2(is0, is1), ga, be, 1)",
            "applied_bn2(x, make_float2(mu0, mu0), make_float2(is0, is0), ga, be, 1)",
        ),
        // the recomputed mask kept out of the staged g that goes to dx (only the sums see it)
        ("                    cs_pair[r * (LDC / 2)] = v;\n", "\n"),
        // a chunk's packed signs read from another chunk's byte (its index halved)
        (
            "(unsigned)signs_src[o >> 3] : 0u;",
            "(unsigned)signs_src[o >> 4] : 0u;",
        ),
        // the packed signs' bits taken in the wrong order within a bf16 pair
        (
            "((signs >> (2 * k)) & 1u ? 0x0000ffffu : 0u)",
            "((signs >> (2 * k + 1)) & 1u ? 0x0000ffffu : 0u)",
        ),
        // the stride-2 3×3 data gradient's odd-row phase reading dy's rows with the taps swapped
        (
            "h0 + (ph ? 1 - ri : 0), img0, full);",
            "h0 + (ph ? ri : 0), img0, full);",
        ),
        // a persistent block that never releases a tile's last stage (its producer waits
        // forever for it once the ring comes round)
        (
            "if (release_last && tid % 128 == 0)",
            "if (false && tid % 128 == 0)",
        ),
        // a persistent block whose consumers restart the ring's count at every tile they start
        // without a head start (the stage and parity of its first k-step are not the ones its
        // producer filled)
        (
            "for (int kt = issued; kt < t.kt_count; ++kt, ++ring) {",
            "for (int kt = issued; kt < t.kt_count; ++kt, ++ring) { if (kt == 0) ring = 0;",
        ),
        // a persistent block's epilogue area laid over its last stage (the next tile's loads
        // overwrite the staged tile)
        (
            "* (C3_TILE_BYTES + (BN) * C3_BK * 2) + 128)",
            "* (C3_TILE_BYTES + (BN) * C3_BK * 2) - 16384)",
        ),
        // a persistent data gradient that loads its epilogue's operands before the mainloop but
        // never dx's prior value, which that early load leaves out (accumulating, it adds zeros)
        (
            "else if (a.accumulate) ops.template load_chunks<2>",
            "else if (false) ops.template load_chunks<2>",
        ),
        // a persistent consumer that releases only one of the stages its head start consumed
        // (the producer waits forever for the others once the ring comes round)
        (
            "    int pending = issued;",
            "    int pending = issued > 0 ? 1 : 0;",
        ),
        // a persistent walk that takes every tile's columns from the first column tile
        (
            "mt = i / n_tiles % m_tiles, nt = i % n_tiles;",
            "mt = i / n_tiles % m_tiles, nt = 0;",
        ),
    ];
    // (in conv3.cu with its common.cuh included: the epilogue's mask is common.cuh's)
    let mut broken_conv3 = Vec::new();
    let conv3_expanded = expand_common(conv3.text);
    for (i, (right, wrong)) in conv3_bugs.iter().enumerate() {
        assert!(
            conv3_expanded.matches(right).count() == 1,
            "conv3.cu or common.cuh changed ({right}): update this test"
        );
        let d = dir.path().join(format!("broken_conv3_{i}"));
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("conv3_x.cu"), conv3_expanded.replace(right, wrong)).unwrap();
        broken_conv3.push(d);
    }
    let (conv_out, conv2_out, ops_out, (broken_ok, broken_out), conv2_broken) =
        std::thread::scope(|s| {
            let conv = s.spawn(|| build_and_run(dir.path(), "conv_check"));
            let conv2 = s.spawn(|| build_and_run(dir.path(), "conv2_check"));
            let ops = s.spawn(|| build_and_run(dir.path(), "ops_check"));
            // The broken copies stop at their first failing case.
            let broken = s.spawn(|| build_and_try_args(&broken, "conv2_check", &["--first"]));
            let conv2_broken: Vec<_> = broken_conv2
                .iter()
                .map(|d| s.spawn(move || build_and_try_args(d, "conv2_check", &["--first"])))
                .collect();
            (
                conv.join().unwrap(),
                conv2.join().unwrap(),
                ops.join().unwrap(),
                broken.join().unwrap(),
                conv2_broken
                    .into_iter()
                    .map(|h| h.join().unwrap())
                    .collect::<Vec<_>>(),
            )
        });
    let (conv3_out, conv3_broken) = std::thread::scope(|s| {
        let good = s.spawn(|| build_and_run(dir.path(), "conv3_check"));
        let broken: Vec<_> = broken_conv3
            .iter()
            .map(|d| s.spawn(move || build_and_try_args(d, "conv3_check", &["--first"])))
            .collect();
        (
            good.join().unwrap(),
            broken
                .into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>(),
        )
    });
    assert!(conv3_out.contains("ALL OK"), "{conv3_out}");
    for ((right, wrong), (ok, out)) in conv3_bugs.iter().zip(&conv3_broken) {
        assert!(
            !ok && (out.contains("FAIL") || out.contains("emulator:")),
            "conv3.cu with `{right}` broken to `{wrong}` passed its emulated check:\n{out}"
        );
    }
    assert!(conv_out.contains("ALL OK"), "{conv_out}");
    assert!(conv2_out.contains("ALL OK"), "{conv2_out}");
    assert!(
        !broken_ok && broken_out.contains("FAIL"),
        "a broken conv2.cu passed its emulated check:\n{broken_out}"
    );
    for ((right, wrong), (ok, out)) in conv2_bugs.iter().zip(&conv2_broken) {
        assert!(
            !ok && out.contains("FAIL"),
            "conv2.cu with `{right}` broken to `{wrong}` passed its emulated check:\n{out}"
        );
    }
    assert!(ops_out.contains("ALL OK"), "{ops_out}");
    // The checks of gradient accumulation's kernels ran (a new kernel without a check fails
    // here, not only on a GPU).
    for name in [
        "grad_accumulate (the CPU ranks' rounding) ok",
        "loss_totals (added)",
    ] {
        assert!(ops_out.contains(name), "no {name:?} line in\n{ops_out}");
    }
    // Every kernel of every file was exercised.
    let all = format!(
        "{}{}{}{}",
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu/conv3_check.cpp")
        )
        .unwrap(),
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu/conv2_check.cpp")
        )
        .unwrap()
            + &std::fs::read_to_string(
                Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu/conv2_apply_check.cpp")
            )
            .unwrap(),
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu/conv_check.cpp")
        )
        .unwrap(),
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/emu/ops_check.cpp")
        )
        .unwrap()
    );
    for file in KERNEL_FILES {
        for kernel in file.kernel_names() {
            assert!(
                // called directly, or through a table of kernel pointers
                ["(", ",", "}"]
                    .iter()
                    .any(|end| all.contains(&format!("{kernel}{end}"))),
                "{kernel} ({}) has no emulated check",
                file.name
            );
        }
    }
}

/// The v2 kernels that apply a batch norm to their input as they load it, and the data
/// gradient's epilogue with its ReLU mask recomputed, against their composition (bn_apply, then
/// the plain kernel) to the bit, twice (kernels/emu/conv2_apply_check.cpp); copies with one bug
/// each must fail.
#[test]
fn conv2_apply_kernels_match_their_composition_under_emulation() {
    let dir = tempfile::tempdir().unwrap();
    if !cxx20_available(dir.path()) {
        eprintln!(
            "skipped: no C++20 compiler ({}); install g++ ≥ 11 to emulate the kernels",
            compiler()
        );
        return;
    }
    let conv2 = KernelFile::by_name("conv2.cu").unwrap();
    let bn = KernelFile::by_name("bn.cu").unwrap();
    let bn_ns = format!("namespace k_bn {{\n{}\n}}\n", bn.text.replace(INCLUDE, ""));
    std::fs::write(dir.path().join("conv2_x.cu"), conv2.expanded()).unwrap();
    std::fs::write(dir.path().join("bn_ns.cu"), &bn_ns).unwrap();
    let bugs = [
        // the forward transforming the zero-filled halo and tails (ReLU(BN(0)) ≠ 0)
        (
            "const bool keep = live >> i & 1u;",
            "const bool keep = true;",
        ),
        // every chunk read with channel 0's parameters
        (
            "const int c0 = min((int)(rec >> RING_CHUNKS), a.c - 8);",
            "const int c0 = 0;",
        ),
        // the wgrad's small-C chunks all at chunk 0's channel
        (
            "GATHER == SMALL_C ? (int)lds_u32(b_chans + j * (T::THREADS * 4))",
            "GATHER == SMALL_C ? (int)lds_u32(b_chans)",
        ),
        // a stage transformed with the next stage's record
        (
            "if (APPLY) apply_stage(u);",
            "if (APPLY) apply_stage((u + 1) % T::STAGES);",
        ),
        // the data gradient's mask recomputed with the column pair's first channel's γ and β
        // for both
        (
            "ga = make_float2(bt_to_f32(ep.gamma[c]), bt_to_f32(ep.gamma[c + 1]));",
            "ga = make_float2(bt_to_f32(ep.gamma[c]), bt_to_f32(ep.gamma[c]));",
        ),
        // the masked g of a recomputed mask never written to dx
        (
            "if (mask_late) {\n            // The masked g, staged by the sums above",
            "if (false) {\n            // The masked g, staged by the sums above",
        ),
    ];
    let broken = broken_conv2_copies(dir.path(), "broken", conv2.text, &bugs, &bn_ns);
    let (good, bad) = std::thread::scope(|s| {
        let good = s.spawn(|| build_and_run(dir.path(), "conv2_apply_check"));
        let bad: Vec<_> = broken
            .iter()
            .map(|d| s.spawn(move || build_and_try_args(d, "conv2_apply_check", &["--first"])))
            .collect();
        (
            good.join().unwrap(),
            bad.into_iter()
                .map(|h| h.join().unwrap())
                .collect::<Vec<_>>(),
        )
    });
    assert!(good.contains("ALL OK"), "{good}");
    for ((right, wrong), (ok, out)) in bugs.iter().zip(&bad) {
        assert!(
            !ok && out.contains("FAIL"),
            "conv2.cu with `{right}` broken to `{wrong}` passed its emulated check:\n{out}"
        );
    }
}
