//! The async stream yields exactly what the blocking iterator yields; replicas iterate
//! concurrently from several threads; dropping an iterator early does not hang.

use crate::common;

use std::future::poll_fn;
use std::pin::Pin;

use common::{collect, seen, synth};
use futures_core::Stream;

#[test]
fn the_async_stream_equals_the_iterator() {
    let fx = synth(3, 5, 0);
    let p = fx.builder().batch_size(4).replicas(2).build().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    for replica in 0..2 {
        let blocking = collect(&p, 1, replica, 1);
        let streamed = rt.block_on(async {
            let mut stream = p.epoch_stream(1, replica, 1).unwrap();
            let mut out = Vec::new();
            while let Some(item) = poll_fn(|cx| Pin::new(&mut stream).poll_next(cx)).await {
                out.push(seen(&item.unwrap()));
            }
            out
        });
        assert_eq!(streamed, blocking);
        assert!(!streamed.is_empty());
    }
}

#[test]
fn replicas_run_concurrently_on_their_own_threads() {
    let fx = synth(4, 6, 0);
    let p = fx.builder().batch_size(2).replicas(4).build().unwrap();
    let sequential: Vec<_> = (0..4).map(|r| collect(&p, 3, r, 0)).collect();
    let other_cache = tempfile::tempdir().unwrap();
    let q = fx
        .builder()
        .cache_dir(other_cache.path())
        .batch_size(2)
        .replicas(4)
        .build()
        .unwrap();
    let concurrent: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4)
            .map(|r| {
                let q = q.clone();
                s.spawn(move || collect(&q, 3, r, 0))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(concurrent, sequential);
}

#[test]
fn dropping_iterators_and_the_pipeline_mid_epoch_does_not_hang() {
    let fx = synth(3, 10, 0);
    let p = fx
        .builder()
        .batch_size(2)
        .prefetch(1)
        .workers(1)
        .build()
        .unwrap();
    for _ in 0..3 {
        let mut it = p.epoch(0, 0, 0).unwrap();
        it.next().unwrap().unwrap();
    }
    let mut it = p.epoch(1, 0, 0).unwrap();
    let kept = it.next().unwrap().unwrap();
    drop(p);
    // The iterator keeps the engine alive: it still finishes its epoch.
    let rest = it.map(|b| b.unwrap().len).sum::<usize>();
    assert_eq!(kept.len + rest, 30);
    // Dropping the iterator and then the pipeline mid-epoch, with jobs queued, returns.
    let q = fx
        .builder()
        .batch_size(2)
        .prefetch(1)
        .workers(1)
        .build()
        .unwrap();
    let mut it = q.epoch(0, 0, 0).unwrap();
    let batch = it.next().unwrap().unwrap();
    drop(it);
    drop(q);
    assert_eq!(batch.len, 2, "a batch outlives its pipeline");
}

#[test]
fn batches_expose_the_caller_allocated_buffer() {
    #[derive(Debug)]
    struct Tagged(Vec<u8>);
    impl pipeline::HostBuffer for Tagged {
        fn as_slice(&self) -> &[u8] {
            &self.0
        }
        fn as_mut_slice(&mut self) -> &mut [u8] {
            &mut self.0
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    struct TaggedAlloc;
    impl pipeline::BatchAllocator for TaggedAlloc {
        fn allocate(
            &self,
            n: usize,
        ) -> Result<Box<dyn pipeline::HostBuffer>, pipeline::PipelineError> {
            Ok(Box::new(Tagged(vec![0; n])))
        }
    }
    let fx = synth(2, 3, 0);
    let p = fx
        .builder()
        .batch_size(4)
        .allocator(std::sync::Arc::new(TaggedAlloc))
        .build()
        .unwrap();
    for b in p.epoch(0, 0, 0).unwrap() {
        let b = b.unwrap();
        let tagged = b
            .buffer()
            .as_any()
            .downcast_ref::<Tagged>()
            .expect("the allocator's own type");
        assert_eq!(tagged.0.len(), 4 * 16 * 16 * 3);
        assert_eq!(&tagged.0[..b.pixels().len()], b.pixels());
    }
    let s = p.stats();
    assert_eq!(s.batches, 2);
    assert!(s.decode_seconds > 0.0 && s.decode_images_per_sec > 0.0);
    assert!(
        (0.0..=1.0).contains(&s.decode_queue_fill) && (0.0..=1.0).contains(&s.ready_queue_fill)
    );
}

#[test]
fn a_panicking_stage_reaches_the_consumer_as_an_error_with_its_message() {
    struct Lost;
    impl pipeline::HostBuffer for Lost {
        fn as_slice(&self) -> &[u8] {
            &[0; 4096]
        }
        fn as_mut_slice(&mut self) -> &mut [u8] {
            panic!("pinned buffer lost")
        }
        fn as_any(&self) -> &dyn std::any::Any {
            self
        }
    }
    struct LostAlloc;
    impl pipeline::BatchAllocator for LostAlloc {
        fn allocate(
            &self,
            _: usize,
        ) -> Result<Box<dyn pipeline::HostBuffer>, pipeline::PipelineError> {
            Ok(Box::new(Lost))
        }
    }
    let fx = synth(2, 2, 0);
    let p = fx
        .builder()
        .image_size(8)
        .batch_size(2)
        .allocator(std::sync::Arc::new(LostAlloc))
        .build()
        .unwrap();
    let items: Vec<_> = p.epoch(0, 0, 0).unwrap().collect();
    assert_eq!(items.len(), 1, "one error, then the epoch ends");
    match &items[0] {
        Err(pipeline::PipelineError::StagePanicked { stage, message }) => {
            assert_eq!(*stage, "planner");
            assert!(message.contains("pinned buffer lost"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn handles_cross_threads() {
    fn send_sync<T: Send + Sync>() {}
    fn send<T: Send>() {}
    send_sync::<pipeline::Pipeline>();
    send_sync::<pipeline::PipelineError>();
    send::<pipeline::EpochIter>();
    send::<pipeline::EpochStream>();
    send::<pipeline::Batch>();
}
