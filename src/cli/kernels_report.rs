//! `birdtrain kernels report --arch sm_90`: what the compiler made of the convolution kernels,
//! v1 (conv.cu), v2 (conv2.cu) and v3 (conv3.cu, Hopper's wgmma and TMA) side by side: registers, spills (local memory), shared
//! memory, occupancy, and the main loop's instruction mix (non-mma instructions per 32 mma per
//! warp; the v2 goal is < 64 and no spills).
//!
//! NVRTC compiles each file to a cubin; NVIDIA's `cuobjdump -res-usage` gives registers and
//! memory, `nvdisasm` the SASS. The main loop of a kernel is the backward-branch loop holding
//! the most HMMA instructions; every other instruction in it counts as overhead. Both tools
//! come from PyPI wheels (scripts/install-cuda-tools.sh), found through `BIRDTRAIN_CUDA_BIN`,
//! `CUDA_HOME/bin` or `PATH`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::cuda::conv::{Conv2Tile, Pass};
use crate::cuda::conv3;
use crate::cuda::{self, GpuArch, KernelFile};

/// Arguments of `birdtrain kernels report`.
#[derive(Debug, Clone, clap::Args)]
pub struct ReportArgs {
    /// The target architecture (one).
    #[arg(long, default_value = "sm_90")]
    pub arch: String,
}

/// Shared memory per SM of an architecture (sm_80: 164 KiB, sm_86/89: 100 KiB, sm_90: 228 KiB).
pub fn smem_per_sm(arch: GpuArch) -> usize {
    match (arch.major, arch.minor) {
        (8, 0) => 164 * 1024,
        (8, _) => 100 * 1024,
        _ => 228 * 1024,
    }
}

/// Runs `birdtrain kernels report`.
pub fn run(args: ReportArgs) -> anyhow::Result<()> {
    let archs = GpuArch::parse_list(&args.arch)?;
    let [arch] = archs[..] else {
        anyhow::bail!(
            "--arch {:?}: give exactly one architecture, such as sm_90",
            args.arch
        );
    };
    let rows = report(arch, smem_per_sm(arch))?;
    print(arch, &rows);
    Ok(())
}

/// Registers per SM, threads per SM and resident blocks per SM (sm_80 and sm_90 alike).
const REGS_PER_SM: usize = 65_536;
const THREADS_PER_SM: usize = 2048;
const MAX_BLOCKS_PER_SM: usize = 32;

/// Resource usage of one function (`cuobjdump -res-usage`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ResUsage {
    /// Registers per thread.
    pub regs: usize,
    /// Static shared memory in bytes.
    pub shared: usize,
    /// Local memory per thread in bytes (spills and local arrays).
    pub local: usize,
    /// Stack frame per thread in bytes.
    pub stack: usize,
}

/// Which tensor-core instruction a kernel's main loop issues.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum MmaKind {
    /// No tensor-core instruction in a loop.
    #[default]
    None,
    /// `mma.sync` (SASS `HMMA`): one warp, sm_80 and later.
    MmaSync,
    /// Hopper's `wgmma` (SASS `HGMMA`): a warpgroup, operands from shared memory (sm_90a).
    Wgmma,
}

impl MmaKind {
    /// The name the report prints.
    pub fn name(self) -> &'static str {
        match self {
            MmaKind::None => "-",
            MmaKind::MmaSync => "mma.sync",
            MmaKind::Wgmma => "wgmma",
        }
    }
}

/// The main loop of one function (`nvdisasm`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoopMix {
    /// Tensor-core instructions (HMMA or HGMMA) in the loop body.
    pub mma: usize,
    /// Every other instruction in it.
    pub other: usize,
    /// Which tensor-core instruction the loop issues (HGMMA where it has both).
    pub kind: MmaKind,
    /// Bulk tensor copies (TMA, SASS `UTMALDG`) anywhere in the function.
    pub tma_loads: usize,
    /// The loop's tensor-core work in m16n8k16 `mma.sync` units per warp: an HMMA counts 1, a
    /// warp's HGMMA m64nNk16 N/8 (its 16 rows of the warpgroup's 64), so that kernels of both
    /// kinds compare by overhead per unit of work.
    pub mma_work: usize,
}

impl LoopMix {
    /// Non-mma instructions per 32 units of tensor-core work (`mma_work`; per warp: each SASS
    /// instruction is one warp's).
    pub fn other_per_32_mma(&self) -> Option<f64> {
        (self.mma_work > 0).then(|| self.other as f64 * 32.0 / self.mma_work as f64)
    }
}

