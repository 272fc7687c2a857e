//! birdtrain: a data-pipeline-centric ResNet trainer (work in progress).
