//! Running out of file descriptors (`ulimit -n`) stops the epoch with one error naming the
//! limit; it never turns good images into skipped "unreadable" files.
//!
//! The limit is process-wide, so the test lowers it in a process of its own (a child of the
//! test binary), away from the other tests.

use crate::common;

use std::os::fd::AsRawFd;

use pipeline::PipelineError;

fn nofile() -> libc::rlimit {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` into the struct we own.
    assert_eq!(
        unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) },
        0
    );
    limit
}

fn set_nofile(limit: &libc::rlimit) {
    // SAFETY: setrlimit reads one `rlimit` from the struct we own.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, limit) }, 0);
}

#[test]
fn too_many_open_files_stops_the_epoch_naming_the_limit_and_skips_nothing() {
    common::in_own_process(
        "fd_limit::too_many_open_files_stops_the_epoch_naming_the_limit_and_skips_nothing",
        with_the_limit_lowered,
    );
}

fn with_the_limit_lowered() {
    let fx = common::synth(2, 8, 0);
    let p = fx.builder().workers(16).batch_size(4).build().unwrap();
    // The lowest free descriptor becomes the limit: every open from now on fails with EMFILE.
    let lowest_free = std::fs::File::open("/dev/null").unwrap().as_raw_fd();
    let saved = nofile();
    set_nofile(&libc::rlimit {
        rlim_cur: lowest_free as libc::rlim_t,
        rlim_max: saved.rlim_max,
    });
    let first = p.epoch(0, 0, 0).map(|mut it| it.next());
    set_nofile(&saved);
    let error = match first {
        Ok(Some(Err(e))) => e,
        Ok(Some(Ok(batch))) => panic!("a batch of {} images was served", batch.len),
        Ok(None) => panic!("the epoch ended without an item"),
        Err(e) => panic!("the epoch did not start: {e}"),
    };
    assert!(
        matches!(error, PipelineError::OutOfResources { .. }),
        "{error:?}"
    );
    let message = error.to_string();
    assert!(
        message.contains(&format!(
            "too many open files (the process limit, `ulimit -n`, is {lowest_free})"
        )) && message.contains("raise it or use fewer workers"),
        "{message}"
    );
    assert!(!message.contains('\n'), "one line: {message}");
    assert!(
        p.bad_files().is_empty(),
        "good images are not bad files: {:?}",
        p.bad_files()
    );
    assert_eq!(p.stats().bad_files, 0);
    // With descriptors again, the same pipeline serves every image.
    let served: usize = p.epoch(0, 0, 0).unwrap().map(|b| b.unwrap().len).sum();
    assert_eq!(served, 16);
}
