//! birdtrain's input engine (work in progress).
