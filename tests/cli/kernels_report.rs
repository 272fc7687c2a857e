//! `birdtrain kernels report` on the real kernels: NVRTC's sm_90 cubins of conv.cu and conv2.cu
//! disassembled by nvdisasm/cuobjdump (scripts/install-cuda-tools.sh). Skips, saying why, where
//! NVRTC or the tools are missing. Holds the v2 kernels to the issue's goals: no spills, and
//! under 64 non-mma instructions per 32 mma in the main loop (the small-C wgrad, whose every
//! column checks its own tap, under 96). The kernels with batch-norm epilogues
//! (`BIRDTRAIN_BN_FUSION`) are held to the same bars as the plain ones; those applying a batch
//! norm to their input as they load it to no spills and the transform's own work. The v3 kernels
//! (conv3.cu) compiled for sm_90a issue `wgmma` fed by TMA, without spills, under the same
//! overhead bar per unit of tensor-core work (their 64-column twins and the weight gradients'
//! 64-row twins under 96, two blocks an SM), and with no note from ptxas (a `wgmma` it waited
//! for early or serialised).

use birdtrain::cli::kernels_report::{find_tool, report, smem_per_sm};
use birdtrain::cuda::conv::{V2_APPLY_KERNELS, V2_BN_EPILOGUE_KERNELS, V2_GEMM_KERNELS};
use birdtrain::cuda::conv3;
use birdtrain::cuda::GpuArch;

#[test]
fn v2_kernels_meet_the_instruction_and_spill_goals() {
    if find_tool("nvdisasm").is_none() || find_tool("cuobjdump").is_none() {
        eprintln!("skipped: nvdisasm/cuobjdump not found (scripts/install-cuda-tools.sh, then . scripts/cuda-env.sh)");
        return;
    }
    if birdtrain::cuda::library::require_nvrtc().is_err() {
        eprintln!("skipped: no NVRTC (. scripts/cuda-env.sh)");
        return;
    }
    let arch = GpuArch::new(9, 0);
    let rows = report(arch, smem_per_sm(arch)).expect("kernels report");
    for name in V2_GEMM_KERNELS.iter().chain(V2_BN_EPILOGUE_KERNELS) {
        let r = rows
            .iter()
            .find(|r| r.kernel == *name)
            .unwrap_or_else(|| panic!("{name} missing from the report"));
        assert_eq!(r.usage.local + r.usage.stack, 0, "{name} spills: {r:?}");
        assert!(r.mix.mma >= 32, "{name}: no main loop found: {r:?}");
        let limit = if name.contains("_c8_") { 96.0 } else { 64.0 };
        let other = r.mix.other_per_32_mma().unwrap();
        assert!(
            other < limit,
            "{name}: {other:.1} other instructions per 32 mma"
        );
        assert!(r.blocks_per_sm >= 2, "{name}: {r:?}");
    }
    // The kernels applying a batch norm to their input as they load it: no spills and the
    // same occupancy; their main loop also rewrites every loaded element of the gathered
    // operand (about 6 instructions an element), so their bar is that work's: under 400 other
    // instructions per 32 mma (the 8-warp tiles, which transform half as much per mma, ~200).
    for name in V2_APPLY_KERNELS {
        let r = rows
            .iter()
            .find(|r| r.kernel == *name)
            .unwrap_or_else(|| panic!("{name} missing from the report"));
        assert_eq!(r.usage.local + r.usage.stack, 0, "{name} spills: {r:?}");
        assert!(r.mix.mma >= 32, "{name}: no main loop found: {r:?}");
        let other = r.mix.other_per_32_mma().unwrap();
        assert!(
            other < 400.0,
            "{name}: {other:.1} other instructions per 32 mma"
        );
        assert!(r.blocks_per_sm >= 2, "{name}: {r:?}");
    }
    // v1 is reported beside it.
    assert!(rows
        .iter()
        .any(|r| r.kernel == "conv_fwd_vec" && r.mix.mma > 0));
}

