//! A damaged cache file is never served: damaged records are decoded again and rewritten,
//! a damaged header or bitmap rebuilds the file, and bad-file marks need their tag.

use crate::common;

use std::collections::HashMap;
use std::path::Path;

use common::{collect, synth, CacheLayout, Fixture, Seen};

/// The pixels each sample id gets, from a list of batches.
fn pixels_by_id(p: &pipeline::Pipeline, epoch: u64) -> HashMap<u64, u64> {
    let mut out = HashMap::new();
    for batch in p.epoch(epoch, 0, 0).unwrap() {
        let batch = batch.unwrap();
        let record = (batch.image_size as usize).pow(2) * 3;
        for (j, id) in batch.sample_ids.iter().enumerate() {
            let px = &batch.pixels()[j * record..(j + 1) * record];
            out.insert(*id, xxhash_rust::xxh3::xxh3_64(px));
        }
    }
    out
}

/// A filled cache for `fx` and the pixels every sample decodes to.
fn filled(fx: &Fixture) -> (std::path::PathBuf, usize, HashMap<u64, u64>) {
    let p = fx.builder().batch_size(4).build().unwrap();
    let reference = pixels_by_id(&p, 0);
    assert_eq!(p.stats().decoded as usize, p.len());
    (p.cache_path().to_path_buf(), p.len(), reference)
}

/// Edits the file in place (never truncated: a live pipeline may map it).
fn edit(path: &Path, f: impl FnOnce(&mut Vec<u8>)) {
    use std::os::unix::fs::FileExt;
    let mut bytes = std::fs::read(path).unwrap();
    f(&mut bytes);
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.write_all_at(&bytes, 0).unwrap();
}

#[test]
fn damaged_records_past_the_header_are_decoded_again_and_rewritten() {
    let fx = synth(2, 6, 0); // 12 images, 16×16
    let (path, n, reference) = filled(&fx);
    let layout = CacheLayout::new(n, 16);
    // Flip one byte in each of three records, and overwrite a fourth entirely.
    edit(&path, |bytes| {
        for i in [1usize, 5, 9] {
            bytes[layout.records + i * layout.record_bytes + 100] ^= 0x40;
        }
        let at = layout.records + 11 * layout.record_bytes;
        bytes[at..at + layout.record_bytes].fill(0);
    });
    let p = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(
        pixels_by_id(&p, 1),
        reference,
        "every image gets its true pixels"
    );
    assert_eq!(p.cache_health().damaged_records, 4);
    assert_eq!(p.stats().decoded, 4, "only the damaged records are decoded");
    drop(p);
    // They were rewritten: the next process decodes nothing and finds nothing damaged.
    let p = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(pixels_by_id(&p, 2), reference);
    assert_eq!(p.stats().decoded, 0);
    assert_eq!(p.cache_health().damaged_records, 0);
}

#[test]
fn a_record_moved_to_another_slot_fails_its_check() {
    let fx = synth(2, 3, 0);
    let (path, n, reference) = filled(&fx);
    let layout = CacheLayout::new(n, 16);
    // Record 0 is copied over record 1: valid pixels, wrong place.
    edit(&path, |bytes| {
        let (a, b) = (layout.records, layout.records + layout.record_bytes);
        let first = bytes[a..a + layout.record_bytes].to_vec();
        bytes[b..b + layout.record_bytes].copy_from_slice(&first);
    });
    let p = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(pixels_by_id(&p, 0), reference);
    assert_eq!(p.cache_health().damaged_records, 1);
}

