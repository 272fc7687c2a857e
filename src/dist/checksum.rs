//! Bit-exact checksums of weight buffers.
//!
//! Replicas must stay bit-identical; comparing a 64-bit hash of every replica's weights every N
//! steps proves it cheaply. The hash covers the exact bit patterns (so `-0.0 != 0.0` and every
//! NaN payload counts), which is what "bit-identical" means.

use xxhash_rust::xxh3::Xxh3;

/// The XXH3-64 hash of the little-endian bit patterns of `values`.
///
/// Equal slices give equal checksums on every platform; any single-bit difference changes it
/// (with overwhelming probability).
pub fn checksum(values: &[f32]) -> u64 {
    let mut hasher = Xxh3::new();
    // Hash in fixed-size chunks so no large temporary buffer is needed.
    let mut chunk = [0u8; 4096];
    for group in values.chunks(chunk.len() / 4) {
        for (dst, v) in chunk.chunks_exact_mut(4).zip(group) {
            dst.copy_from_slice(&v.to_bits().to_le_bytes());
        }
        hasher.update(&chunk[..group.len() * 4]);
    }
    hasher.digest()
}

#[cfg(test)]
mod tests {
    use super::checksum;

    #[test]
    fn equal_inputs_equal_checksums_and_one_bit_changes_it() {
        let a: Vec<f32> = (0..10_000).map(|i| i as f32 * 0.37).collect();
        let mut b = a.clone();
        assert_eq!(checksum(&a), checksum(&b));
        b[7777] = f32::from_bits(b[7777].to_bits() ^ 1);
        assert_ne!(checksum(&a), checksum(&b));
        assert_ne!(checksum(&[0.0]), checksum(&[-0.0]));
        assert_ne!(checksum(&[]), checksum(&[0.0]));
    }
}
