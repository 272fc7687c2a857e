//! The model and the CPU backend as a library: graphs, state, gradients (finite differences and
//! PyTorch's), the optimizer, batch-norm fusion (one test binary; `cargo test --test model`).

mod backend_conformance;
mod backend_cpu_optim;
mod backend_gradcheck;
mod backend_input;
mod bn_fusion;
mod common;
mod grad_hook;
mod gradcheck;
mod graph;
mod optim_steps;
mod state;
mod torch_reference;
mod train;
