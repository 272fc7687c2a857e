//! The memory-mapped cache: later epochs decode nothing, edits invalidate it, a torn cache is
//! resumed without serving torn records, two pipelines share one file safely.

use crate::common;

use common::{collect, synth, CacheLayout};

#[test]
fn second_epoch_decodes_zero_and_serves_identical_pixels() {
    let fx = synth(3, 5, 0);
    let p = fx.builder().batch_size(4).build().unwrap();
    let first = collect(&p, 0, 0, 0);
    assert_eq!(p.stats().decoded, 15);
    let again = collect(&p, 0, 0, 0);
    let s = p.stats();
    assert_eq!(s.decoded, 15, "the second pass decodes nothing");
    assert_eq!(s.cache_hits, 15);
    assert_eq!(first, again, "cached pixels equal freshly decoded ones");
    assert!((s.cache_fill - 1.0).abs() < 1e-9);
    // A new pipeline (a new process, in effect) reuses the file.
    drop(p);
    let p2 = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), first);
    assert_eq!(p2.stats().decoded, 0);
}

#[test]
fn without_the_cache_nothing_is_written_and_every_pass_decodes() {
    let fx = synth(3, 5, 0);
    let p = fx.builder().batch_size(4).cache(false).build().unwrap();
    let first = collect(&p, 0, 0, 0);
    let again = collect(&p, 0, 0, 0);
    let s = p.stats();
    assert_eq!((s.decoded, s.cache_hits), (30, 0), "{s:?}");
    assert_eq!(first, again, "the same pixels each pass");
    assert_eq!(
        std::fs::read_dir(fx.cache.path()).unwrap().count(),
        0,
        "no cache file"
    );
    drop(p);
    // The same pixels as the cache serves.
    let cached = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(collect(&cached, 0, 0, 0), first);
}

#[test]
fn buffers_are_recycled_so_allocations_stay_bounded() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    struct Counting(AtomicUsize);
    impl pipeline::BatchAllocator for Counting {
        fn allocate(
            &self,
            n: usize,
        ) -> Result<Box<dyn pipeline::HostBuffer>, pipeline::PipelineError> {
            self.0.fetch_add(1, Ordering::Relaxed);
            Ok(Box::new(vec![0u8; n]))
        }
    }
    let fx = synth(2, 8, 0); // 16 images, 8 batches of 2 per epoch
    let alloc = Arc::new(Counting(AtomicUsize::new(0)));
    let p = fx
        .builder()
        .batch_size(2)
        .prefetch(2)
        .allocator(alloc.clone())
        .build()
        .unwrap();
    for epoch in 0..5 {
        collect(&p, epoch, 0, 0);
    }
    // In flight at most: planner 1 + pending 2 + assembler 1 + ready 2 + consumer 1.
    let allocated = alloc.0.load(Ordering::Relaxed);
    assert!(
        allocated <= 7,
        "{allocated} buffers for 40 batches: they are recycled"
    );
    assert_eq!(
        p.free_buffers(),
        allocated,
        "every buffer is back in the pool"
    );
}

#[test]
fn a_changed_file_invalidates_the_cache() {
    let fx = synth(2, 4, 0);
    let p = fx.builder().batch_size(8).build().unwrap();
    let fp = p.fingerprint();
    let path = p.cache_path().to_path_buf();
    collect(&p, 0, 0, 0);
    drop(p);
    // Rewrite one image with other content (and so other size/mtime).
    let victim = common::files_under(&fx.root().join("train"))[0].clone();
    let img = image::RgbImage::from_pixel(30, 30, image::Rgb([250, 10, 10]));
    std::thread::sleep(std::time::Duration::from_millis(20));
    img.save_with_format(&victim, image::ImageFormat::Png)
        .unwrap();
    let p2 = fx.builder().batch_size(8).build().unwrap();
    assert_ne!(p2.fingerprint(), fp);
    assert_eq!(p2.cache_path(), path, "same file name, rebuilt in place");
    let batches = collect(&p2, 0, 0, 0);
    assert_eq!(p2.stats().decoded, 8, "a mismatched cache is never served");
    // The edited image (sample 0) is solid red after resizing.
    assert_eq!(batches.iter().map(|b| b.ids.len()).sum::<usize>(), 8);
    let q = fx.builder().batch_size(8).shuffle(false).build().unwrap();
    let first = q.epoch(0, 0, 0).unwrap().next().unwrap().unwrap();
    assert!(first.pixels()[..16 * 16 * 3]
        .chunks(3)
        .all(|px| px == [250, 10, 10]));
}

