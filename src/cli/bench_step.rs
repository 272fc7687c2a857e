//! `birdtrain bench_step` (being written).
