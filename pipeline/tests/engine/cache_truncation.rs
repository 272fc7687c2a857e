//! A dropped pipeline has released its mapped cache file by the time `drop` returns, so the
//! caller may rewrite or delete the file right away (a late write through the map into a file
//! cut meanwhile would be a SIGBUS).

use crate::common;

use common::{collect, synth};

fn cut(path: &std::path::Path, len: u64) {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(len)
        .unwrap();
}

#[test]
fn dropping_a_pipeline_releases_its_cache_file_before_returning() {
    let fx = synth(2, 3, 0); // 6 images
    let path = {
        let p = fx.builder().batch_size(2).build().unwrap();
        collect(&p, 0, 0, 0);
        p.cache_path().to_path_buf()
    };
    // Bounded stress (about 2 s): before the fix the last owner of the cache was often a stage task
    // dropped on the runtime's thread after `drop` returned, which then wrote the header of
    // a file the caller had already rewritten (SIGBUS if it was cut, a clobbered state
    // otherwise).
    for round in 0..300 {
        let p = fx.builder().batch_size(2).prefetch(2).build().unwrap();
        if round % 2 == 0 {
            collect(&p, 0, 0, 0);
        } else {
            // Stop mid-epoch: planner and assembler tasks are still alive at drop time.
            let mut it = p.epoch(0, 0, 0).unwrap();
            it.next().unwrap().unwrap();
            drop(it);
        }
        drop(p);
        let full = std::fs::read(&path).unwrap();
        cut(&path, 0);
        // A state no pipeline writes (`filling` from a foreign boot): must be rebuilt, which
        // proves that no late destructor overwrote it.
        let mut bytes = full;
        bytes[12..16].copy_from_slice(&1u32.to_le_bytes());
        bytes[48..84].fill(b'0');
        std::fs::write(&path, &bytes).unwrap();
        let q = fx.builder().batch_size(2).build().unwrap();
        collect(&q, 0, 0, 0);
        assert_eq!(
            q.stats().decoded,
            6,
            "round {round}: the header was rebuilt"
        );
    }
}
