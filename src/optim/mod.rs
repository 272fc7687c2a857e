//! optim (being written).
