//! The source tree's architecture rules (one test binary; `cargo test --test architecture`).

mod dependency_order;
