//! The staging ring's reuse logic, proven on the stream simulator: no slot is overwritten
//! before its consumer finished, batches arrive in order and intact under every interleaving,
//! and the data-wait counters count what they claim.

use std::time::Duration;

use birdtrain::cuda::staging::{
    DataWaitMeter, SimStreams, StagingError, StagingRing, StagingStreams,
};

const SLOT: usize = 16;

/// The bytes of batch `seq`: a variable length, every byte tagged with the batch.
fn batch(seq: u64) -> Vec<u8> {
    let len = 4 + (seq as usize * 5) % (SLOT - 3);
    (0..len)
        .map(|i| (seq as u8).wrapping_mul(31).wrapping_add(i as u8))
        .collect()
}

/// What the device slot holds after batch `seq` was uploaded (zero beyond the batch).
fn slot_image(seq: u64) -> Vec<u8> {
    let mut v = batch(seq);
    v.resize(SLOT, 0);
    v
}

/// The trainer's loop: keep the ring full, compute the oldest batch, repeat.
/// `drain_before_fill` models a GPU fast enough that all queued work is done whenever the host
/// comes back.
fn drive(ring: &mut StagingRing<SimStreams>, n: u64, drain_before_fill: bool) {
    let mut next = 0;
    for k in 0..n {
        while next < n && ring.can_fill() {
            if drain_before_fill {
                ring.streams_mut().drain();
            }
            let (seq, buf) = ring.begin_fill().unwrap();
            assert_eq!(seq, next);
            let data = batch(seq);
            buf[..data.len()].copy_from_slice(&data);
            ring.finish_fill(data.len()).unwrap();
            next += 1;
        }
        let staged = ring.begin_compute().unwrap();
        assert_eq!(staged.seq, k, "batches reach compute in fill order");
        assert_eq!(staged.bytes, batch(k).len());
        ring.streams_mut().launch_consume(staged.slot).unwrap();
        ring.end_compute().unwrap();
    }
    ring.streams_mut().drain();
}

#[test]
fn every_interleaving_delivers_every_batch_intact_and_in_order() {
    let n = 40;
    for depth in 1..=4 {
        for eagerness in [0, 1, 3, 8] {
            for seed in 0..25 {
                let sim = SimStreams::new(depth, SLOT, seed, eagerness);
                let mut ring = StagingRing::new(sim).unwrap();
                drive(&mut ring, n, false);
                let sim = ring.streams();
                assert!(
                    sim.violations().is_empty(),
                    "depth {depth} eagerness {eagerness} seed {seed}: {:?}",
                    sim.violations()
                );
                let expected: Vec<Vec<u8>> = (0..n).map(slot_image).collect();
                assert_eq!(
                    sim.consumed(),
                    &expected[..],
                    "depth {depth} eagerness {eagerness} seed {seed}"
                );
            }
        }
    }
}

#[test]
fn the_simulator_catches_an_upload_that_ignores_the_consumer() {
    // The bug the ring exists to prevent: refill a slot without waiting for the compute that
    // still reads it. Lazy streams (nothing runs until drained) make the race certain.
    let mut sim = SimStreams::new(1, SLOT, 7, 0);
    let copied = sim.new_event().unwrap();
    let never_recorded = sim.new_event().unwrap();
    let consumed = sim.new_event().unwrap();
    sim.host_slot(0).unwrap().fill(1);
    sim.enqueue_upload(0, SLOT, &never_recorded, &copied)
        .unwrap();
    sim.compute_wait(&copied).unwrap();
    sim.launch_consume(0).unwrap();
    sim.compute_record(&consumed).unwrap();
    // Wrong: the copy stream should wait on `consumed`, and the host on `copied`.
    sim.host_slot(0).unwrap().fill(2);
    sim.enqueue_upload(0, SLOT, &never_recorded, &copied)
        .unwrap();
    sim.drain();
    assert!(!sim.violations().is_empty(), "the race went unnoticed");
    assert_ne!(
        sim.consumed(),
        &[vec![1u8; SLOT]][..],
        "batch 0 was not corrupted?"
    );
}

#[test]
fn a_lazy_device_makes_every_reuse_wait_and_every_compute_stall() {
    let (n, depth) = (12u64, 3usize);
    let mut ring = StagingRing::new(SimStreams::new(depth, SLOT, 1, 0)).unwrap();
    drive(&mut ring, n, false);
    let stats = ring.stats();
    assert_eq!(stats.batches, n);
    // Nothing runs until the host blocks, so each refill of a used slot blocks once.
    assert_eq!(stats.host_waits, n - depth as u64);
}