#[test]
fn a_stopped_fill_is_resumed() {
    let fx = synth(2, 6, 0); // 12 images
    let reference = {
        let other = tempfile::tempdir().unwrap();
        let p = fx
            .builder()
            .cache_dir(other.path())
            .batch_size(4)
            .build()
            .unwrap();
        collect(&p, 0, 0, 0)
    };
    // Take one step and stop: the cache is left partly filled.
    let p = fx
        .builder()
        .batch_size(4)
        .workers(1)
        .prefetch(1)
        .build()
        .unwrap();
    let mut it = p.epoch(0, 0, 0).unwrap();
    it.next().unwrap().unwrap();
    drop(it);
    drop(p);
    let p2 = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), reference);
    let decoded = p2.stats().decoded;
    assert!(
        decoded <= 8,
        "the records of the first step are reused (decoded {decoded})"
    );
}

#[test]
fn a_torn_cache_never_serves_records_whose_bit_is_unset() {
    let fx = synth(2, 6, 0); // 12 images
    let p = fx.builder().batch_size(4).build().unwrap();
    let reference = collect(&p, 0, 0, 0);
    let path = p.cache_path().to_path_buf();
    drop(p);
    // A kill between writing pixels and setting the bit: records 0..6 hold garbage and their
    // bits are clear, and the header still says `filling` (this boot).
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12..16].copy_from_slice(&1u32.to_le_bytes());
    let layout = CacheLayout::new(12, 16);
    let bitmap = layout.filled;
    let word = u64::from_le_bytes(bytes[bitmap..bitmap + 8].try_into().unwrap());
    assert_eq!(word, (1 << 12) - 1, "a full cache has all 12 bits set");
    bytes[bitmap..bitmap + 8].copy_from_slice(&(word & !0b11_1111).to_le_bytes());
    let rec = 16 * 16 * 3;
    let start = layout.records;
    bytes[start..start + 6 * rec].fill(0xAB);
    std::fs::write(&path, &bytes).unwrap();
    let p2 = fx.builder().batch_size(4).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), reference);
    assert_eq!(
        p2.stats().decoded,
        6,
        "exactly the torn records are decoded again"
    );
}

#[test]
fn a_cache_left_filling_by_another_boot_is_rebuilt() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(6).build().unwrap();
    let reference = collect(&p, 0, 0, 0);
    let path = p.cache_path().to_path_buf();
    drop(p);
    // State `filling` (1) with a boot id that is not this machine's current one: after a
    // crash, set bits may not be durable, so nothing may be trusted.
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12..16].copy_from_slice(&1u32.to_le_bytes());
    bytes[48..84].fill(b'0');
    std::fs::write(&path, &bytes).unwrap();
    let p2 = fx.builder().batch_size(6).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), reference);
    assert_eq!(p2.stats().decoded, 6);
}

#[test]
fn a_corrupt_header_is_rebuilt() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(6).build().unwrap();
    let reference = collect(&p, 0, 0, 0);
    let path = p.cache_path().to_path_buf();
    drop(p);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] = b'X';
    std::fs::write(&path, bytes).unwrap();
    let p2 = fx.builder().batch_size(6).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), reference);
    assert_eq!(p2.stats().decoded, 6);
}

