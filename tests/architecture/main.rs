//! The repository's own rules (one test binary; `cargo test --test architecture`): the source
//! tree's dependency order, and documentation that stays true to the code.

mod dependency_order;
mod docs;
