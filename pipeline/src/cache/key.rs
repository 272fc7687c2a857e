//! What a cache file must have been made for to be served.

/// What the header must say for the cache to be usable.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CacheKey {
    pub(crate) image_size: u32,
    pub(crate) count: usize,
    pub(crate) fingerprint: u64,
}