/// A tensor-core instruction's work in m16n8k16 units per warp (see [`LoopMix::mma_work`]):
/// `HGMMA.64x128x16…` → 16, `HMMA.16816…` → 1, anything else 0.
fn mma_units(opcode: &str) -> usize {
    if let Some(shape) = opcode.strip_prefix("HGMMA.") {
        let n = shape
            .split('x')
            .nth(1)
            .and_then(|n| n.parse::<usize>().ok());
        return n.map_or(0, |n| n / 8);
    }
    usize::from(opcode.starts_with("HMMA"))
}

/// Parses `cuobjdump -res-usage`: `Function NAME:` followed by `REG:n STACK:n SHARED:n LOCAL:n …`.
pub fn parse_res_usage(text: &str) -> HashMap<String, ResUsage> {
    let mut out = HashMap::new();
    let mut current: Option<String> = None;
    for line in text.lines().map(str::trim) {
        if let Some(name) = line
            .strip_prefix("Function ")
            .and_then(|l| l.strip_suffix(':'))
        {
            current = Some(name.trim().to_string());
            continue;
        }
        let Some(name) = current.take() else { continue };
        let mut u = ResUsage::default();
        for field in line.split_whitespace() {
            let Some((key, value)) = field.split_once(':') else {
                continue;
            };
            let value: usize = value.parse().unwrap_or(0);
            match key {
                "REG" => u.regs = value,
                "SHARED" => u.shared = value,
                "LOCAL" => u.local = value,
                "STACK" => u.stack = value,
                _ => {}
            }
        }
        out.insert(name, u);
    }
    out
}

/// Parses `nvdisasm` output into each function's main loop: for every backward branch to a
/// label, the instructions from the label to the branch; among the loops with tensor-core
/// instructions (HMMA for `mma.sync`, HGMMA for `wgmma`) that hold no other such loop (a
/// persistent kernel's tile loop holds its k-step loops), the one with the most wins, the
/// first on a tie (its branch first in the code: the k-step loop, ahead of the branches back
/// from the barrier waits' retries placed at the function's end); and the function's TMA
/// loads.
pub fn parse_sass(text: &str) -> HashMap<String, LoopMix> {
    let mut out = HashMap::new();
    let mut name: Option<String> = None;
    let mut instrs: Vec<String> = Vec::new();
    let mut labels: HashMap<String, usize> = HashMap::new();
    let mut finish = |name: Option<String>, instrs: &[String], labels: &HashMap<String, usize>| {
        let Some(name) = name else { return };
        let mma_count = |body: &[String], prefix: &str| {
            body.iter()
                .filter(|i| opcode(i).starts_with(prefix))
                .count()
        };
        // Every loop with mma: (label, backward branch).
        let loops: Vec<(usize, usize)> = instrs
            .iter()
            .enumerate()
            .filter_map(|(at, ins)| {
                let start = *labels.get(branch_target(ins)?)?;
                let body = &instrs[start.min(at)..=at];
                (start <= at && mma_count(body, "HMMA") + mma_count(body, "HGMMA") > 0)
                    .then_some((start, at))
            })
            .collect();
        let mut best = LoopMix::default();
        for &(start, at) in &loops {
            let holds_another = loops
                .iter()
                .any(|&(s, a)| (s, a) != (start, at) && s >= start && a <= at);
            if holds_another {
                continue;
            }
            let body = &instrs[start..=at];
            let (sync, group) = (mma_count(body, "HMMA"), mma_count(body, "HGMMA"));
            let mma = sync + group;
            if mma > best.mma {
                best = LoopMix {
                    mma,
                    other: body.len() - mma,
                    kind: if group > 0 {
                        MmaKind::Wgmma
                    } else {
                        MmaKind::MmaSync
                    },
                    tma_loads: 0,
                    mma_work: body.iter().map(|i| mma_units(opcode(i))).sum(),
                };
            }
        }
        best.tma_loads = instrs
            .iter()
            .filter(|i| opcode(i).starts_with("UTMALDG"))
            .count();
        out.insert(name, best);
    };
    for line in text.lines() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix(".section") {
            // .section	.text.NAME,"ax",@progbits
            if let Some(fun) = rest.trim().strip_prefix(".text.") {
                finish(name.take(), &instrs, &labels);
                instrs.clear();
                labels.clear();
                name = fun.split(',').next().map(str::to_string);
            }
        } else if t.starts_with(".L") && t.ends_with(':') {
            labels.insert(t.trim_end_matches(':').to_string(), instrs.len());
        } else if let Some(close) = t
            .strip_prefix("/*")
            .and_then(|r| r.find("*/").map(|c| &r[c + 2..]))
        {
            // /*0f30*/  @!P1 BRA `(.L_x_0) ;
            let ins = close.trim().trim_end_matches(';').trim();
            if !ins.is_empty() && name.is_some() {
                instrs.push(ins.to_string());
            }
        }
    }
    finish(name, &instrs, &labels);
    out
}

