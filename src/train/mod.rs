//! train (being written).
