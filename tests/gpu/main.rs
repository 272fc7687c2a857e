//! The CUDA backend: NVRTC compilation and the kernels on the host emulator (run everywhere),
//! and the `#[ignore]`d tests that need a GPU, one module per area (`cargo test --release
//! --test gpu -- --ignored cuda_kernels::`; `scripts/gpu-build.sh` and `scripts/gpu-run.sh`
//! run them on the GPU machine).

mod bf16_cpu;
mod cuda_bench_step;
mod cuda_emulation;
mod cuda_graph;
mod cuda_kernels;
mod cuda_memory;
mod cuda_nvrtc;
mod cuda_optim_state;
mod cuda_step;
mod cuda_sync_bn;
mod dist_gpu;
mod mismatch;
mod support;
mod train_gpu;
mod train_gpu_accum;
mod train_gpu_ranks;