/// The opcode of an instruction, past its predicate (`@!P1 BRA …` → `BRA`).
fn opcode(ins: &str) -> &str {
    let mut words = ins.split_whitespace();
    let first = words.next().unwrap_or("");
    if first.starts_with('@') {
        words.next().unwrap_or("")
    } else {
        first
    }
}

/// The label a branch jumps to.
fn branch_target(ins: &str) -> Option<&str> {
    if opcode(ins) != "BRA" {
        return None;
    }
    let open = ins.find("(.L")? + 1;
    let len = ins[open..].find(')')?;
    Some(&ins[open..open + len])
}

/// One kernel's row of the report.
#[derive(Debug, Clone, PartialEq)]
pub struct ReportRow {
    /// Kernel file.
    pub file: &'static str,
    /// Kernel name.
    pub kernel: String,
    /// Threads per block the backend launches it with.
    pub threads: usize,
    /// Dynamic shared memory per block the backend gives it.
    pub dynamic_smem: usize,
    /// Resource usage.
    pub usage: ResUsage,
    /// The main loop's mix.
    pub mix: LoopMix,
    /// Resident blocks per SM.
    pub blocks_per_sm: usize,
    /// ptxas's notes on this kernel from NVRTC's log (such as a `wgmma` it waited for or
    /// serialised: C7510–C7520), one a line.
    pub ptxas_notes: Vec<String>,
}

/// The lines of NVRTC's `log` that name `kernel` (ptxas writes "… in function 'NAME'").
pub fn ptxas_notes(log: &str, kernel: &str) -> Vec<String> {
    let quoted = format!("function '{kernel}'");
    log.lines()
        .filter(|l| l.contains(&quoted))
        .map(|l| l.trim().to_string())
        .collect()
}

impl ReportRow {
    /// Resident warps over the SM's 64.
    pub fn occupancy(&self) -> f64 {
        (self.blocks_per_sm * self.threads / 32) as f64 / 64.0
    }
}

/// Launch geometry of a convolution GEMM kernel: (threads, dynamic shared memory).
fn launch_geometry(kernel: &str) -> Option<(usize, usize)> {
    if let Some(rest) = kernel.strip_prefix("conv2_") {
        let pass = match rest.split('_').next()? {
            "fwd" => Pass::Forward,
            "dgrad" => Pass::Dgrad,
            "wgrad" => Pass::Wgrad,
            _ => return None,
        };
        let tile = [Conv2Tile::T128x128, Conv2Tile::T128x64, Conv2Tile::T64x128]
            .into_iter()
            .find(|t| kernel.ends_with(&format!("_{}", t.suffix())))?;
        // The kernels applying a batch norm hold its parameters too: reported at 512 input
        // channels, resnet50's largest inner batch norm.
        let smem = if kernel.contains("_apply") {
            tile.apply_smem_bytes(pass, 512)
        } else {
            tile.smem_bytes(pass)
        };
        return Some((tile.threads() as usize, smem));
    }
    if kernel.starts_with("conv3_") {
        // the weight rearrangements are not GEMMs
        let gemm = ![
            conv3::TRANSPOSE_KERNEL,
            conv3::DGRAD_WEIGHTS_3X3_KERNEL,
            conv3::DGRAD_WEIGHTS_S2_KERNEL,
        ]
        .contains(&kernel);
        return gemm.then_some((conv3::THREADS as usize, conv3::smem_bytes(kernel)));
    }
    // v1: 256 threads, static shared memory only (src/cuda/backend/conv.rs, CONV_THREADS).
    kernel.starts_with("conv_").then_some((256, 0))
}

