//! backend (being written).