#[test]
fn compute_that_gets_ahead_of_the_copies_is_measured_waiting_for_every_upload() {
    // Lazy streams that only move when drained. With one slot each batch's copy is still
    // queued when compute reaches it: run compute first and it waits for every upload; run
    // the copies first and it never does (nor with deeper rings, whose drains before each
    // refill run the copies ahead). Every batch is measured (a drain before each refill
    // completes its events before they are recorded again).
    let n = 20;
    for depth in 1..=3 {
        for compute_first in [true, false] {
            if depth > 1 && compute_first {
                continue;
            }
            let sim = SimStreams::new(depth, SLOT, 7, 0).preferring_compute(compute_first);
            let mut ring = StagingRing::new(sim).unwrap();
            drive(&mut ring, n, true);
            ring.measure_waits().unwrap();
            let stats = ring.stats();
            let case = format!("depth {depth}, compute first {compute_first}: {stats:?}");
            assert_eq!(stats.measured, n, "{case}");
            let expected = if compute_first { n } else { 0 };
            assert_eq!(stats.compute_stalls, expected, "{case}");
            assert_eq!(
                stats.compute_wait_time > Duration::ZERO,
                compute_first,
                "{case}"
            );
            assert!(ring.streams().violations().is_empty(), "{case}");
        }
    }
    // Under seeded interleavings: every batch measured, and time counted only with a stall.
    for seed in 0..20 {
        let mut ring = StagingRing::new(SimStreams::new(2, SLOT, seed, 3)).unwrap();
        drive(&mut ring, n, true);
        ring.measure_waits().unwrap();
        let stats = ring.stats();
        assert_eq!(stats.measured, n, "seed {seed}: {stats:?}");
        assert!(stats.compute_stalls <= n);
        assert_eq!(
            stats.compute_wait_time > Duration::ZERO,
            stats.compute_stalls > 0
        );
    }
}

#[test]
fn a_fast_device_never_makes_the_step_wait_for_input() {
    let n = 30u64;
    let mut ring = StagingRing::new(SimStreams::new(2, SLOT, 3, 0)).unwrap();
    drive(&mut ring, n, true);
    let stats = ring.stats();
    assert_eq!(stats.batches, n);
    assert_eq!(stats.host_waits, 0, "{stats:?}");
    assert_eq!(stats.host_wait_time, Duration::ZERO);
    // Every upload ran before compute reached its batch: the device never waited.
    ring.measure_waits().unwrap();
    let stats = ring.stats();
    assert_eq!((stats.compute_stalls, stats.measured), (0, n), "{stats:?}");
    assert_eq!(stats.compute_wait_time, Duration::ZERO);
    let sim = ring.streams();
    assert!(sim.violations().is_empty());
    assert_eq!(sim.consumed().len(), n as usize);
}

#[test]
fn the_ring_refuses_to_run_more_than_depth_ahead() {
    let mut ring = StagingRing::new(SimStreams::new(2, SLOT, 0, 2)).unwrap();
    for _ in 0..2 {
        ring.begin_fill().unwrap();
        ring.finish_fill(4).unwrap();
    }
    assert!(!ring.can_fill());
    let err = ring.begin_fill().unwrap_err();
    assert!(
        matches!(
            err,
            StagingError::RingFull {
                slot: 0,
                holding: 0,
                ..
            }
        ),
        "{err}"
    );
    // Handing batch 0 to compute is not enough: its consumer must be recorded first.
    let b = ring.begin_compute().unwrap();
    assert!(matches!(
        ring.begin_fill(),
        Err(StagingError::RingFull { .. })
    ));
    assert!(matches!(
        ring.begin_compute(),
        Err(StagingError::OutOfOrder { .. })
    ));
    ring.streams_mut().launch_consume(b.slot).unwrap();
    ring.end_compute().unwrap();
    assert!(ring.can_fill());
    let (seq, _) = ring.begin_fill().unwrap();
    assert_eq!(seq, 2);
    assert!(matches!(
        ring.begin_fill(),
        Err(StagingError::OutOfOrder { .. })
    ));
}