#[test]
fn two_pipelines_on_one_cache_file_agree_and_do_not_corrupt_it() {
    let fx = synth(3, 6, 0);
    let a = fx.builder().batch_size(3).build().unwrap();
    let b = fx.builder().batch_size(3).build().unwrap();
    assert_eq!(a.cache_path(), b.cache_path());
    let (ra, rb) = std::thread::scope(|s| {
        let ha = s.spawn(|| collect(&a, 0, 0, 0));
        let hb = s.spawn(|| collect(&b, 0, 0, 0));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    assert_eq!(ra, rb);
    drop((a, b));
    let c = fx.builder().batch_size(3).build().unwrap();
    assert_eq!(
        collect(&c, 0, 0, 0),
        ra,
        "the shared file holds correct records"
    );
}

#[test]
fn a_cache_left_filling_by_a_killed_process_of_this_boot_is_resumed() {
    let Ok(boot) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
        return; // No boot id on this OS: such caches are always rebuilt (tested above).
    };
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(6).build().unwrap();
    let reference = collect(&p, 0, 0, 0);
    let path = p.cache_path().to_path_buf();
    drop(p);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[12..16].copy_from_slice(&1u32.to_le_bytes());
    bytes[48..84].copy_from_slice(boot.trim().as_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let p2 = fx.builder().batch_size(6).build().unwrap();
    assert_eq!(collect(&p2, 0, 0, 0), reference);
    assert_eq!(
        p2.stats().decoded,
        0,
        "a kill keeps the page cache: set bits are exact"
    );
}

#[test]
fn the_dataset_folder_is_never_written() {
    let fx = synth(2, 3, 2);
    let listing = |root: &std::path::Path| -> Vec<(std::path::PathBuf, std::time::SystemTime)> {
        common::files_under(root)
            .into_iter()
            .map(|p| {
                let m = std::fs::metadata(&p).unwrap().modified().unwrap();
                (p, m)
            })
            .collect()
    };
    let before = listing(fx.root());
    let p = fx.builder().batch_size(4).build().unwrap();
    collect(&p, 0, 0, 0);
    assert!(p.cache_path().starts_with(fx.cache.path()));
    drop(p);
    assert_eq!(
        listing(fx.root()),
        before,
        "nothing created or touched under the dataset"
    );
}

#[test]
fn a_truncated_cache_file_is_rebuilt() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(6).build().unwrap();
    let reference = collect(&p, 0, 0, 0);
    let path = p.cache_path().to_path_buf();
    drop(p);
    for len in [0u64, 100, 5000] {
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(len)
            .unwrap();
        let p2 = fx.builder().batch_size(6).build().unwrap();
        assert_eq!(collect(&p2, 0, 0, 0), reference);
        assert_eq!(p2.stats().decoded, 6, "length {len}");
    }
}

#[test]
fn touching_a_file_invalidates_the_cache_but_not_the_rendezvous_fingerprint() {
    let fx = synth(2, 3, 0);
    let p = fx.builder().batch_size(6).build().unwrap();
    collect(&p, 0, 0, 0);
    let fp = p.fingerprint();
    drop(p);
    let victim = common::files_under(&fx.root().join("train"))[2].clone();
    let later = std::time::SystemTime::now() + std::time::Duration::from_secs(60);
    std::fs::File::options()
        .write(true)
        .open(&victim)
        .unwrap()
        .set_modified(later)
        .unwrap();
    let p2 = fx.builder().batch_size(6).build().unwrap();
    assert_eq!(
        p2.fingerprint(),
        fp,
        "copies of the data on other nodes match"
    );
    collect(&p2, 0, 0, 0);
    assert_eq!(p2.stats().decoded, 6, "the cache is keyed on mtimes too");
}

/// A solid `colour` image of 24×20 pixels as a BMP: every such file has the same length,
/// whatever its colour.
fn solid_bmp(colour: [u8; 3]) -> Vec<u8> {
    let img = image::RgbImage::from_pixel(24, 20, image::Rgb(colour));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Bmp).unwrap();
    out.into_inner()
}

/// The pixels served for `path` in one unshuffled epoch of `p` (16×16 images).
fn pixels_of(p: &pipeline::Pipeline, path: &std::path::Path) -> Vec<u8> {
    for batch in p.epoch(0, 0, 0).unwrap() {
        let batch = batch.unwrap();
        for (j, id) in batch.sample_ids.iter().enumerate() {
            if p.sample_path(*id) == Some(path) {
                return batch.pixels()[j * 16 * 16 * 3..(j + 1) * 16 * 16 * 3].to_vec();
            }
        }
    }
    panic!("{} was not served", path.display());
}

#[test]
fn a_file_rewritten_at_the_same_size_with_its_mtime_restored_is_decoded_again() {
    let fx = synth(2, 3, 0);
    let victim = common::files_under(&fx.root().join("train"))[1].clone();
    let old = solid_bmp([200, 30, 40]);
    std::fs::write(&victim, &old).unwrap();
    let before = std::fs::metadata(&victim).unwrap();
    let builder = || fx.builder().batch_size(6).shuffle(false);
    let p = builder().build().unwrap();
    let fp = p.fingerprint();
    assert!(pixels_of(&p, &victim)
        .chunks(3)
        .all(|px| px == [200, 30, 40]));
    assert_eq!(p.stats().decoded, 6);
    drop(p);
    // What `cp -p`, `rsync -t` or `tar x` do: other pixels, the same length, the old mtime.
    std::thread::sleep(std::time::Duration::from_millis(30));
    let new = solid_bmp([20, 160, 220]);
    assert_eq!(new.len(), old.len());
    std::fs::write(&victim, &new).unwrap();
    std::fs::File::options()
        .write(true)
        .open(&victim)
        .unwrap()
        .set_modified(before.modified().unwrap())
        .unwrap();
    let after = std::fs::metadata(&victim).unwrap();
    assert_eq!(after.len(), before.len());
    assert_eq!(after.modified().unwrap(), before.modified().unwrap());
    let p2 = builder().build().unwrap();
    assert_eq!(
        p2.fingerprint(),
        fp,
        "the data fingerprint (paths, sizes) still matches copies on other nodes"
    );
    assert!(
        pixels_of(&p2, &victim)
            .chunks(3)
            .all(|px| px == [20, 160, 220]),
        "the new pixels are served, not the cached old ones"
    );
    assert_eq!(p2.stats().decoded, 6, "the cache was rebuilt");
    drop(p2);
    let p3 = builder().build().unwrap();
    assert!(pixels_of(&p3, &victim)
        .chunks(3)
        .all(|px| px == [20, 160, 220]));
    assert_eq!(p3.stats().decoded, 0, "and the rebuilt cache is reused");
}
