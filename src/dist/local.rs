//! The in-process [`Collective`]: R ranks on threads of one process (CPU data parallelism).
//!
//! Every rank numbers its collective calls in program order; calls with the same number form
//! a *round* in the shared [`LocalGroup`]. A round completes when every rank has joined it:
//! the last rank to arrive reduces (in rank order, so every rank gets the same bits) and wakes
//! the others. Gradient buckets are averaged in place, in each rank's own buffer (no copies):
//! [`LocalCollective::start_average`] lends the bucket's range to the rank's communication
//! thread, which scales it, joins the round and, once it is reduced, reports it done; backward
//! meanwhile writes the other buckets. [`LocalCollective::finish_averages`] waits for the
//! step's buckets and gives the ranges back.
//!
//! Waiting is on the round itself (a condition variable), never on a polling tick. A
//! [`Watchdog`] per rank watches every call; when one outlives the timeout it aborts the group
//! (naming the rank that timed out and the ranks that never joined), and every rank's waiting
//! call returns that error. A rank that fails aborts the group with its error, so nobody waits
//! for it. A round whose reduction has started always completes (the reduction writes into
//! every rank's buffer, which must stay untouched until then).

use std::collections::HashMap;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Duration;

use super::collective::{Collective, CollectiveError};
use super::watchdog::{Abortable, Watchdog, WatchdogError};

/// How often the watchdogs look at pending calls (only timeouts depend on it).
const WATCHDOG_POLL: Duration = Duration::from_millis(20);

/// A rank's flat gradient buffer in host memory (laid out by a bucket plan).
///
/// Ranges lent to the communication thread ([`LocalCollective::start_average`]) are written
/// by the reduction until [`LocalCollective::finish_averages`]; the buffer refuses to hand out
/// overlapping slices meanwhile, so the rank and the reduction never touch the same values.
pub struct HostGrads {
    ptr: NonNull<f32>,
    len: usize,
    lent: Vec<Range<usize>>,
}

// SAFETY: the buffer owns its allocation; slices are handed out only for ranges not lent
// (checked), and lent ranges are accessed by one reducer at a time through `SharedRange`.
unsafe impl Send for HostGrads {}

impl std::fmt::Debug for HostGrads {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostGrads")
            .field("len", &self.len)
            .field("lent", &self.lent)
            .finish()
    }
}

impl HostGrads {
    /// `len` zeros.
    pub fn zeros(len: usize) -> HostGrads {
        let boxed: Box<[f32]> = vec![0.0; len].into_boxed_slice();
        let raw = Box::into_raw(boxed) as *mut f32;
        HostGrads {
            // SAFETY: Box::into_raw never returns null.
            ptr: unsafe { NonNull::new_unchecked(raw) },
            len,
            lent: Vec::new(),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for an empty buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    fn check_free(&self, range: &Range<usize>) -> Result<(), String> {
        if range.start > range.end || range.end > self.len {
            return Err(format!(
                "range {range:?} is outside the gradient buffer of {} values",
                self.len
            ));
        }
        if let Some(busy) = self
            .lent
            .iter()
            .find(|r| r.start < range.end && range.start < r.end)
        {
            return Err(format!(
                "range {range:?} overlaps {busy:?}, which is being averaged (finish the step's averages first)"
            ));
        }
        Ok(())
    }

    /// The values of `range`, writable (`Err` when it is being averaged or out of bounds).
    pub fn range_mut(&mut self, range: Range<usize>) -> Result<&mut [f32], String> {
        self.check_free(&range)?;
        // SAFETY: in bounds and disjoint from every lent range (checked); `&mut self` makes
        // the slice the only one handed out.
        Ok(unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().add(range.start), range.len())
        })
    }

