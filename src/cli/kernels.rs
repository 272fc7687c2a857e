//! `birdtrain kernels` (being written).