/// Blocks per SM allowed by registers (allocated per warp in units of 256), shared memory
/// (plus the 1 KiB the driver reserves per block) and threads.
pub fn blocks_per_sm(regs: usize, threads: usize, smem: usize, smem_per_sm: usize) -> usize {
    let warps = threads.div_ceil(32);
    let regs_per_warp = (regs.max(1) * 32).div_ceil(256) * 256;
    let by_regs = REGS_PER_SM / (regs_per_warp * warps).max(1);
    let by_smem = smem_per_sm / (smem + 1024);
    let by_threads = THREADS_PER_SM / threads.max(1);
    by_regs.min(by_smem).min(by_threads).min(MAX_BLOCKS_PER_SM)
}

/// Where `tool` (nvdisasm, cuobjdump) is.
pub fn find_tool(tool: &str) -> Option<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("BIRDTRAIN_CUDA_BIN") {
        dirs.push(d.into());
    }
    if let Some(root) = std::env::var_os("CUDA_HOME") {
        dirs.push(PathBuf::from(root).join("bin"));
    }
    if let Some(path) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&path));
    }
    dirs.into_iter().map(|d| d.join(tool)).find(|p| p.is_file())
}

fn run_tool(tool: &Path, args: &[&str], cubin: &Path) -> anyhow::Result<String> {
    let out = Command::new(tool)
        .args(args)
        .arg(cubin)
        .output()
        .map_err(|e| anyhow::anyhow!("running {}: {e}", tool.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "{} {} failed: {}",
            tool.display(),
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Compiles conv.cu, conv2.cu and conv3.cu for `arch` (conv3.cu's Hopper code only for
/// `sm_90a`: elsewhere its kernels are stubs) and reports every convolution GEMM kernel.
pub fn report(arch: GpuArch, smem_per_sm: usize) -> anyhow::Result<Vec<ReportRow>> {
    let hint = "install them with scripts/install-cuda-tools.sh and `. scripts/cuda-env.sh`, or set BIRDTRAIN_CUDA_BIN";
    let nvdisasm =
        find_tool("nvdisasm").ok_or_else(|| anyhow::anyhow!("nvdisasm not found: {hint}"))?;
    let cuobjdump =
        find_tool("cuobjdump").ok_or_else(|| anyhow::anyhow!("cuobjdump not found: {hint}"))?;
    cuda::library::require_nvrtc()?;
    let include = cuda::nvrtc::find_include()?;
    let dir = tempfile::tempdir()?;
    let mut rows = Vec::new();
    for name in ["conv.cu", "conv2.cu", "conv3.cu"] {
        let file = KernelFile::by_name(name).expect("a kernel file");
        let built = cuda::nvrtc::compile_file(file, arch, &include)?;
        let cubin = dir.path().join(format!("{name}.cubin"));
        std::fs::write(&cubin, &built.image.cubin)?;
        let usage = parse_res_usage(&run_tool(&cuobjdump, &["-res-usage"], &cubin)?);
        let mixes = parse_sass(&run_tool(&nvdisasm, &["-c"], &cubin)?);
        let mut kernels = file.kernel_names();
        kernels.sort();
        for kernel in kernels {
            let Some((threads, dynamic_smem)) = launch_geometry(&kernel) else {
                continue;
            };
            let usage = usage.get(&kernel).cloned().unwrap_or_default();
            let mix = mixes.get(&kernel).cloned().unwrap_or_default();
            rows.push(ReportRow {
                file: file.name,
                blocks_per_sm: blocks_per_sm(
                    usage.regs,
                    threads,
                    usage.shared + dynamic_smem,
                    smem_per_sm,
                ),
                ptxas_notes: ptxas_notes(&built.image.log, &kernel),
                kernel,
                threads,
                dynamic_smem,
                usage,
                mix,
            });
        }
    }
    Ok(rows)
}

/// Prints the report as a table.
pub fn print(arch: GpuArch, rows: &[ReportRow]) {
    outln!("convolution kernels for {arch}: v1 (conv.cu), v2 (conv2.cu) and v3 (conv3.cu, wgmma on sm_90a); goal: < 64 other per 32 mma, no spills");
    outln!(
        "{:<26} {:>7} {:>5} {:>6} {:>9} {:>7} {:>6} {:>9} {:>9} {:>4} {:>14}",
        "kernel",
        "threads",
        "regs",
        "spill",
        "smem KiB",
        "blk/SM",
        "occ%",
        "mma kind",
        "loop mma",
        "TMA",
        "other/32 mma"
    );
    for r in rows {
        outln!(
            "{:<26} {:>7} {:>5} {:>6} {:>9.1} {:>7} {:>6.1} {:>9} {:>9} {:>4} {:>14}",
            r.kernel,
            r.threads,
            r.usage.regs,
            r.usage.local + r.usage.stack,
            (r.usage.shared + r.dynamic_smem) as f64 / 1024.0,
            r.blocks_per_sm,
            100.0 * r.occupancy(),
            r.mix.kind.name(),
            r.mix.mma,
            r.mix.tma_loads,
            r.mix
                .other_per_32_mma()
                .map_or("-".to_string(), |v| format!("{v:.1}"))
        );
    }
    for r in rows {
        for note in &r.ptxas_notes {
            outln!("{}: {note}", r.kernel);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Trimmed from nvdisasm -c of conv2.cu for sm_90 (NVRTC 13.0): a prologue, a forward
    // branch, the main loop (label .. backward branch) and an epilogue loop without mma.
    const SASS: &str = "\
//--------------------- .text.conv2_fwd_128x64 --------------------------
\t.section\t.text.conv2_fwd_128x64,\"ax\",@progbits
.text.conv2_fwd_128x64:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/              @!P0 BRA `(.L_x_5) ;
.L_x_9:
        /*0020*/                   LDSM.16.M88.4 R40, [R3] ;
        /*0030*/                   HMMA.16816.F32.BF16 R4, R40, R44, R4 ;
        /*0040*/                   HMMA.16816.F32.BF16 R8, R40, R46, R8 ;
        /*0050*/                   LDGSTS.E.BYPASS.128 [R5], desc[UR4][R6.64] ;
        /*0060*/               @P1 BRA `(.L_x_9) ;
.L_x_5:
.L_x_7:
        /*0070*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*0080*/               @P2 BRA `(.L_x_7) ;
        /*0090*/                   EXIT ;
//--------------------- .text.conv2_pad_channels --------------------------
\t.section\t.text.conv2_pad_channels,\"ax\",@progbits
.L_x_1:
        /*0000*/                   IADD3 R0, R0, 0x1, RZ ;
        /*0010*/                   BRA `(.L_x_1);
";

    // A Hopper kernel's shape (sm_90a): TMA loads completing on an mbarrier, a loop of
    // warpgroup MMAs waited on with WARPGROUP.DEPBAR (written in the form nvdisasm prints).
    const SASS_WGMMA: &str = "\
\t.section\t.text.conv3_fwd_128x128,\"ax\",@progbits
        /*0000*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0010*/                   UTMALDG.2D [UR12], [UR4] ;
.L_x_3:
        /*0020*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R3 ;
        /*0030*/                   WARPGROUP.ARRIVE ;
        /*0040*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0050*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0060*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;
        /*0070*/                   UTMALDG.2D [UR8], [UR4] ;
        /*0080*/               @P1 BRA `(.L_x_3) ;
        /*0090*/                   EXIT ;
";

    #[test]
    fn sass_of_a_hopper_kernel_names_wgmma_and_counts_its_tma_loads() {
        let m = parse_sass(SASS_WGMMA);
        let k = &m["conv3_fwd_128x128"];
        assert_eq!(k.kind, MmaKind::Wgmma);
        assert_eq!(k.kind.name(), "wgmma");
        assert_eq!((k.mma, k.other, k.tma_loads), (2, 5, 3));
        // Two m64n128k16 per warp: 32 m16n8k16 units, 5 other instructions.
        assert_eq!(k.mma_work, 32);
        assert_eq!(k.other_per_32_mma(), Some(5.0));
        assert_eq!(mma_units("HGMMA.64x256x16.F32.BF16"), 32);
        assert_eq!(mma_units("HMMA.16816.F32.BF16"), 1);
        assert_eq!(mma_units("IADD3"), 0);
        // The mma.sync kernels of conv2.cu say so.
        assert_eq!(parse_sass(SASS)["conv2_fwd_128x64"].kind.name(), "mma.sync");
    }

    // A persistent kernel's shape: a tile loop holding the k-step loop and, after the
    // staging, the next tile's head start (a k-step loop without the wait and release).
    const SASS_PERSISTENT: &str = "\
\t.section\t.text.conv3_fwd_1x1_p,\"ax\",@progbits
.L_x_1:
        /*0000*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR5], R3 ;
.L_x_2:
        /*0010*/                   WARPGROUP.ARRIVE ;
        /*0020*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*0030*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*0040*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0050*/                   SYNCS.ARRIVE.TRANS64.A1T0 RZ, [UR6] ;
        /*0060*/               @P1 BRA `(.L_x_2) ;
        /*0070*/                   STS [R2], R24 ;
.L_x_3:
        /*0080*/                   WARPGROUP.ARRIVE ;
        /*0090*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], R24 ;
        /*00a0*/                   HGMMA.64x128x16.F32.BF16 R24, gdesc[UR12], R24, gsb0 ;
        /*00b0*/               @P2 BRA `(.L_x_3) ;
        /*00c0*/                   STG.E.128 desc[UR4][R2.64], R8 ;
        /*00d0*/               @P3 BRA `(.L_x_1) ;
        /*00e0*/                   EXIT ;
";

    #[test]
    fn sass_main_loop_of_a_persistent_kernel_is_its_first_innermost_mma_loop() {
        // The tile loop has the most HGMMA but holds the others; the k-step loop comes first.
        let k = &parse_sass(SASS_PERSISTENT)["conv3_fwd_1x1_p"];
        assert_eq!((k.mma, k.other, k.kind), (2, 4, MmaKind::Wgmma));
    }

    #[test]
    fn sass_main_loop_is_the_backward_branch_with_most_mma() {
        let m = parse_sass(SASS);
        let fwd = &m["conv2_fwd_128x64"];
        assert_eq!(
            fwd,
            &LoopMix {
                mma: 2,
                other: 3,
                kind: MmaKind::MmaSync,
                tma_loads: 0,
                mma_work: 2
            }
        );
        assert_eq!(fwd.other_per_32_mma(), Some(48.0));
        assert_eq!(m["conv2_pad_channels"], LoopMix::default());
        assert_eq!(m["conv2_pad_channels"].other_per_32_mma(), None);
    }

    #[test]
    fn ptxas_notes_are_the_log_lines_naming_the_kernel() {
        let log = "ptxas info    : (C7517) warpgroup.wait is injected in around line 7 by compiler to allow use of registers defined by GMMA in function 'conv3_fwd_1x1_p'\nptxas info    : (C7518) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.DP in divergent path in the function 'conv3_fwd_1x1_p_x'\n";
        let notes = ptxas_notes(log, "conv3_fwd_1x1_p");
        assert_eq!(notes.len(), 1, "{notes:?}");
        assert!(notes[0].contains("C7517"), "{notes:?}");
        assert!(ptxas_notes(log, "conv3_fwd_1x1").is_empty());
        assert_eq!(ptxas_notes(log, "conv3_fwd_1x1_p_x").len(), 1);
    }

    #[test]
    fn res_usage_fields_per_function() {
        let text = "\nResource usage:\n Common:\n  GLOBAL:300 CONSTANT[4]:672\n Function conv2_fwd_128x128:\n  REG:168 STACK:0 SHARED:1536 LOCAL:0 CONSTANT[0]:592 TEXTURE:0 SURFACE:0 SAMPLER:0\n Function conv_fwd_vec:\n  REG:255 STACK:16 SHARED:33280 LOCAL:24 CONSTANT[0]:580\n";
        let u = parse_res_usage(text);
        assert_eq!(u.len(), 2);
        assert_eq!(
            u["conv2_fwd_128x128"],
            ResUsage {
                regs: 168,
                shared: 1536,
                local: 0,
                stack: 0
            }
        );
        assert_eq!(
            u["conv_fwd_vec"],
            ResUsage {
                regs: 255,
                shared: 33280,
                local: 24,
                stack: 16
            }
        );
    }

    #[test]
    fn occupancy_limits() {
        // 168 registers × 256 threads: 43008 per block → 1 block by registers.
        assert_eq!(blocks_per_sm(168, 256, 82_000, 233_472), 1);
        // 128 registers × 256 threads = 32768 → 2; 80 KiB + 1 KiB → 2 by shared memory.
        assert_eq!(blocks_per_sm(128, 256, 83_456, 233_472), 2);
        // 64 threads of few registers: the 32-block cap.
        assert_eq!(blocks_per_sm(16, 64, 0, 233_472), 32);
        assert_eq!(
            launch_geometry("conv2_wgrad_c8_64x128"),
            Some((128, 53_248))
        );
        assert_eq!(launch_geometry("conv_fwd_vec"), Some((256, 0)));
        assert_eq!(launch_geometry("conv2_pad_channels"), None);
    }
}