#[test]
fn misuse_is_reported_not_panicked() {
    let mut ring = StagingRing::new(SimStreams::new(2, SLOT, 0, 1)).unwrap();
    assert!(matches!(
        ring.begin_compute(),
        Err(StagingError::NothingStaged { seq: 0 })
    ));
    assert!(matches!(
        ring.finish_fill(1),
        Err(StagingError::OutOfOrder { .. })
    ));
    assert!(matches!(
        ring.end_compute(),
        Err(StagingError::OutOfOrder { .. })
    ));
    ring.begin_fill().unwrap();
    let err = ring.finish_fill(SLOT + 1).unwrap_err();
    assert!(err.to_string().contains("does not fit"), "{err}");
    assert!(matches!(
        StagingRing::new(SimStreams::new(0, SLOT, 0, 1)),
        Err(StagingError::ZeroDepth)
    ));
}

#[test]
fn data_wait_share_is_waiting_over_wall_time() {
    let mut meter = DataWaitMeter::default();
    assert_eq!(meter.share(), 0.0);
    meter.record(Duration::from_millis(1), Duration::from_millis(10));
    meter.record(Duration::from_millis(3), Duration::from_millis(30));
    assert!((meter.share() - 0.1).abs() < 1e-12);
    // A wait longer than the step (clock skew between measurements) counts as the whole step.
    meter.record(Duration::from_millis(50), Duration::from_millis(10));
    assert_eq!(meter.steps, 3);
    assert!((meter.share() - 14.0 / 50.0).abs() < 1e-12);
}

/// A batch in "engine-owned" memory, as the pipeline hands it over.
struct EngineBatch(Vec<u8>);

impl AsRef<[u8]> for EngineBatch {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

#[test]
fn external_batches_stay_alive_until_uploaded_and_arrive_in_order() {
    use std::sync::{Arc, Weak};
    let n = 30u64;
    for depth in 1..=3 {
        for seed in 0..20 {
            let mut ring = StagingRing::new(SimStreams::new(depth, SLOT, seed, 2)).unwrap();
            let mut released: Vec<Weak<EngineBatch>> = Vec::new();
            let mut next = 0;
            for k in 0..n {
                while next < n && ring.can_fill() {
                    let batch = Arc::new(EngineBatch(batch(next)));
                    released.push(Arc::downgrade(&batch));
                    assert_eq!(ring.stage_external(batch).unwrap(), next);
                    next += 1;
                }
                let staged = ring.begin_compute().unwrap();
                assert_eq!(staged.seq, k);
                ring.streams_mut().launch_consume(staged.slot).unwrap();
                ring.end_compute().unwrap();
            }
            // The ring holds at most one batch per slot: older ones went back to the engine.
            let alive = released.iter().filter(|w| w.upgrade().is_some()).count();
            assert!(alive <= depth, "depth {depth}: {alive} batches still held");
            ring.streams_mut().drain();
            let sim = ring.streams();
            assert!(sim.violations().is_empty(), "{:?}", sim.violations());
            let expected: Vec<Vec<u8>> = (0..n).map(slot_image).collect();
            assert_eq!(sim.consumed(), &expected[..], "depth {depth} seed {seed}");
        }
    }
}

#[test]
fn an_oversized_external_batch_is_refused() {
    let mut ring = StagingRing::new(SimStreams::new(2, SLOT, 0, 1)).unwrap();
    let err = ring
        .stage_external(std::sync::Arc::new(EngineBatch(vec![0; SLOT + 1])))
        .unwrap_err();
    assert!(matches!(err, StagingError::TooLarge { .. }), "{err}");
}

#[test]
fn dropping_the_ring_waits_for_uploads_of_held_batches() {
    use std::sync::Arc;
    let held = Arc::new(EngineBatch(batch(0)));
    {
        let mut ring = StagingRing::new(SimStreams::new(2, SLOT, 0, 0)).unwrap();
        ring.stage_external(held.clone()).unwrap();
        assert_eq!(
            Arc::strong_count(&held),
            3,
            "ring and queued upload hold it"
        );
    }
    assert_eq!(Arc::strong_count(&held), 1, "released after its upload ran");
}

#[test]
fn the_simulator_catches_a_batch_released_before_its_upload() {
    use std::sync::Arc;
    let mut sim = SimStreams::new(1, SLOT, 0, 0);
    let (reuse, copied) = (sim.new_event().unwrap(), sim.new_event().unwrap());
    let batch: birdtrain::cuda::staging::ExternalBatch = Arc::new(EngineBatch(batch(0)));
    sim.enqueue_upload_external(0, &batch, &reuse, &copied)
        .unwrap();
    drop(batch); // released while the upload is still queued
    sim.drain();
    assert_eq!(sim.violations().len(), 1, "{:?}", sim.violations());
}