#[test]
fn bad_bits_set_in_a_closed_cache_rebuild_it_and_nothing_counts_as_bad() {
    let fx = synth(2, 6, 0);
    let (path, n, reference) = filled(&fx);
    let layout = CacheLayout::new(n, 16);
    edit(&path, |bytes| bytes[layout.bad..layout.bad + 8].fill(0xFF));
    let report = fx.cache.path().join("bad.jsonl");
    std::fs::write(&report, "an earlier run's report\n").unwrap();
    let p = fx
        .builder()
        .batch_size(4)
        .bad_files_report(&report)
        .build()
        .unwrap();
    assert!(p.bad_files().is_empty(), "{:?}", p.bad_files());
    assert_eq!(pixels_by_id(&p, 0), reference);
    assert_eq!(p.stats().decoded as usize, n, "the file was rebuilt");
    // No bad file: nothing written, and an earlier report is not the engine's to judge.
    assert_eq!(
        std::fs::read_to_string(&report).unwrap(),
        "an earlier run's report\n"
    );
}

#[test]
fn bad_bits_without_their_tag_are_ignored_in_a_cache_being_filled() {
    let fx = synth(2, 6, 0);
    let (path, n, reference) = filled(&fx);
    let layout = CacheLayout::new(n, 16);
    // State `filling` of this boot (a killed writer): the map checksum is not yet valid, so
    // each mark is checked against its tag instead.
    edit(&path, |bytes| {
        bytes[12..16].copy_from_slice(&1u32.to_le_bytes());
        bytes[layout.bad..layout.bad + 8].fill(0xFF);
    });
    let p = fx.builder().batch_size(4).build().unwrap();
    assert!(p.bad_files().is_empty(), "{:?}", p.bad_files());
    assert_eq!(pixels_by_id(&p, 0), reference);
    assert_eq!(p.cache_health().damaged_records as usize, n);
}

#[test]
fn damaged_labels_or_checks_rebuild_the_file() {
    for region in ["labels", "checks", "filled"] {
        let fx = synth(2, 3, 0);
        let (path, n, reference) = filled(&fx);
        let layout = CacheLayout::new(n, 16);
        edit(&path, |bytes| {
            let at = match region {
                "labels" => layout.labels + 4,
                "checks" => layout.checks + 8 * 2,
                _ => layout.filled,
            };
            bytes[at] ^= 0x01;
        });
        let p = fx.builder().batch_size(4).build().unwrap();
        assert_eq!(pixels_by_id(&p, 0), reference, "{region}");
        assert_eq!(p.stats().decoded as usize, n, "{region}: rebuilt");
    }
}

#[test]
fn a_damaged_record_found_by_a_second_filler_is_decoded_and_rewritten() {
    let fx = synth(2, 6, 0);
    let (path, n, reference) = filled(&fx);
    let layout = CacheLayout::new(n, 16);
    // The first pipeline holds the file while the damage happens under it, so the second
    // joins it as a filler (its map checksum is not checked then): it must verify, not
    // trust, and rewrite the damaged record.
    let first = fx.builder().batch_size(4).build().unwrap();
    edit(&path, |bytes| {
        bytes[layout.records + 3 * layout.record_bytes + 7] ^= 0xFF;
    });
    let second = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(pixels_by_id(&second, 0), reference);
    assert_eq!(second.cache_health().damaged_records, 1);
    assert_eq!(second.stats().decoded, 1);
    // A second epoch does not count it twice, nor decode it again.
    assert_eq!(pixels_by_id(&second, 1), reference);
    assert_eq!(second.cache_health().damaged_records, 1);
    assert_eq!(second.stats().decoded, 1);
    drop(first);
    drop(second);
    let next = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(pixels_by_id(&next, 0), reference);
    assert_eq!(next.stats().decoded, 0, "the record was rewritten");
    assert_eq!(next.cache_health(), pipeline::CacheHealth::default());
}

#[test]
fn an_undamaged_cache_is_verified_once_per_process() {
    let fx = synth(2, 6, 0);
    let (_, _, reference) = filled(&fx);
    let p = fx.builder().batch_size(4).build().unwrap();
    let first: Vec<Seen> = collect(&p, 3, 0, 0);
    assert_eq!(pixels_by_id(&p, 4), reference);
    assert_eq!(p.stats().decoded, 0);
    assert_eq!(p.cache_health(), pipeline::CacheHealth::default());
    assert_eq!(first.iter().map(|b| b.ids.len()).sum::<usize>(), 12);
}