#[test]
fn v3_kernels_issue_wgmma_fed_by_tma_on_sm_90a() {
    if find_tool("nvdisasm").is_none() || find_tool("cuobjdump").is_none() {
        eprintln!("skipped: nvdisasm/cuobjdump not found (scripts/install-cuda-tools.sh, then . scripts/cuda-env.sh)");
        return;
    }
    if birdtrain::cuda::library::require_nvrtc().is_err() {
        eprintln!("skipped: no NVRTC (. scripts/cuda-env.sh)");
        return;
    }
    let arch = GpuArch::specific(9, 0);
    let rows = report(arch, smem_per_sm(arch)).expect("kernels report");
    let gemms = [
        conv3::FWD_KERNEL,
        conv3::FWD_STATS_KERNEL,
        conv3::DGRAD_KERNEL,
        conv3::DGRAD_BN_KERNEL,
        conv3::FWD_3X3_KERNEL,
        conv3::FWD_STATS_3X3_KERNEL,
        conv3::WGRAD_KERNEL,
        conv3::DGRAD_3X3_KERNEL,
        conv3::DGRAD_BN_3X3_KERNEL,
        conv3::WGRAD_3X3_KERNEL,
    ];
    // Every GEMM at 128 × 128 and its 64-column twin; the weight gradients' 64-row twins; the
    // persistent twins of the forward and data-gradient GEMMs (no spill: their consumers run
    // on the registers the producer gives back).
    let kernels = gemms
        .iter()
        .flat_map(|k| [*k, conv3::with_tile(k, conv3::TILE_N_NARROW)])
        .chain([conv3::WGRAD_M64_KERNEL, conv3::WGRAD_3X3_M64_KERNEL])
        .chain(gemms.iter().flat_map(|k| {
            [*k, conv3::with_tile(k, conv3::TILE_N_NARROW)]
                .into_iter()
                .filter_map(conv3::persistent_twin)
        }));
    for name in kernels {
        let wide = conv3::kernel_tile(name) == (conv3::TILE_M, conv3::TILE_N);
        assert!(
            wide || name.ends_with("_n64") || name.ends_with("_m64") || name.ends_with("_n64_p"),
            "{name}"
        );
        let r = rows
            .iter()
            .find(|r| r.kernel == name)
            .unwrap_or_else(|| panic!("{name} missing from the report"));
        assert_eq!(r.mix.kind.name(), "wgmma", "{name}: {r:?}");
        assert_eq!(r.usage.local + r.usage.stack, 0, "{name} spills: {r:?}");
        // ptxas kept every wgmma asynchronous: none waited for early or serialised (a
        // persistent kernel's head start lost that way before its issue and wait shared a pass).
        assert!(r.ptxas_notes.is_empty(), "{name}: {:?}", r.ptxas_notes);
        // Four m64nNk16 per 64-channel slice, two TMA loads (A and B) or more per slice.
        assert!(r.mix.mma >= 4 && r.mix.tma_loads >= 2, "{name}: {r:?}");
        // The k-step's bookkeeping (barrier wait, fence, descriptors, commit, release: ~80
        // instructions) is the same for either tile, over half the tensor work in the short
        // tiles; it issues while the asynchronous wgmma run (4 m64n64k16 keep the tensor
        // cores ~256 cycles), so the short tiles get the small-C wgrad's bar.
        let limit = if wide { 64.0 } else { 96.0 };
        let other = r.mix.other_per_32_mma().unwrap();
        assert!(
            other < limit,
            "{name}: {other:.1} other instructions per 32 mma"
        );
        // The wide tiles fill an SM alone; the short ones run two blocks an SM.
        let per_sm = if wide { 1 } else { 2 };
        assert_eq!(
            (r.threads, r.dynamic_smem, r.blocks_per_sm),
            (384, conv3::smem_bytes(name), per_sm),
            "{name}"
        );
    }
    // Without sm_90a the file's kernels are stubs: no tensor-core loop.
    let plain = report(GpuArch::new(9, 0), smem_per_sm(arch)).expect("kernels report");
    let stub = plain
        .iter()
        .find(|r| r.kernel == conv3::FWD_KERNEL)
        .expect("conv3 reported for sm_90");
    assert_eq!(stub.mix.mma, 0, "{stub:?}");
}
