//! `birdtrain bench_scaling` (being written).
