//! GPU tests of the dist layer (need a CUDA GPU; NCCL for the communicator tests).
//!
//! Run on a GPU machine with:
//! `cargo test --test gpu -- --ignored --test-threads=1 --nocapture dist_gpu::`

use std::sync::Arc;
use std::time::Duration;

use birdtrain::cuda::staging::device::CudaStaging;
use birdtrain::cuda::staging::StagingRing;
use birdtrain::cuda::GpuDevice;
use birdtrain::dist::buckets::GradientSync;
use birdtrain::dist::buckets::{BucketPlan, BucketSettings, ParamSpec};
use birdtrain::dist::checksum;
use birdtrain::dist::collective::Collective;
use birdtrain::dist::nccl::{
    ensure_available, new_unique_id, Communicator, DeviceGrads, NcclCollective, NcclError,
};
use cudarc::driver::{CudaContext, DevicePtr};

#[test]
fn nccl_availability_is_an_error_not_a_panic() {
    // Runs everywhere: on a machine without the driver or NCCL this must be a clean error.
    match ensure_available() {
        Ok(version) => assert!(version >= 20000, "NCCL version code {version}"),
        Err(e) => {
            assert!(
                matches!(
                    e,
                    NcclError::DriverMissing | NcclError::LibraryMissing { .. }
                ),
                "{e}"
            );
            assert!(e.to_string().contains("install") || e.to_string().contains("driver"));
        }
    }
}

fn plan(params: usize) -> BucketPlan {
    let specs: Vec<ParamSpec> = (0..params)
        .map(|i| ParamSpec {
            name: format!("p{i}"),
            bytes: 4 * (1000 + 37 * i),
        })
        .collect();
    BucketPlan::new(
        &specs,
        BucketSettings {
            target_bytes: 16 * 1024,
            element_bytes: 4,
            align_bytes: 256,
        },
    )
    .unwrap()
}

/// How many representable f32 values lie between `a` and `b` (both finite, same sign).
fn ulps_apart(a: f32, b: f32) -> u32 {
    a.to_bits().abs_diff(b.to_bits())
}

#[test]
fn ulps_apart_counts_representable_steps() {
    assert_eq!(ulps_apart(2.0, 2.0), 0);
    assert_eq!(ulps_apart(2.0, f32::from_bits(2.0f32.to_bits() + 1)), 1);
    assert_eq!(ulps_apart(f32::from_bits(2.0f32.to_bits() - 1), 2.0), 1);
    // ncclAvg of 1, 2, 3 as three ranks compute it, against the exact mean 2.
    let third = 1.0f32 / 3.0;
    let avg = 1.0 * third + 2.0 * third + 3.0 * third;
    assert!(ulps_apart(avg, 2.0) <= 1, "{avg}");
}

