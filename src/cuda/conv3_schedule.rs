//! How the v3 forward and data-gradient GEMMs walk their tiles (`BIRDTRAIN_CONV3_TILES`): one
//! block per tile in row-major grid order (`blocks`, the default), or the persistent kernels of
//! kernels/conv3.cu (`_p`, `_n64_p`: `conv3_gemm_p`) with one block per tile (`raster`, the
//! 128-column tiles) or one block per SM (`persistent`; two for the 64-column tiles).
//!
//! Why: a one-tile block's grid runs its row tiles first, so the column tiles of one row of
//! A (the activations) run a whole wave of row tiles apart and each reads A from memory again;
//! and its epilogue runs after the last k-step on all 384 threads in the stages' memory, so the
//! SM loads nothing while it runs. The `_p` kernels take the column tiles innermost (the blocks
//! that run at once share their rows of A) and, with fewer blocks than tiles, load the next
//! tile's stages during the epilogue, which has its own shared memory and runs on the two
//! consumer warpgroups. Every schedule computes each tile the same way, so all three give the
//! same bits. The 64-column tiles (one column tile per GEMM: their order is the grid's) run
//! persistent only under `persistent`, two blocks an SM on a ring of 3 stages; the weight
//! gradients keep one block per tile under every schedule.

use super::conv3::{self, Conv3Args};
use super::CudaError;

/// The environment variable that picks the schedule: `blocks` (unset), `raster` or
/// `persistent`. `blocks` stays the default until a GPU has measured another one faster.
pub const TILES_ENV: &str = "BIRDTRAIN_CONV3_TILES";

/// How the v3 forward and data-gradient GEMMs walk their tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum TileSchedule {
    /// One block per tile, the grid's row tiles first (`conv3_gemm`).
    #[default]
    Blocks,
    /// The 128-column `_p` kernels with one block per tile: the column tiles innermost.
    Raster,
    /// The `_p` and `_n64_p` kernels with one block per SM (two for the 64-column tiles), each
    /// walking a tile every `blocks` tiles and loading the next tile's stages during the
    /// current one's epilogue.
    Persistent,
}

impl TileSchedule {
    /// Parses the value of `BIRDTRAIN_CONV3_TILES` (unset or empty: `blocks`).
    pub fn parse(value: Option<&str>) -> Result<TileSchedule, CudaError> {
        match value.map(str::trim) {
            None | Some("") | Some("blocks") => Ok(TileSchedule::Blocks),
            Some("raster") => Ok(TileSchedule::Raster),
            Some("persistent") => Ok(TileSchedule::Persistent),
            Some(other) => Err(CudaError::Unsupported {
                what: format!(
                    "{TILES_ENV}={other:?}: expected blocks (one block per tile), raster (one \
                     block per tile, column tiles innermost) or persistent (one block per SM); \
                     unset means blocks"
                ),
            }),
        }
    }

    /// The schedule `BIRDTRAIN_CONV3_TILES` asks for.
    pub fn from_env() -> Result<TileSchedule, CudaError> {
        TileSchedule::parse(std::env::var(TILES_ENV).ok().as_deref())
    }