    /// All values (`Err` while any range is being averaged).
    pub fn as_slice(&self) -> Result<&[f32], String> {
        if let Some(busy) = self.lent.first() {
            return Err(format!(
                "range {busy:?} of the gradient buffer is being averaged"
            ));
        }
        // SAFETY: nothing is lent, so no other thread accesses the buffer.
        Ok(unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) })
    }

    /// Every value set to zero (`Err` while any range is being averaged).
    pub fn fill_zero(&mut self) -> Result<(), String> {
        let all = 0..self.len;
        self.check_free(&all)?;
        self.range_mut(all)?.fill(0.0);
        Ok(())
    }

    fn lend(&mut self, range: Range<usize>) -> Result<SharedRange, String> {
        self.check_free(&range)?;
        self.lent.push(range.clone());
        Ok(SharedRange {
            // SAFETY: in bounds (checked).
            ptr: unsafe { self.ptr.as_ptr().add(range.start) },
            len: range.len(),
        })
    }

    fn settle(&mut self) {
        self.lent.clear();
    }
}

impl Drop for HostGrads {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` came from Box::into_raw of a boxed slice of `len` values.
        drop(unsafe {
            Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                self.ptr.as_ptr(),
                self.len,
            ))
        });
    }
}

/// A range lent to the reduction: valid and untouched by its owner until the round is done.
#[derive(Debug, Clone, Copy)]
struct SharedRange {
    ptr: *mut f32,
    len: usize,
}

// SAFETY: see `HostGrads`: the owner does not touch a lent range until the round completes,
// and within a round exactly one thread (the reducer) accesses it.
unsafe impl Send for SharedRange {}

impl SharedRange {
    /// # Safety
    /// The caller must be the only thread accessing the range (see `HostGrads::lend`).
    unsafe fn slice<'a>(self) -> &'a mut [f32] {
        std::slice::from_raw_parts_mut(self.ptr, self.len)
    }
}

/// One rank's part of a round.
#[derive(Debug)]
enum Part {
    Average(SharedRange),
    Sum(Vec<f64>),
    /// The root's values; other ranks send `None`.
    Broadcast(Option<Vec<f32>>),
}

impl Part {
    fn describe(&self) -> String {
        match self {
            Part::Average(r) => format!("an average of {} values", r.len),
            Part::Sum(v) => format!("a sum of {} values", v.len()),
            Part::Broadcast(Some(v)) => format!("a broadcast of {} values", v.len()),
            Part::Broadcast(None) => "a broadcast".into(),
        }
    }

    fn same_kind(&self, other: &Part) -> bool {
        match (self, other) {
            (Part::Average(a), Part::Average(b)) => a.len == b.len,
            (Part::Sum(a), Part::Sum(b)) => a.len() == b.len(),
            (Part::Broadcast(_), Part::Broadcast(_)) => true,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Phase {
    Gathering,
    Reducing,
    Done,
}

#[derive(Debug)]
enum Outcome {
    None,
    Sum(Arc<Vec<f64>>),
    Broadcast(Arc<Vec<f32>>),
}

#[derive(Debug)]
struct Round {
    label: String,
    /// How long its ranks wait for each other (the same on every rank).
    timeout: Duration,
    parts: Vec<Option<Part>>,
    arrived: usize,
    phase: Phase,
    outcome: Outcome,
    picked_up: usize,
}

#[derive(Debug, Default)]
struct GroupState {
    rounds: HashMap<u64, Round>,
    aborted: Option<String>,
}

/// The state the ranks of one process share.
#[derive(Debug)]
struct Group {
    world: usize,
    state: Mutex<GroupState>,
    changed: Condvar,
}

impl Group {
    fn lock(&self) -> MutexGuard<'_, GroupState> {
        // Rounds are updated whole under the lock; a panicking rank leaves them consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn abort(&self, reason: String) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(reason);
        }
        drop(state);
        self.changed.notify_all();
    }

    /// The oldest round still gathering, the ranks it waits for and its timeout.
    fn stuck(&self) -> Option<(String, Vec<usize>, Duration)> {
        let state = self.lock();
        let (_, round) = state
            .rounds
            .iter()
            .filter(|(_, r)| r.phase == Phase::Gathering)
            .min_by_key(|(seq, _)| **seq)?;
        let missing = (0..self.world)
            .filter(|&r| round.parts[r].is_none())
            .collect();
        Some((round.label.clone(), missing, round.timeout))
    }

    /// Joins round `seq` (which waits `timeout` for its ranks) with `part` and returns once
    /// it is done (or aborted while still gathering).
    fn join(
        &self,
        rank: usize,
        seq: u64,
        label: &str,
        timeout: Duration,
        part: Part,
    ) -> Result<Outcome, CollectiveError> {
        let mut state = self.lock();
        if let Some(reason) = &state.aborted {
            return Err(CollectiveError::Aborted {
                rank,
                reason: reason.clone(),
            });
        }
        let world = self.world;
        let round = state.rounds.entry(seq).or_insert_with(|| Round {
            label: label.to_string(),
            timeout,
            parts: (0..world).map(|_| None).collect(),
            arrived: 0,
            phase: Phase::Gathering,
            outcome: Outcome::None,
            picked_up: 0,
        });
        if let Some(other) = round.parts.iter().flatten().next() {
            if !other.same_kind(&part) {
                let detail = format!(
                    "call {seq} is {} here ({label}) but {} on another rank ({})",
                    part.describe(),
                    other.describe(),
                    round.label
                );
                drop(state);
                self.abort(format!("rank {rank}: collectives out of step: {detail}"));
                return Err(CollectiveError::Mismatch {
                    rank,
                    what: label.to_string(),
                    detail,
                });
            }
        }
        round.parts[rank] = Some(part);
        round.arrived += 1;
        if round.arrived == world {
            round.phase = Phase::Reducing;
            let parts: Vec<Part> = round.parts.iter_mut().filter_map(Option::take).collect();
            drop(state);
            // Outside the lock: other rounds go on meanwhile. Nobody else touches these
            // ranges: their owners wait for this round's `Done`.
            let outcome = reduce(parts, world);
            state = self.lock();
            let round = state.rounds.get_mut(&seq).expect("a reducing round stays");
            round.outcome = outcome;
            round.phase = Phase::Done;
            self.changed.notify_all();
        } else {
            loop {
                let round = state.rounds.get(&seq).expect("a joined round stays");
                if round.phase == Phase::Done {
                    break;
                }
                if round.phase == Phase::Gathering {
                    if let Some(reason) = &state.aborted {
                        return Err(CollectiveError::Aborted {
                            rank,
                            reason: reason.clone(),
                        });
                    }
                }
                state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
            }
        }
        let round = state.rounds.get_mut(&seq).expect("a done round stays");
        round.picked_up += 1;
        let outcome = match &round.outcome {
            Outcome::None => Outcome::None,
            Outcome::Sum(v) => Outcome::Sum(v.clone()),
            Outcome::Broadcast(v) => Outcome::Broadcast(v.clone()),
        };
        if round.picked_up == world {
            state.rounds.remove(&seq);
        }
        Ok(outcome)
    }
}

/// The reduction of one full round, in rank order.
fn reduce(parts: Vec<Part>, world: usize) -> Outcome {
    let mut averages = Vec::new();
    let mut sums: Vec<Vec<f64>> = Vec::new();
    let mut root = None;
    for part in parts {
        match part {
            Part::Average(r) => averages.push(r),
            Part::Sum(v) => sums.push(v),
            Part::Broadcast(v) => root = root.or(v),
        }
    }
    if let Some((first, rest)) = averages.split_first() {
        // SAFETY: every range's owner waits for this round to be done (see `Group::join`).
        let acc = unsafe { first.slice() };
        for r in rest {
            for (a, v) in acc.iter_mut().zip(unsafe { r.slice() }.iter()) {
                *a += v;
            }
        }
        let n = world as f32;
        acc.iter_mut().for_each(|a| *a /= n);
        for r in rest {
            unsafe { r.slice() }.copy_from_slice(acc);
        }
        return Outcome::None;
    }
    if let Some((first, rest)) = sums.split_first_mut() {
        for v in rest.iter() {
            first.iter_mut().zip(v).for_each(|(a, b)| *a += b);
        }
        return Outcome::Sum(Arc::new(std::mem::take(first)));
    }
    Outcome::Broadcast(Arc::new(root.unwrap_or_default()))
}

/// What the watchdog aborts: the group, on behalf of one rank.
struct GroupAbort {
    group: Arc<Group>,
    rank: usize,
    timeout: Duration,
}

impl Abortable for GroupAbort {
    fn abort(&self) -> Result<(), String> {
        let reason = match self.group.stuck() {
            Some((label, missing, timeout)) if !missing.is_empty() => format!(
                "rank {}'s watchdog: {label} did not complete within {timeout:?}; {} never joined it",
                self.rank,
                ranks_text(&missing)
            ),
            _ => format!(
                "rank {}'s watchdog: a collective did not complete within {:?}",
                self.rank, self.timeout
            ),
        };
        self.group.abort(reason);
        Ok(())
    }

    fn async_error(&self) -> Option<String> {
        None
    }
}

fn ranks_text(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(usize::to_string).collect();
    if ranks.len() == 1 {
        format!("rank {}", list[0])
    } else {
        format!("ranks {}", list.join(", "))
    }
}

/// Creates the groups of in-process ranks.
#[derive(Debug, Clone, Copy)]
pub struct LocalGroup;

impl LocalGroup {
    /// One [`LocalCollective`] per rank of a group of `world` ranks (hand one to each rank's
    /// thread); a call that waits longer than `timeout` for the other ranks aborts the group.
    pub fn ranks(world: usize, timeout: Duration) -> Vec<LocalCollective> {
        let group = Arc::new(Group {
            world: world.max(1),
            state: Mutex::new(GroupState::default()),
            changed: Condvar::new(),
        });
        (0..world.max(1))
            .map(|rank| LocalCollective::new(group.clone(), rank, timeout))
            .collect()
    }
}

/// A bucket average handed to the communication thread.
struct Job {
    seq: u64,
    bucket: usize,
    label: String,
    range: SharedRange,
    scale: f32,
    done: Arc<std::sync::atomic::AtomicBool>,
}

/// One rank of an in-process group.
pub struct LocalCollective {
    rank: usize,
    world: usize,
    /// The collective timeout.
    timeout: Duration,
    group: Arc<Group>,
    // Before the thread handle: dropped (stopping its thread) after the thread is joined.
    watchdog: Arc<Watchdog>,
    jobs: Option<mpsc::Sender<Job>>,
    results: Option<mpsc::Receiver<Result<usize, CollectiveError>>>,
    thread: Option<JoinHandle<()>>,
    next_seq: u64,
    /// Buckets started this step and not yet finished.
    started: usize,
    step: u64,
    averaged: Arc<AtomicUsize>,
}

impl std::fmt::Debug for LocalCollective {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("step", &self.step)
            .finish()
    }
}

impl LocalCollective {
    fn new(group: Arc<Group>, rank: usize, timeout: Duration) -> Self {
        let target = Arc::new(GroupAbort {
            group: group.clone(),
            rank,
            timeout,
        });
        LocalCollective {
            rank,
            world: group.world,
            timeout,
            watchdog: Arc::new(Watchdog::start(rank, timeout, WATCHDOG_POLL, target)),
            group,
            jobs: None,
            results: None,
            thread: None,
            next_seq: 0,
            started: 0,
            step: 0,
            averaged: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Bucket averages this rank has seen completed so far (all steps): lets a caller watch
    /// the communication thread's progress while backward runs.
    pub fn averages_done(&self) -> Arc<AtomicUsize> {
        self.averaged.clone()
    }

    fn seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    /// The error a failed call reports: this rank's watchdog fault (with what the group
    /// knows) when it fired, else the group's reason.
    fn explain(&self, e: CollectiveError) -> CollectiveError {
        match (self.watchdog.fault(), e) {
            (Some(fault), CollectiveError::Aborted { reason, .. }) => {
                let detail = match reason.split_once("; ") {
                    Some((_, missing)) => format!("; {missing}"),
                    None => String::new(),
                };
                CollectiveError::Watchdog {
                    source: WatchdogError::Aborted(fault),
                    detail,
                }
            }
            (_, e) => e,
        }
    }

    /// Runs a blocking round on the calling thread, watched by the watchdog for `timeout`.
    fn blocking(
        &mut self,
        label: String,
        part: Part,
        timeout: Duration,
    ) -> Result<Outcome, CollectiveError> {
        let seq = self.seq();
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = done.clone();
        self.watchdog
            .watch_within(label.clone(), timeout, move || {
                Ok(probe.load(Ordering::Acquire))
            })
            .map_err(|source| CollectiveError::Watchdog {
                source,
                detail: String::new(),
            })?;
        let out = self.group.join(self.rank, seq, &label, timeout, part);
        done.store(true, Ordering::Release);
        out.map_err(|e| self.explain(e))
    }

    fn spawn_thread(&mut self) -> Result<(), CollectiveError> {
        if self.jobs.is_some() {
            return Ok(());
        }
        let (jobs, rx) = mpsc::channel::<Job>();
        let (tx, results) = mpsc::channel();
        let group = self.group.clone();
        let rank = self.rank;
        let timeout = self.timeout;
        let averaged = self.averaged.clone();
        let thread = pipeline::threads::spawn(format!("comm-{rank}"), move || {
            for job in rx {
                if job.scale != 1.0 {
                    // SAFETY: the range is lent to this thread until its round is done.
                    unsafe { job.range.slice() }
                        .iter_mut()
                        .for_each(|v| *v *= job.scale);
                }
                let out = group
                    .join(rank, job.seq, &job.label, timeout, Part::Average(job.range))
                    .map(|_| job.bucket);
                job.done.store(true, Ordering::Release);
                if out.is_ok() {
                    averaged.fetch_add(1, Ordering::Release);
                }
                if tx.send(out).is_err() {
                    return;
                }
            }
        })?;
        self.jobs = Some(jobs);
        self.results = Some(results);
        self.thread = Some(thread);
        Ok(())
    }
}

impl Collective for LocalCollective {
    type Buffer = HostGrads;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn start_average(
        &mut self,
        buffer: &mut HostGrads,
        bucket: usize,
        range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        self.check()?;
        let rank = self.rank;
        if self.world == 1 {
            // One rank: the average is the values themselves.
            if scale != 1.0 {
                let v = buffer
                    .range_mut(range)
                    .map_err(|detail| CollectiveError::Buffer { rank, detail })?;
                v.iter_mut().for_each(|x| *x *= scale);
            }
            self.averaged.fetch_add(1, Ordering::Release);
            return Ok(());
        }
        self.spawn_thread()?;
        let shared = buffer
            .lend(range)
            .map_err(|detail| CollectiveError::Buffer { rank, detail })?;
        let seq = self.seq();
        let label = format!("all-reduce of bucket {bucket} in step {}", self.step + 1);
        let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let probe = done.clone();
        self.watchdog
            .watch(label.clone(), move || Ok(probe.load(Ordering::Acquire)))
            .map_err(|source| CollectiveError::Watchdog {
                source,
                detail: String::new(),
            })?;
        let job = Job {
            seq,
            bucket,
            label,
            range: shared,
            scale,
            done,
        };
        self.jobs
            .as_ref()
            .expect("spawned above")
            .send(job)
            .map_err(|_| CollectiveError::Buffer {
                rank,
                detail: "the communication thread stopped".into(),
            })?;
        self.started += 1;
        Ok(())
    }

    fn finish_averages(&mut self, buffer: &mut HostGrads) -> Result<(), CollectiveError> {
        self.step += 1;
        let mut first_error = None;
        while self.started > 0 {
            let got = match &self.results {
                Some(rx) => rx.recv().unwrap_or_else(|_| {
                    Err(CollectiveError::Buffer {
                        rank: self.rank,
                        detail: "the communication thread stopped".into(),
                    })
                }),
                None => break,
            };
            self.started -= 1;
            if let Err(e) = got {
                first_error.get_or_insert(e);
            }
        }
        // Every lent range's round is over (done or never joined by the reducer).
        buffer.settle();
        match first_error {
            Some(e) => Err(self.explain(e)),
            None => Ok(()),
        }
    }

    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let part = Part::Broadcast((self.rank == root).then(|| values.to_vec()));
        let label = format!("broadcast of {} values from rank {root}", values.len());
        match self.blocking(label, part, self.timeout)? {
            Outcome::Broadcast(v) if v.len() == values.len() => {
                values.copy_from_slice(&v);
                Ok(())
            }
            Outcome::Broadcast(v) => Err(CollectiveError::Mismatch {
                rank: self.rank,
                what: "broadcast".into(),
                detail: format!("{} values here, {} from rank {root}", values.len(), v.len()),
            }),
            _ => unreachable!("a broadcast round ends in a broadcast outcome"),
        }
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum_within(values, self.timeout)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let label = format!("sum of {} values", values.len());
        match self.blocking(label, Part::Sum(values.to_vec()), timeout)? {
            Outcome::Sum(v) => {
                values.copy_from_slice(&v);
                Ok(())
            }
            _ => unreachable!("a sum round ends in a sum outcome"),
        }
    }

    fn check(&self) -> Result<(), CollectiveError> {
        if let Some(fault) = self.watchdog.fault() {
            return Err(CollectiveError::Watchdog {
                source: WatchdogError::Aborted(fault),
                detail: String::new(),
            });
        }
        match &self.group.lock().aborted {
            Some(reason) => Err(CollectiveError::Aborted {
                rank: self.rank,
                reason: reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn abort(&self, reason: &str) {
        self.group.abort(reason.to_string());
    }
}

impl Drop for LocalCollective {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.group
                .abort(format!("rank {} stopped: its thread panicked", self.rank));
        } else if self.started > 0 {
            // Averages still in flight: the others must not wait for this rank any more.
            self.group.abort(format!(
                "rank {} stopped with {} bucket average(s) in flight",
                self.rank, self.started
            ));
        }
        self.jobs = None;
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(world: usize) -> Vec<LocalCollective> {
        LocalGroup::ranks(world, Duration::from_secs(30))
    }

    #[test]
    fn buckets_are_averaged_in_place_with_each_ranks_scale() {
        let results: Vec<Vec<f32>> = std::thread::scope(|s| {
            let handles: Vec<_> = group(3)
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let r = c.rank() as f32;
                        let mut buf = HostGrads::zeros(10);
                        for step in 0..20 {
                            buf.range_mut(0..10)
                                .unwrap()
                                .iter_mut()
                                .enumerate()
                                .for_each(|(i, v)| *v = r + i as f32 + step as f32);
                            // Two buckets: [0, 4) scaled by the rank's share, [4, 10) as is.
                            c.start_average(&mut buf, 0, 0..4, r + 1.0).unwrap();
                            assert!(buf.range_mut(2..5).is_err(), "a lent range is refused");
                            c.start_average(&mut buf, 1, 4..10, 1.0).unwrap();
                            c.finish_averages(&mut buf).unwrap();
                        }
                        buf.as_slice().unwrap().to_vec()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let step = 19.0f32;
        for got in &results {
            for (i, &value) in got.iter().enumerate().take(10) {
                let want = if i < 4 {
                    (0..3)
                        .map(|r| (r as f32 + i as f32 + step) * (r as f32 + 1.0))
                        .sum::<f32>()
                        / 3.0
                } else {
                    (0..3).map(|r| r as f32 + i as f32 + step).sum::<f32>() / 3.0
                };
                assert_eq!(value, want, "element {i}");
            }
            assert_eq!(got, &results[0], "every rank has the same bits");
        }
    }

    #[test]
    fn sums_and_broadcasts_reach_every_rank() {
        std::thread::scope(|s| {
            for mut c in group(4) {
                s.spawn(move || {
                    let r = c.rank();
                    for round in 0..30 {
                        let mut v = vec![r as f64, round as f64, 1.0];
                        c.sum(&mut v).unwrap();
                        assert_eq!(v, vec![6.0, 4.0 * round as f64, 4.0]);
                        let mut w = vec![r as f32; 5];
                        c.broadcast(&mut w, 2).unwrap();
                        assert_eq!(w, vec![2.0; 5]);
                    }
                });
            }
        });
    }

    #[test]
    fn a_rank_that_never_joins_is_named_when_the_watchdog_aborts() {
        let mut ranks = LocalGroup::ranks(3, Duration::from_millis(200));
        let _absent = ranks.pop().unwrap(); // rank 2 never calls
        let start = std::time::Instant::now();
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut c| s.spawn(move || c.sum(&mut [1.0]).unwrap_err().to_string()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(20));
        for e in &errors {
            assert!(e.contains("rank 2 never joined"), "{e}");
        }
        assert!(
            errors
                .iter()
                .all(|e| e.contains("did not complete within 200ms")),
            "{errors:?}"
        );
    }

    #[test]
    fn a_sum_with_its_own_timeout_waits_for_a_late_rank_past_the_collective_timeout() {
        let ranks = LocalGroup::ranks(2, Duration::from_millis(100));
        let results: Vec<Result<Vec<f64>, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        if c.rank() == 0 {
                            // Rank 0 writes the run folder for far longer than 100 ms.
                            std::thread::sleep(Duration::from_millis(600));
                        }
                        let mut v = vec![c.rank() as f64 + 1.0];
                        c.sum_within(&mut v, Duration::from_secs(60))
                            .map(|()| v)
                            .map_err(|e| e.to_string())
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for r in results {
            assert_eq!(r.unwrap(), vec![3.0]);
        }
    }

    #[test]
    fn a_sum_with_its_own_timeout_names_that_timeout_when_it_fires() {
        let mut ranks = LocalGroup::ranks(2, Duration::from_secs(60));
        let _absent = ranks.pop().unwrap();
        let mut waiter = ranks.pop().unwrap();
        let e = waiter
            .sum_within(&mut [1.0], Duration::from_millis(150))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("within 150ms") && e.contains("rank 1 never joined"),
            "{e}"
        );
    }

    #[test]
    fn mismatched_calls_are_an_error_not_garbage() {
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = group(2)
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let n = 3 + c.rank();
                        c.sum(&mut vec![0.0; n]).unwrap_err().to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(
            errors.iter().any(|e| e.contains("does not match")),
            "{errors:?}"
        );
    }

    #[test]
    fn an_aborting_rank_releases_the_others_with_its_reason() {
        let mut ranks = group(2);
        let quitter = ranks.pop().unwrap();
        let mut waiter = ranks.pop().unwrap();
        std::thread::scope(|s| {
            let w = s.spawn(move || waiter.sum(&mut [1.0]).unwrap_err().to_string());
            std::thread::sleep(Duration::from_millis(50));
            quitter.abort("rank 1 failed: bad batch");
            let e = w.join().unwrap();
            assert!(e.contains("rank 1 failed: bad batch"), "{e}");
        });
    }

    #[test]
    fn one_rank_needs_no_thread_and_keeps_its_values() {
        let mut c = group(1).pop().unwrap();
        let mut buf = HostGrads::zeros(4);
        buf.range_mut(0..4)
            .unwrap()
            .copy_from_slice(&[1.0, 2.0, 3.0, 4.0]);
        c.start_average(&mut buf, 0, 0..4, 1.0).unwrap();
        c.finish_averages(&mut buf).unwrap();
        let mut v = [5.0];
        c.sum(&mut v).unwrap();
        assert_eq!(v, [5.0]);
        assert_eq!(buf.as_slice().unwrap(), &[1.0, 2.0, 3.0, 4.0]);
        assert!(c.thread.is_none());
    }
}
