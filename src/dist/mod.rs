//! dist (being written).