    /// Its name in `BIRDTRAIN_CONV3_TILES`.
    pub fn name(self) -> &'static str {
        match self {
            TileSchedule::Blocks => "blocks",
            TileSchedule::Raster => "raster",
            TileSchedule::Persistent => "persistent",
        }
    }

    /// The kernel that runs the GEMM of `kernel` (a v3 kernel chosen by tile shape,
    /// [`conv3::with_tile`]) under this schedule: its persistent twin where it has one (under
    /// `raster`, the 128-column kernels' only), else itself.
    pub fn kernel(self, kernel: &'static str) -> &'static str {
        let wide = conv3::kernel_tile(kernel) == (conv3::TILE_M, conv3::TILE_N);
        match self {
            TileSchedule::Blocks => kernel,
            TileSchedule::Raster if !wide => kernel,
            TileSchedule::Raster | TileSchedule::Persistent => {
                conv3::persistent_twin(kernel).unwrap_or(kernel)
            }
        }
    }

    /// The grid of `kernel` (what [`Self::kernel`] returned) over the GEMM of `args` on a GPU
    /// of `sms` multiprocessors.
    pub fn grid(self, kernel: &str, args: &Conv3Args, sms: u32) -> (u32, u32, u32) {
        let blocks = conv3::grid(args);
        if !conv3::is_persistent(kernel) {
            return blocks;
        }
        let tiles = blocks.0 * blocks.1 * blocks.2;
        // As many blocks as fit the SMs at once: two of the 64-column kernels an SM.
        let per_sm = if conv3::kernel_tile(kernel).1 == conv3::TILE_N {
            1
        } else {
            2
        };
        match self {
            TileSchedule::Persistent => (tiles.min(per_sm * sms.max(1)), 1, 1),
            TileSchedule::Blocks | TileSchedule::Raster => (tiles, 1, 1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda::conv3::{is_persistent, persistent_twin};
    use crate::cuda::KernelFile;

    #[test]
    fn parses_the_three_schedules_and_names_a_bad_value() {
        assert_eq!(TileSchedule::parse(None).unwrap(), TileSchedule::Blocks);
        assert_eq!(TileSchedule::parse(Some("")).unwrap(), TileSchedule::Blocks);
        for s in [
            TileSchedule::Blocks,
            TileSchedule::Raster,
            TileSchedule::Persistent,
        ] {
            assert_eq!(TileSchedule::parse(Some(s.name())).unwrap(), s);
        }
        assert_eq!(
            TileSchedule::parse(Some(" persistent ")).unwrap(),
            TileSchedule::Persistent
        );
        let e = TileSchedule::parse(Some("pingpong"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("BIRDTRAIN_CONV3_TILES=\"pingpong\"") && e.contains("expected blocks"),
            "{e}"
        );
    }

    /// Every forward and data-gradient kernel has a twin in conv3.cu (`raster` takes the
    /// 128-column ones only); the weight gradients have none and keep their kernel under every
    /// schedule.
    #[test]
    fn the_persistent_twins_exist_and_only_for_the_wide_gemms() {
        let names = KernelFile::by_name(conv3::FILE).unwrap().kernel_names();
        let wide = [
            conv3::FWD_KERNEL,
            conv3::FWD_STATS_KERNEL,
            conv3::DGRAD_KERNEL,
            conv3::DGRAD_BN_KERNEL,
            conv3::FWD_3X3_KERNEL,
            conv3::FWD_STATS_3X3_KERNEL,
            conv3::DGRAD_3X3_KERNEL,
            conv3::DGRAD_BN_3X3_KERNEL,
        ];
        for k in wide {
            let twin = persistent_twin(k).unwrap();
            assert_eq!(twin, format!("{k}_p"));
            assert!(names.iter().any(|n| n == twin), "{twin} is not in conv3.cu");
            assert!(is_persistent(twin) && !is_persistent(k));
            assert_eq!(TileSchedule::Blocks.kernel(k), k);
            assert_eq!(TileSchedule::Raster.kernel(k), twin);
            assert_eq!(TileSchedule::Persistent.kernel(k), twin);
            assert_eq!(conv3::smem_bytes(twin), conv3::P_SMEM_BYTES);
        }
        let narrow: Vec<&'static str> = wide
            .iter()
            .map(|k| conv3::with_tile(k, conv3::TILE_N_NARROW))
            .collect();
        for &k in &narrow {
            let twin = persistent_twin(k).unwrap();
            assert_eq!(twin, format!("{k}_p"));
            assert!(names.iter().any(|n| n == twin), "{twin} is not in conv3.cu");
            assert_eq!(TileSchedule::Raster.kernel(k), k);
            assert_eq!(TileSchedule::Persistent.kernel(k), twin);
            assert_eq!(conv3::smem_bytes(twin), conv3::N64_P_SMEM_BYTES);
            assert_eq!(conv3::kernel_tile(twin), (128, 64));
        }
        for k in [
            conv3::WGRAD_KERNEL,
            conv3::with_tile(conv3::WGRAD_KERNEL, conv3::TILE_N_NARROW),
            conv3::WGRAD_3X3_M64_KERNEL,
        ] {
            assert_eq!(persistent_twin(k), None);
            assert_eq!(TileSchedule::Persistent.kernel(k), k);
        }
        // Every `_p` kernel of the file is somebody's twin.
        let twins: Vec<&str> = wide
            .iter()
            .chain(&narrow)
            .filter_map(|k| persistent_twin(k))
            .collect();
        for n in names.iter().filter(|n| is_persistent(n)) {
            assert!(twins.contains(&n.as_str()), "{n} has no original");
        }
    }

    #[test]
    fn grids_cover_every_tile_once_or_one_block_per_sm() {
        // resnet50's first 1×1 at batch 256: 802 816 × 256 output of 64 channels.
        let args = conv3::dgrad_args(
            &crate::backend::ConvShape {
                n: 256,
                c_in: 256,
                h: 56,
                w: 56,
                c_out: 64,
                kernel: 1,
                stride: 1,
                padding: 0,
            },
            false,
        )
        .unwrap();
        let kernel = conv3::DGRAD_BN_KERNEL;
        let blocks = conv3::grid(&args);
        assert_eq!(blocks, (6272, 2, 1));
        assert_eq!(TileSchedule::Blocks.grid(kernel, &args, 132), blocks);
        let twin = TileSchedule::Raster.kernel(kernel);
        assert_eq!(TileSchedule::Raster.grid(twin, &args, 132), (12544, 1, 1));
        assert_eq!(TileSchedule::Persistent.grid(twin, &args, 132), (132, 1, 1));
        // Fewer tiles than SMs: one block per tile.
        let small = Conv3Args { m: 300, ..args };
        assert_eq!(TileSchedule::Persistent.grid(twin, &small, 132), (6, 1, 1));
        // 64 columns (its data gradient to 64 channels): two blocks an SM.
        let narrow = Conv3Args { n: 64, ..args };
        let twin =
            TileSchedule::Persistent.kernel(conv3::with_tile(kernel, conv3::tile_n(&narrow)));
        assert_eq!(twin, "conv3_dgrad_bn_1x1_n64_p");
        assert_eq!(
            TileSchedule::Persistent.grid(twin, &narrow, 132),
            (264, 1, 1)
        );
        // The phases of a stride-2 3×3 data gradient are tiles too.
        let s2 = conv3::dgrad_s2_args(
            &crate::backend::ConvShape {
                n: 256,
                c_in: 128,
                h: 56,
                w: 56,
                c_out: 128,
                kernel: 3,
                stride: 2,
                padding: 1,
            },
            crate::cuda::GpuArch::new(9, 0),
            false,
        )
        .unwrap();
        let (x, y, z) = conv3::grid(&s2);
        let twin = TileSchedule::Raster.kernel(conv3::DGRAD_3X3_KERNEL);
        assert_eq!(TileSchedule::Raster.grid(twin, &s2, 132), (x * y * z, 1, 1));
    }
}
