//! cuda (being written).