/// One rank per local GPU: rank r's gradients are all r+1; after the bucketed average every
/// rank holds the mean, bit-identical across ranks; the broadcast copies rank 0's weights.
fn run_ranks(world: usize) {
    let id = new_unique_id().expect("NCCL unique id");
    let plan = plan(40);
    let threads: Vec<_> = (0..world)
        .map(|rank| {
            let id = id.clone();
            let plan = plan.clone();
            std::thread::spawn(move || {
                let device = GpuDevice::open(rank).unwrap();
                let compute = device.stream().clone();
                let comm_stream = device.context().new_stream().unwrap();
                let comm =
                    Communicator::init(comm_stream, rank, world, &id, Duration::from_secs(60))
                        .unwrap();
                let mut coll = NcclCollective::new(comm, device.clone(), Duration::from_secs(60));
                let mut sync = GradientSync::new(plan.clone());

                let mut weights: Vec<f32> = (0..1000).map(|i| (i * (rank + 1)) as f32).collect();
                coll.broadcast(&mut weights, 0).unwrap();
                let expected: Vec<f32> = (0..1000).map(|i| i as f32).collect();
                assert_eq!(weights, expected, "rank {rank}: broadcast from rank 0");

                let n = plan.total_elements();
                let grads = compute.clone_htod(&vec![(rank + 1) as f32; n]).unwrap();
                let ptr = {
                    let (p, _record) = grads.device_ptr(&compute);
                    p
                };
                let mut buffer = DeviceGrads { ptr, len: n };
                sync.begin_step(1.0);
                let mut launched = Vec::new();
                // Backward order: last parameter first.
                for p in (0..plan.param_count()).rev() {
                    launched.extend(sync.grad_ready(&mut coll, &mut buffer, p).unwrap());
                }
                sync.finish_step(&mut coll, &mut buffer).unwrap();
                assert_eq!(launched, (0..plan.buckets().len()).collect::<Vec<_>>());
                let out = compute.clone_dtoh(&grads).unwrap();
                let mean = (1..=world).sum::<usize>() as f32 / world as f32;
                for p in 0..plan.param_count() {
                    for &v in &out[plan.param_elements(p)] {
                        // ncclAvg multiplies each rank's value by 1/n in f32 before summing,
                        // so the mean may be off by one unit in the last place (e.g. three
                        // ranks: 1/3 is not exact); every rank still holds the same bits.
                        assert!(
                            ulps_apart(v, mean) <= 1,
                            "rank {rank} parameter {p}: {v} is not the mean {mean}"
                        );
                    }
                }
                coll.check().unwrap();
                checksum(&out)
            })
        })
        .collect();
    let sums: Vec<u64> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert!(
        sums.windows(2).all(|w| w[0] == w[1]),
        "replicas differ: {sums:x?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn nccl_one_rank_full_path() {
    run_ranks(1);
}

#[test]
#[ignore = "needs at least two CUDA GPUs and NCCL"]
fn nccl_all_local_gpus_average_gradients() {
    let n = CudaContext::device_count().unwrap() as usize;
    if n < 2 {
        eprintln!("skipped: {n} GPU(s); NCCL refuses two ranks on one GPU");
        return;
    }
    run_ranks(n);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_staging_ring_delivers_batches_in_order() {
    let ctx = CudaContext::new(0).unwrap();
    let compute = ctx.new_stream().unwrap();
    let slot_bytes = 1 << 20;
    let staging = CudaStaging::new(&ctx, compute.clone(), 2, slot_bytes).unwrap();
    let mut ring = StagingRing::new(staging).unwrap();
    let n = 16u64;
    // "Compute" copies each staged batch into its own output buffer on the compute stream.
    let mut outputs: Vec<_> = (0..n)
        .map(|_| compute.alloc_zeros::<u8>(slot_bytes).unwrap())
        .collect();
    let mut next = 0;
    for k in 0..n {
        while next < n && ring.can_fill() {
            let (seq, buf) = ring.begin_fill().unwrap();
            buf.iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (seq as usize * 13 + i) as u8);
            ring.finish_fill(slot_bytes).unwrap();
            next += 1;
        }
        let staged = ring.begin_compute().unwrap();
        assert_eq!(staged.seq, k);
        let src = ring.streams().device_slot(staged.slot);
        compute.memcpy_dtod(src, &mut outputs[k as usize]).unwrap();
        ring.end_compute().unwrap();
    }
    compute.synchronize().unwrap();
    for (k, out) in outputs.iter().enumerate() {
        let host = compute.clone_dtoh(out).unwrap();
        assert!(
            host.iter()
                .enumerate()
                .all(|(i, &b)| b == (k * 13 + i) as u8),
            "batch {k} corrupted"
        );
    }
    eprintln!("staging stats: {:?}", ring.stats());
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn bad_unique_id_is_an_error() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let err = Communicator::init(Arc::clone(&stream), 0, 1, &[0u8; 5], Duration::from_secs(5))
        .unwrap_err();
    assert!(
        matches!(err, NcclError::BadUniqueId { got: 5, .. }),
        "{err}"
    );
    let err = Communicator::init(stream, 3, 2, &[0u8; 128], Duration::from_secs(5)).unwrap_err();
    assert!(matches!(err, NcclError::BadRank { .. }), "{err}");
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn run_local_ranks_gives_every_gpu_a_rank_and_identical_weights() {
    use birdtrain::dist::launch::{probe_gpus, resolve, GpuCount, LaunchFlags};
    use birdtrain::dist::ranks::run_local_ranks;
    use birdtrain::dist::rendezvous::{rendezvous, NodeInfo, StartPoint};

    let devices = probe_gpus();
    let flags = LaunchFlags {
        gpus: Some(GpuCount::All),
        ..LaunchFlags::default()
    };
    let plan = resolve(&flags, &|_| None, &devices).unwrap();
    let me = NodeInfo {
        nodes: 1,
        node_rank: 0,
        local_gpus: plan.devices.len(),
        fingerprint: 1,
        model: "resnet18".into(),
        start: StartPoint::Fresh,
    };
    let assignment = rendezvous(None, &me, Duration::from_secs(10), || {
        new_unique_id().map_err(|e| e.to_string())
    })
    .unwrap();
    let sums = run_local_ranks(&plan, &assignment, Duration::from_secs(60), move |rank| {
        let device = GpuDevice::open(rank.ordinal)?;
        let mut coll = NcclCollective::new(rank.comm, device, Duration::from_secs(60));
        let mut weights: Vec<f32> = (0..4096).map(|i| (i + rank.rank * 1000) as f32).collect();
        coll.broadcast(&mut weights, 0)?;
        Ok((rank.rank, checksum(&weights)))
    })
    .unwrap();
    assert_eq!(sums.len(), plan.devices.len());
    let expected = checksum(&(0..4096).map(|i| i as f32).collect::<Vec<_>>());
    for (rank, sum) in sums {
        assert_eq!(
            sum, expected,
            "rank {rank} did not receive rank 0's weights"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cuda_staging_uploads_engine_owned_pinned_batches() {
    use birdtrain::cuda::staging::device::PinnedBuffer;
    let ctx = CudaContext::new(0).unwrap();
    let compute = ctx.new_stream().unwrap();
    let bytes = 256 * 1024;
    let staging = CudaStaging::new(&ctx, compute.clone(), 2, bytes).unwrap();
    let mut ring = StagingRing::new(staging).unwrap();
    let n = 8usize;
    let mut outputs: Vec<_> = (0..n)
        .map(|_| compute.alloc_zeros::<u8>(bytes).unwrap())
        .collect();
    let mut next = 0;
    for (k, output) in outputs.iter_mut().enumerate() {
        while next < n && ring.can_fill() {
            let mut buf = PinnedBuffer::new(&ctx, bytes).unwrap();
            buf.as_mut_slice()
                .iter_mut()
                .enumerate()
                .for_each(|(i, b)| *b = (next * 7 + i) as u8);
            ring.stage_external(Arc::new(buf)).unwrap();
            next += 1;
        }
        let staged = ring.begin_compute().unwrap();
        assert_eq!(staged.seq, k as u64);
        compute
            .memcpy_dtod(ring.streams().device_slot(staged.slot), output)
            .unwrap();
        ring.end_compute().unwrap();
    }
    for (k, out) in outputs.iter().enumerate() {
        let host = compute.clone_dtoh(out).unwrap();
        assert!(
            host.iter()
                .enumerate()
                .all(|(i, &b)| b == (k * 7 + i) as u8),
            "batch {k}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_timeline_turns_stream_work_into_trace_spans() {
    use birdtrain::cuda::timeline::{rows, GpuTimeline};
    use birdtrain::trace::TraceRecorder;
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let trace = TraceRecorder::new();
    let mut timeline = GpuTimeline::new(trace.clone(), 0, &stream).unwrap();
    let host = vec![1u8; 64 << 20];
    let start = timeline.begin(&stream).unwrap();
    let dev = stream.clone_htod(&host).unwrap();
    timeline
        .end(start, &stream, "h2d 0", "copy", rows::COPY)
        .unwrap();
    timeline.flush().unwrap();
    drop(dev);
    let spans = trace.spans();
    assert_eq!(spans.len(), 1);
    assert_eq!((spans[0].pid, spans[0].tid), (0, rows::COPY));
    assert!(spans[0].duration > Duration::ZERO, "{:?}", spans[0]);
    let json = trace.to_json();
    assert_eq!(
        json["traceEvents"].as_array().unwrap().len(),
        6,
        "process name, 4 thread names, 1 span"
    );
}

#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn bench_scaling_measures_the_bucketed_allreduce_of_one_rank() {
    use birdtrain::cli::bench_scaling::measure_allreduce;
    let t = measure_allreduce(&plan(200), 1, 5).unwrap();
    assert!(t > Duration::ZERO);
    eprintln!("bucketed all-reduce, 1 rank, 200 params: {t:?}");
}

/// A rank that never joins: rank 0 of a two-rank communicator waits alone. NCCL would block
/// forever; `Communicator::init` gives up after its timeout with an error naming the rank.
/// (The helper thread stays blocked in NCCL afterwards: run this test on its own.)
#[test]
#[ignore = "needs a CUDA GPU and NCCL; run alone (leaves a thread blocked in NCCL)"]
fn a_rank_that_never_joins_times_out_instead_of_hanging() {
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();
    let id = new_unique_id().unwrap();
    let err = Communicator::init(stream, 0, 2, &id, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(
            err,
            NcclError::InitTimeout {
                rank: 0,
                world_size: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("never joined"), "{err}");
}

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out pointer; CLOCK_THREAD_CPUTIME_ID needs nothing else.
    let r = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(r, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Holds `stream` for about `HOLD_MS` milliseconds: a host function the stream runs in order.
unsafe extern "C" fn hold_the_stream(_: *mut std::ffi::c_void) {
    std::thread::sleep(Duration::from_millis(HOLD_MS));
}

const HOLD_MS: u64 = 800;

/// The CPU time a host wait on `event` (recorded after an 800 ms hold of `stream`) costs,
/// and the wall time it took.
fn cost_of_waiting(
    stream: &Arc<cudarc::driver::CudaStream>,
    event: &cudarc::driver::CudaEvent,
    wait: impl FnOnce(&cudarc::driver::CudaEvent),
) -> (Duration, Duration) {
    // SAFETY: the function takes no argument and only sleeps.
    unsafe {
        cudarc::driver::result::stream::launch_host_function(
            stream.cu_stream(),
            hold_the_stream,
            std::ptr::null_mut(),
        )
    }
    .unwrap();
    event.record(stream).unwrap();
    let (cpu, wall) = (thread_cpu_time(), std::time::Instant::now());
    wait(event);
    (thread_cpu_time() - cpu, wall.elapsed())
}

/// The events the host waits on (NCCL host exchanges and device sums, the staging ring's slot
/// reuse) are created with blocking sync: the waiting thread sleeps in the driver instead of
/// spinning a core per rank. Measured as the waiting thread's own CPU time over an 800 ms
/// wait; a default event is measured alongside for the record (the driver may spin or yield).
#[test]
#[ignore = "needs a CUDA GPU"]
fn host_waits_on_events_sleep_instead_of_spinning() {
    use birdtrain::cuda::staging::StagingStreams;
    use birdtrain::dist::nccl::host_wait_event;
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().unwrap();

    let default = ctx.new_event(None).unwrap();
    let (cpu, wall) = cost_of_waiting(&stream, &default, |e| e.synchronize().unwrap());
    eprintln!("default event: {cpu:?} of CPU over a {wall:?} wait");

    let blocking = host_wait_event(&stream).unwrap();
    let (cpu, wall) = cost_of_waiting(&stream, &blocking, |e| e.synchronize().unwrap());
    eprintln!("host_wait_event: {cpu:?} of CPU over a {wall:?} wait");
    assert!(wall >= Duration::from_millis(HOLD_MS / 2), "{wall:?}");
    assert!(
        cpu * 4 < wall,
        "NCCL's host wait spun: {cpu:?} of CPU in {wall:?}"
    );

    let mut staging = CudaStaging::new(&ctx, stream.clone(), 1, 1024).unwrap();
    let slot_event = staging.new_event().unwrap();
    let (cpu, wall) = cost_of_waiting(&stream, &slot_event, |e| {
        staging.host_wait(e).unwrap();
    });
    eprintln!("staging ring event: {cpu:?} of CPU over a {wall:?} wait");
    assert!(
        cpu * 4 < wall,
        "the staging ring's host wait spun: {cpu:?} of CPU in {wall:?}"
    );
}

/// The watchdog or the process's abort group aborts a communicator from another thread while
/// its rank keeps enqueuing collectives: every call either runs or is a clean
/// `UseAfterAbort`, never a call on a freed communicator (a crash).
#[test]
#[ignore = "needs a CUDA GPU and NCCL"]
fn an_abort_racing_collectives_on_a_real_communicator_is_an_error_not_a_crash() {
    let device = GpuDevice::open(0).unwrap();
    let comm_stream = device.context().new_stream().unwrap();
    let id = new_unique_id().unwrap();
    let comm = Communicator::init(comm_stream.clone(), 0, 1, &id, Duration::from_secs(60)).unwrap();
    let target = comm.abort_target();
    let mut buf = comm_stream.alloc_zeros::<f32>(1024).unwrap();
    let calls = std::sync::atomic::AtomicUsize::new(0);
    let outcomes: Vec<Result<(), String>> = std::thread::scope(|s| {
        let aborter = s.spawn(|| {
            while calls.load(std::sync::atomic::Ordering::SeqCst) < 200 {
                std::thread::yield_now();
            }
            target.abort().unwrap();
        });
        let outcomes = (0..2000)
            .map(|_| {
                calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                comm.all_reduce_sum_in_place(&mut buf)
                    .map_err(|e| e.to_string())
            })
            .collect();
        aborter.join().unwrap();
        outcomes
    });
    let first_err = outcomes
        .iter()
        .position(Result::is_err)
        .expect("the abort came after every call");
    assert!(first_err >= 200, "{first_err}");
    for o in &outcomes[first_err..] {
        let e = o.as_ref().unwrap_err();
        assert!(e.contains("was aborted"), "{e}");
    }
    drop(comm);
}

/// One failing GPU of several: every other rank's pending collective ends within seconds (its
/// communicator aborted by the process's abort group, not by its own watchdog 600 s later),
/// and the error is the failing rank's.
#[test]
#[ignore = "needs at least two CUDA GPUs and NCCL"]
fn one_failing_gpu_rank_ends_every_rank_naming_it() {
    use birdtrain::dist::launch::{probe_gpus, resolve, GpuCount, LaunchFlags};
    use birdtrain::dist::ranks::{run_local_ranks, RanksError};
    use birdtrain::dist::rendezvous::{rendezvous, NodeInfo, StartPoint};
    let n = CudaContext::device_count().unwrap() as usize;
    if n < 2 {
        eprintln!("skipped: {n} GPU(s); NCCL refuses two ranks on one GPU");
        return;
    }
    let flags = LaunchFlags {
        gpus: Some(GpuCount::All),
        ..LaunchFlags::default()
    };
    let plan = resolve(&flags, &|_| None, &probe_gpus()).unwrap();
    let me = NodeInfo {
        nodes: 1,
        node_rank: 0,
        local_gpus: plan.devices.len(),
        fingerprint: 1,
        model: "resnet18".into(),
        start: StartPoint::Fresh,
    };
    let assignment = rendezvous(None, &me, Duration::from_secs(10), || {
        new_unique_id().map_err(|e| e.to_string())
    })
    .unwrap();
    let start = std::time::Instant::now();
    let err = run_local_ranks(&plan, &assignment, Duration::from_secs(60), move |rank| {
        let device = GpuDevice::open(rank.ordinal)?;
        let mut coll = NcclCollective::new(rank.comm, device, Duration::from_secs(600));
        if rank.rank == 1 {
            std::thread::sleep(Duration::from_millis(500));
            return Err("injected failure of rank 1".into());
        }
        // Rank 1 never joins this sum.
        let mut v = [1.0f64];
        coll.sum(&mut v)?;
        Ok(())
    })
    .unwrap_err();
    let elapsed = start.elapsed();
    eprintln!("ended after {elapsed:?}: {err}");
    assert!(matches!(err, RanksError::Body { rank: 1, .. }), "{err}");
    assert!(
        err.to_string().contains("injected failure of rank 1"),
        "{err}"
    );
    assert!(elapsed < Duration::from_secs(60), "waited {elapsed:?}");
}
