//! The [`Collective`] of N GPU ranks that share one GPU in one process: the test-only
//! rehearsal of a multi-GPU run on a machine with a single GPU (`BIRDTRAIN_REHEARSE_RANKS`, see
//! ARCHITECTURE.md), where NCCL refuses two ranks on one device. Every rank keeps its own
//! buffers in the device's one context, so a device address is valid for every rank.
//!
//! Host coordination is in rounds, as in [`super::local`]: every rank numbers its calls in
//! program order; calls with the same number form a round of the shared [`DeviceGroup`]; the
//! last rank to join a round reduces it, in rank order, under the group's lock.
//! - A bucket average ([`Collective::start_average`]) or a device sum
//!   ([`DeviceCollective::start_device_sum`]) records a *ready* marker on the rank's compute
//!   stream, joins its round and returns at once. The last joiner enqueues the reduction on its
//!   own communication stream: a wait for every rank's ready marker, one kernel over every
//!   rank's buffer (kernels/collective.cu), for sums the copies into each rank's host memory,
//!   then each rank's *done* marker.
//! - [`Collective::finish_averages`] waits on the host (watchdog-guarded) until the step's
//!   rounds are enqueued, then makes the rank's compute stream wait for their done markers; a
//!   device sum is read after [`DeviceCollective::wait_device_sum`] (one step later).
//! - Host sums and broadcasts are rounds of the same numbering, reduced on the host in rank
//!   order, so a rank that issues a different call at the same point is a mismatch error, and
//!   one abort releases every wait.
//!
//! A reduction is enqueued only once every rank has joined its round, so the device never waits
//! for a rank that has not arrived: an abort can leave no kernel spinning, and a round still
//! gathering when the group is aborted is never reduced. A rank that leaves (error, abort,
//! drop) first waits for the enqueued rounds it took part in, so no reduction writes into
//! memory it frees.
//!
//! The device operations are the [`RankDevice`] trait: CUDA events, streams and
//! [`crate::cuda::rank_reduce`] in [`super::same_gpu`]; fakes in the tests below.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use super::collective::{Collective, CollectiveError};
use super::nccl::DeviceGrads;
use super::watchdog::{Abortable, Watchdog, WatchdogError};
use crate::cuda::timeline::GpuTimeline;

/// How often the watchdogs look at pending calls (only timeouts depend on it).
const WATCHDOG_POLL: Duration = Duration::from_millis(20);

/// What a round reduces on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceKind {
    /// f32 values: `(Σ scale_r · v_r) / N` in rank order, into every rank's values.
    Average,
    /// f64 values: `Σ v_r` in rank order, into every rank's values and its host copy.
    Sum,
}

/// Page-locked host memory a device sum is copied into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostTarget(pub *mut f64);

// SAFETY: only the copy the reduction enqueues writes through it; its owner reads it after the
// copy's done marker (see `DeviceCollective::start_device_sum`).
unsafe impl Send for HostTarget {}
// SAFETY: as above; the pointer is never dereferenced by the group itself.
unsafe impl Sync for HostTarget {}

/// One rank's part of a device round.
#[derive(Debug, Clone)]
pub struct DevicePart<M> {
    /// Device address of the rank's first value (f32 for averages, f64 for sums).
    pub ptr: u64,
    /// Values.
    pub len: usize,
    /// The rank's scale (averages; 1 for an even split).
    pub scale: f32,
    /// Where a sum is copied for the host (sums only).
    pub host: Option<HostTarget>,
    /// Recorded on the rank's compute stream after the work that wrote the values.
    pub ready: M,
    /// Recorded by the reduction when the rank's values (and host copy) are final.
    pub done: M,
}

/// What the group needs of one rank's device. CUDA: [`super::same_gpu::SameGpuRank`].
pub trait RankDevice: Send + 'static {
    /// A point in a stream's work (a CUDA event), shared between ranks.
    type Marker: Clone + Send + Sync + 'static;

    /// A new marker, recorded on this rank's compute stream after the work issued so far.
    fn mark_compute(&self) -> Result<Self::Marker, String>;

    /// A new marker, not recorded yet (the reduction records it).
    fn new_marker(&self) -> Result<Self::Marker, String>;

    /// Enqueues the reduction of `parts` (every rank's, in rank order) on this rank's
    /// communication stream: after every part's `ready` marker, the reduction of `kind` into
    /// every part's values (and host copy), then every part's `done` marker.
    ///
    /// # Safety
    /// Every part's device values (and host target) must be live and left alone by their
    /// owners from their `ready` marker until their `done` marker.
    unsafe fn enqueue(
        &self,
        kind: ReduceKind,
        parts: &[&DevicePart<Self::Marker>],
    ) -> Result<(), String>;

    /// Makes this rank's compute stream wait for `marker` (the host does not wait).
    fn compute_waits(&self, marker: &Self::Marker) -> Result<(), String>;

    /// Blocks the host until the work before `marker` is done.
    fn host_waits(&self, marker: &Self::Marker) -> Result<(), String>;

    /// Whether the work before `marker` is done, without waiting (the watchdog's probe).
    fn is_done(marker: &Self::Marker) -> Result<bool, String>;
}

/// One rank's part of a round.
enum Part<M> {
    Device {
        kind: ReduceKind,
        part: DevicePart<M>,
        enqueued: Arc<AtomicBool>,
    },
    Sum(Vec<f64>),
    Broadcast {
        root: usize,
        len: usize,
        values: Option<Vec<f32>>,
    },
}

impl<M> Part<M> {
    fn describe(&self) -> String {
        match self {
            Part::Device {
                kind: ReduceKind::Average,
                part,
                ..
            } => format!("an average of {} values", part.len),
            Part::Device {
                kind: ReduceKind::Sum,
                part,
                ..
            } => format!("a device sum of {} values", part.len),
            Part::Sum(v) => format!("a sum of {} values", v.len()),
            Part::Broadcast { root, len, .. } => {
                format!("a broadcast of {len} values from rank {root}")
            }
        }
    }

    fn same_kind(&self, other: &Part<M>) -> bool {
        match (self, other) {
            (
                Part::Device { kind, part, .. },
                Part::Device {
                    kind: k2, part: p2, ..
                },
            ) => kind == k2 && part.len == p2.len,
            (Part::Sum(a), Part::Sum(b)) => a.len() == b.len(),
            (
                Part::Broadcast { root, len, .. },
                Part::Broadcast {
                    root: r2, len: l2, ..
                },
            ) => root == r2 && len == l2,
            _ => false,
        }
    }
}

/// A reduced round's result.
#[derive(Debug, Clone)]
enum Outcome {
    /// The device reduction is enqueued (its done markers tell when it ran).
    Enqueued,
    Sum(Arc<Vec<f64>>),
    Broadcast(Arc<Vec<f32>>),
}

struct Round<M> {
    label: String,
    parts: Vec<Option<Part<M>>>,
    arrived: usize,
    outcome: Option<Outcome>,
    picked_up: usize,
}

struct GroupState<M> {
    rounds: HashMap<u64, Round<M>>,
    aborted: Option<String>,
}

/// The state the ranks sharing one GPU share: the rounds in progress and the abort reason.
pub struct DeviceGroup<M> {
    world: usize,
    state: Mutex<GroupState<M>>,
    changed: Condvar,
}

impl<M> std::fmt::Debug for DeviceGroup<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceGroup")
            .field("world", &self.world)
            .finish_non_exhaustive()
    }
}

impl<M: Clone + Send + Sync + 'static> DeviceGroup<M> {
    /// A group of `world` ranks (1 to [`crate::cuda::rank_reduce::MAX_RANKS`] on a GPU).
    pub fn new(world: usize) -> Arc<DeviceGroup<M>> {
        Arc::new(DeviceGroup {
            world: world.max(1),
            state: Mutex::new(GroupState {
                rounds: HashMap::new(),
                aborted: None,
            }),
            changed: Condvar::new(),
        })
    }

    /// Ranks in the group.
    pub fn world(&self) -> usize {
        self.world
    }

    fn lock(&self) -> MutexGuard<'_, GroupState<M>> {
        // Rounds are updated whole under the lock; a panicking rank leaves them consistent.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Aborts the group: every waiting and later call fails with `reason` (the first reason
    /// given stays), and no round still gathering is ever reduced.
    pub fn abort(&self, reason: &str) {
        let mut state = self.lock();
        if state.aborted.is_none() {
            state.aborted = Some(reason.to_string());
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Why the group was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.lock().aborted.clone()
    }

    /// The oldest round still gathering and the ranks it waits for.
    fn stuck(&self) -> Option<(String, Vec<usize>)> {
        let state = self.lock();
        let (_, round) = state
            .rounds
            .iter()
            .filter(|(_, r)| r.outcome.is_none())
            .min_by_key(|(seq, _)| **seq)?;
        let missing = (0..self.world)
            .filter(|&r| round.parts[r].is_none())
            .collect();
        Some((round.label.clone(), missing))
    }

    /// Whether round `seq` still waits for ranks (never true again once reduced).
    fn is_gathering(&self, seq: u64) -> bool {
        self.lock()
            .rounds
            .get(&seq)
            .is_some_and(|r| r.outcome.is_none())
    }

    /// Whether round `seq` was reduced (a round every rank picked up is gone: reduced too).
    fn is_reduced(&self, seq: u64) -> bool {
        self.lock()
            .rounds
            .get(&seq)
            .is_none_or(|r| r.outcome.is_some())
    }

    /// Joins round `seq` with `part`; the last rank to join reduces it (device rounds through
    /// `device`, this rank's). Returns at once: [`DeviceGroup::outcome`] waits for the result.
    fn join<D: RankDevice<Marker = M>>(
        &self,
        rank: usize,
        seq: u64,
        label: &str,
        part: Part<M>,
        device: &D,
    ) -> Result<(), CollectiveError> {
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
            parts: (0..world).map(|_| None).collect(),
            arrived: 0,
            outcome: None,
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
                state.aborted.get_or_insert_with(|| {
                    format!("rank {rank}: collectives out of step: {detail}")
                });
                drop(state);
                self.changed.notify_all();
                return Err(CollectiveError::Mismatch {
                    rank,
                    what: label.to_string(),
                    detail,
                });
            }
        }
        if round.parts[rank].is_some() {
            return Err(CollectiveError::Buffer {
                rank,
                detail: format!("joined call {seq} ({label}) twice"),
            });
        }
        round.parts[rank] = Some(part);
        round.arrived += 1;
        if round.arrived < world {
            return Ok(());
        }
        // The last to arrive: reduce now, under the lock (a device reduction only enqueues).
        let parts: Vec<Part<M>> = round.parts.iter_mut().filter_map(Option::take).collect();
        match reduce(parts, device) {
            Ok(outcome) => {
                round.outcome = Some(outcome);
                drop(state);
                self.changed.notify_all();
                Ok(())
            }
            Err(e) => {
                let detail = format!("rank {rank}: enqueuing the reduction of {label} failed: {e}");
                state.aborted.get_or_insert_with(|| detail.clone());
                drop(state);
                self.changed.notify_all();
                Err(CollectiveError::Buffer { rank, detail })
            }
        }
    }

    /// Waits until round `seq` (which this rank joined) is reduced and returns its result; an
    /// abort while it still gathers is an error. A reduced round is picked up even after an
    /// abort: its work is enqueued and will complete.
    fn outcome(&self, rank: usize, seq: u64) -> Result<Outcome, CollectiveError> {
        let mut state = self.lock();
        loop {
            let Some(round) = state.rounds.get_mut(&seq) else {
                return Err(CollectiveError::Buffer {
                    rank,
                    detail: format!("call {seq} was picked up twice"),
                });
            };
            if let Some(outcome) = round.outcome.clone() {
                round.picked_up += 1;
                if round.picked_up == self.world {
                    state.rounds.remove(&seq);
                }
                return Ok(outcome);
            }
            if let Some(reason) = &state.aborted {
                return Err(CollectiveError::Aborted {
                    rank,
                    reason: reason.clone(),
                });
            }
            state = self.changed.wait(state).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// The reduction of one full round (parts in rank order).
fn reduce<D: RankDevice>(parts: Vec<Part<D::Marker>>, device: &D) -> Result<Outcome, String> {
    match parts.first() {
        Some(Part::Device { kind, .. }) => {
            let kind = *kind;
            let mut device_parts = Vec::with_capacity(parts.len());
            let mut flags = Vec::with_capacity(parts.len());
            for p in &parts {
                if let Part::Device { part, enqueued, .. } = p {
                    device_parts.push(part);
                    flags.push(enqueued);
                }
            }
            // SAFETY: every part's owner joined this round after recording its ready marker
            // and leaves its values alone until its done marker (finish_averages and
            // wait_device_sum wait for it; a rank that leaves waits for its reduced rounds).
            unsafe { device.enqueue(kind, &device_parts) }?;
            for f in flags {
                f.store(true, Ordering::Release);
            }
            Ok(Outcome::Enqueued)
        }
        Some(Part::Sum(_)) => {
            let mut sums = parts.into_iter().filter_map(|p| match p {
                Part::Sum(v) => Some(v),
                _ => None,
            });
            let mut acc = sums.next().unwrap_or_default();
            for v in sums {
                acc.iter_mut().zip(&v).for_each(|(a, b)| *a += b);
            }
            Ok(Outcome::Sum(Arc::new(acc)))
        }
        Some(Part::Broadcast { .. }) => {
            let root = parts.into_iter().find_map(|p| match p {
                Part::Broadcast { values, .. } => values,
                _ => None,
            });
            Ok(Outcome::Broadcast(Arc::new(root.unwrap_or_default())))
        }
        None => Err("a round without parts".into()),
    }
}

/// What the watchdog aborts: the group, on behalf of one rank, naming who never joined.
struct GroupAbort<M> {
    group: Arc<DeviceGroup<M>>,
    rank: usize,
    timeout: Duration,
}

impl<M: Clone + Send + Sync + 'static> Abortable for GroupAbort<M> {
    fn abort(&self) -> Result<(), String> {
        let reason = match self.group.stuck() {
            Some((label, missing)) if !missing.is_empty() => format!(
                "rank {}'s watchdog: {label} did not complete within {:?}; {} never joined it",
                self.rank,
                self.timeout,
                ranks_text(&missing)
            ),
            _ => format!(
                "rank {}'s watchdog: a collective did not complete within {:?}",
                self.rank, self.timeout
            ),
        };
        self.group.abort(&reason);
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

/// A device round this rank joined and has not waited for yet.
struct Joined<M> {
    seq: u64,
    done: M,
}

/// One rank of a [`DeviceGroup`]: see the module docs.
pub struct DeviceCollective<D: RankDevice> {
    // First, so it stops polling before anything else goes.
    watchdog: Watchdog,
    rank: usize,
    world: usize,
    group: Arc<DeviceGroup<D::Marker>>,
    /// The rank's device, or why it could not be set up (the group is aborted then).
    device: Result<D, String>,
    next_seq: u64,
    step: u64,
    /// This step's bucket averages.
    averages: Vec<Joined<D::Marker>>,
    /// Device sums not waited for yet (read one step later, from `&self`).
    sums: Mutex<Vec<Joined<D::Marker>>>,
    /// Test hook: fail the first bucket average of this global step (1-based).
    fail_at: Option<(u64, String)>,
    timeline: Option<GpuTimeline>,
}

impl<D: RankDevice> std::fmt::Debug for DeviceCollective<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceCollective")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<D: RankDevice> DeviceCollective<D> {
    /// Rank `rank` of `group`, on `device` (or the error that kept its device from being set
    /// up: the group is aborted with it, and every call of this rank returns it). A call that
    /// waits longer than `timeout` for the other ranks aborts the group.
    pub fn new(
        group: &Arc<DeviceGroup<D::Marker>>,
        rank: usize,
        timeout: Duration,
        device: Result<D, String>,
    ) -> Self {
        if let Err(e) = &device {
            group.abort(&format!("rank {rank} failed: {e}"));
        }
        let target = Arc::new(GroupAbort {
            group: group.clone(),
            rank,
            timeout,
        });
        DeviceCollective {
            watchdog: Watchdog::start(rank, timeout, WATCHDOG_POLL, target),
            rank,
            world: group.world,
            group: group.clone(),
            device,
            next_seq: 0,
            step: 0,
            averages: Vec::new(),
            sums: Mutex::new(Vec::new()),
            fail_at: None,
            timeline: None,
        }
    }

    /// Test hook: the first bucket average of global step `step` (1-based) fails with an error
    /// naming this rank and `why` (the fault-injection variable), as a device fault would.
    pub fn fail_at_step(&mut self, step: u64, why: impl Into<String>) {
        self.fail_at = Some((step, why.into()));
    }

    /// The `--trace` timeline of this rank's GPU stream work.
    pub fn set_timeline(&mut self, timeline: Option<GpuTimeline>) {
        self.timeline = timeline;
    }

    /// The timeline, to add spans or flush it at a step boundary.
    pub fn timeline_mut(&mut self) -> Option<&mut GpuTimeline> {
        self.timeline.as_mut()
    }

    fn seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    fn device(&self) -> Result<&D, CollectiveError> {
        self.device.as_ref().map_err(|e| CollectiveError::Buffer {
            rank: self.rank,
            detail: format!("its device collective could not be set up: {e}"),
        })
    }

    fn device_error(&self, what: &str, e: String) -> CollectiveError {
        CollectiveError::Buffer {
            rank: self.rank,
            detail: format!("{what}: {e}"),
        }
    }

    /// The error a failed call reports: this rank's watchdog fault (with what the group knows)
    /// when it fired, else the error itself. Waits for the rank's reduced rounds first, so the
    /// caller may free its buffers.
    fn failed(&self, e: CollectiveError) -> CollectiveError {
        self.quiesce();
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

    /// Waits (host) for every reduced round this rank joined and has not waited for, so that
    /// no reduction still runs on its buffers. Rounds still gathering are left: once the group
    /// is aborted they are never reduced.
    fn quiesce(&self) {
        let Ok(device) = &self.device else {
            return;
        };
        let sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
        for j in self.averages.iter().chain(sums.iter()) {
            if self.group.is_reduced(j.seq) {
                if let Err(e) = device.host_waits(&j.done) {
                    tracing::warn!(
                        "rank {}: waiting for a reduction before leaving: {e}",
                        self.rank
                    );
                }
            }
        }
    }

    /// Registers a device round with the watchdog: done once enqueued and its marker passed.
    fn watch_device(
        &self,
        label: &str,
        enqueued: &Arc<AtomicBool>,
        done: &D::Marker,
    ) -> Result<(), CollectiveError> {
        let (flag, marker) = (enqueued.clone(), done.clone());
        self.watchdog
            .watch(label.to_string(), move || {
                Ok(flag.load(Ordering::Acquire) && D::is_done(&marker)?)
            })
            .map_err(|source| CollectiveError::Watchdog {
                source,
                detail: String::new(),
            })
    }

    /// Joins a device round for `len` values at `ptr`; returns the round and this rank's done
    /// marker.
    fn join_device(
        &mut self,
        kind: ReduceKind,
        label: String,
        ptr: u64,
        len: usize,
        scale: f32,
        host: Option<HostTarget>,
    ) -> Result<Joined<D::Marker>, CollectiveError> {
        self.check()?;
        let seq = self.seq();
        let device = self.device()?;
        let ready = device
            .mark_compute()
            .map_err(|e| self.device_error("record a ready marker", e))?;
        let done = device
            .new_marker()
            .map_err(|e| self.device_error("create a done marker", e))?;
        let enqueued = Arc::new(AtomicBool::new(false));
        self.watch_device(&label, &enqueued, &done)?;
        let part = Part::Device {
            kind,
            part: DevicePart {
                ptr,
                len,
                scale,
                host,
                ready,
                done: done.clone(),
            },
            enqueued,
        };
        self.group
            .join(self.rank, seq, &label, part, device)
            .map_err(|e| self.failed(e))?;
        Ok(Joined { seq, done })
    }

    /// Starts summing `len` f64 values at device address `ptr` over every rank (rank order),
    /// after the compute work issued so far, the sum written back there and copied to `host`.
    /// Returns at once with the marker to pass to [`DeviceCollective::wait_device_sum`] (the
    /// host reads `host` after it).
    ///
    /// # Safety
    /// `ptr` must address `len` live f64 in the device's context and `host` `len` f64 of
    /// page-locked host memory; neither may be touched until the wait has returned.
    pub unsafe fn start_device_sum(
        &mut self,
        ptr: u64,
        len: usize,
        host: HostTarget,
        label: &str,
    ) -> Result<D::Marker, CollectiveError> {
        let label = format!("{label} after step {}", self.step);
        let joined = self.join_device(ReduceKind::Sum, label, ptr, len, 1.0, Some(host))?;
        let done = joined.done.clone();
        self.sums
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(joined);
        Ok(done)
    }

    /// Waits until the device sum whose marker `is_it` recognises has been copied to the host.
    pub fn wait_device_sum(
        &self,
        is_it: impl Fn(&D::Marker) -> bool,
    ) -> Result<(), CollectiveError> {
        let found = {
            let sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
            sums.iter()
                .find(|j| is_it(&j.done))
                .map(|j| (j.seq, j.done.clone()))
        };
        let Some((seq, done)) = found else {
            return Err(CollectiveError::Buffer {
                rank: self.rank,
                detail: "waited for a device sum that was never started (or twice)".into(),
            });
        };
        self.group
            .outcome(self.rank, seq)
            .map_err(|e| self.failed(e))?;
        let waited = self
            .device()?
            .host_waits(&done)
            .map_err(|e| self.device_error("wait for a device sum", e));
        self.sums
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|j| j.seq != seq);
        waited.map_err(|e| self.failed(e))?;
        self.check()
    }

    /// A sum of host values over the group, watched for `timeout` (`None`: the collective
    /// timeout).
    fn sum_for(
        &mut self,
        values: &mut [f64],
        timeout: Option<Duration>,
    ) -> Result<(), CollectiveError> {
        let label = format!("sum of {} values in step {}", values.len(), self.step + 1);
        match self.blocking(label, Part::Sum(values.to_vec()), timeout)? {
            Outcome::Sum(v) if v.len() == values.len() => {
                values.copy_from_slice(&v);
                Ok(())
            }
            other => Err(CollectiveError::Mismatch {
                rank: self.rank,
                what: "sum".into(),
                detail: format!("{} values here, {other:?} from the group", values.len()),
            }),
        }
    }

    /// Runs a host round (sum or broadcast) to its end, watched by the watchdog (for
    /// `timeout` when given, else the collective timeout).
    fn blocking(
        &mut self,
        label: String,
        part: Part<D::Marker>,
        timeout: Option<Duration>,
    ) -> Result<Outcome, CollectiveError> {
        self.check()?;
        let seq = self.seq();
        let done = Arc::new(AtomicBool::new(false));
        let probe = done.clone();
        let finished = move || Ok(probe.load(Ordering::Acquire));
        match timeout {
            Some(t) => self.watchdog.watch_within(label.clone(), t, finished),
            None => self.watchdog.watch(label.clone(), finished),
        }
        .map_err(|source| CollectiveError::Watchdog {
            source,
            detail: String::new(),
        })?;
        let device = self.device()?;
        let out = self
            .group
            .join(self.rank, seq, &label, part, device)
            .and_then(|()| self.group.outcome(self.rank, seq));
        done.store(true, Ordering::Release);
        out.map_err(|e| self.failed(e))
    }
}

impl<D: RankDevice> Collective for DeviceCollective<D> {
    type Buffer = DeviceGrads;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn start_average(
        &mut self,
        buffer: &mut DeviceGrads,
        bucket: usize,
        range: Range<usize>,
        scale: f32,
    ) -> Result<(), CollectiveError> {
        let rank = self.rank;
        if range.start > range.end || range.end > buffer.len {
            return Err(CollectiveError::Buffer {
                rank,
                detail: format!(
                    "range {range:?} is outside the gradient buffer of {} values",
                    buffer.len
                ),
            });
        }
        if let Some((step, why)) = &self.fail_at {
            if self.step + 1 == *step {
                let detail = format!("fault injected in step {step}, bucket {bucket} ({why})");
                tracing::error!("rank {rank}: {detail}");
                return Err(CollectiveError::Buffer { rank, detail });
            }
        }
        let label = format!("all-reduce of bucket {bucket} in step {}", self.step + 1);
        let ptr = buffer.ptr + 4 * range.start as u64;
        let joined = self.join_device(ReduceKind::Average, label, ptr, range.len(), scale, None)?;
        self.averages.push(joined);
        Ok(())
    }

    fn finish_averages(&mut self, _buffer: &mut DeviceGrads) -> Result<(), CollectiveError> {
        self.step += 1;
        while let Some(first) = self.averages.first() {
            let seq = first.seq;
            self.group
                .outcome(self.rank, seq)
                .map_err(|e| self.failed(e))?;
            let joined = self.averages.remove(0);
            let device = self.device()?;
            if let Err(e) = device.compute_waits(&joined.done) {
                // The compute stream may not wait: the host does, before the buffer is freed.
                let _ = device.host_waits(&joined.done);
                return Err(self.failed(self.device_error("wait for an average", e)));
            }
        }
        self.check()
    }

    fn broadcast(&mut self, values: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        let part = Part::Broadcast {
            root,
            len: values.len(),
            values: (self.rank == root).then(|| values.to_vec()),
        };
        let label = format!("broadcast of {} values from rank {root}", values.len());
        match self.blocking(label, part, None)? {
            Outcome::Broadcast(v) if v.len() == values.len() => {
                values.copy_from_slice(&v);
                Ok(())
            }
            other => Err(CollectiveError::Mismatch {
                rank: self.rank,
                what: "broadcast".into(),
                detail: format!("{} values here, {other:?} from rank {root}", values.len()),
            }),
        }
    }

    fn sum(&mut self, values: &mut [f64]) -> Result<(), CollectiveError> {
        self.sum_for(values, None)
    }

    fn sum_within(&mut self, values: &mut [f64], timeout: Duration) -> Result<(), CollectiveError> {
        self.sum_for(values, Some(timeout))
    }

    fn check(&self) -> Result<(), CollectiveError> {
        if let Some(fault) = self.watchdog.fault() {
            return Err(CollectiveError::Watchdog {
                source: WatchdogError::Aborted(fault),
                detail: String::new(),
            });
        }
        self.device()?;
        match self.group.aborted() {
            Some(reason) => Err(CollectiveError::Aborted {
                rank: self.rank,
                reason,
            }),
            None => Ok(()),
        }
    }

    fn abort(&self, reason: &str) {
        tracing::error!("rank {}: aborting the device group: {reason}", self.rank);
        self.group.abort(reason);
        self.quiesce();
    }
}

impl<D: RankDevice> Drop for DeviceCollective<D> {
    fn drop(&mut self) {
        let gathering = {
            let sums = self.sums.lock().unwrap_or_else(|p| p.into_inner());
            self.averages
                .iter()
                .chain(sums.iter())
                .filter(|j| self.group.is_gathering(j.seq))
                .count()
        };
        if std::thread::panicking() {
            self.group
                .abort(&format!("rank {} stopped: its thread panicked", self.rank));
        } else if gathering > 0 {
            // The others must neither wait for this rank nor reduce into its buffers.
            self.group.abort(&format!(
                "rank {} stopped with {gathering} collective(s) in flight",
                self.rank
            ));
        }
        self.quiesce();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dist::local::{HostGrads, LocalGroup};
    use std::sync::mpsc;
    use std::time::Instant;

    /// A marker of the fake device: never recorded, recorded with its work pending, or done.
    #[derive(Debug, Default)]
    struct FakeEvent {
        state: Mutex<(bool, bool)>, // (recorded, done)
        changed: Condvar,
    }

    impl FakeEvent {
        fn set(&self, recorded: bool, done: bool) {
            *self.state.lock().unwrap() = (recorded, done);
            self.changed.notify_all();
        }
        fn recorded(&self) -> bool {
            self.state.lock().unwrap().0
        }
    }

    type Marker = Arc<FakeEvent>;

    /// What the fake devices did, in order: (rank that enqueued, kind, rounds so far).
    #[derive(Debug, Default)]
    struct Device {
        enqueued: Mutex<Vec<(usize, ReduceKind)>>,
        /// Done markers whose work has not "run" yet (`manual` devices only).
        pending: Mutex<Vec<Marker>>,
        manual: bool,
        fail_enqueue: bool,
    }

    impl Device {
        /// Runs every enqueued reduction's remaining work (a manual device).
        fn complete(&self) {
            for m in self.pending.lock().unwrap().drain(..) {
                m.set(true, true);
            }
        }
    }

    /// One rank's fake device: host memory stands for device memory, and the reduction runs
    /// the kernel's rule when enqueued. Waiting on a marker nobody recorded is an error: on a
    /// GPU that wait would pass at once and read values not yet reduced.
    struct FakeRank {
        rank: usize,
        device: Arc<Device>,
    }

    impl RankDevice for FakeRank {
        type Marker = Marker;

        fn mark_compute(&self) -> Result<Marker, String> {
            let m = Arc::new(FakeEvent::default());
            m.set(true, true);
            Ok(m)
        }

        fn new_marker(&self) -> Result<Marker, String> {
            Ok(Arc::new(FakeEvent::default()))
        }

        unsafe fn enqueue(
            &self,
            kind: ReduceKind,
            parts: &[&DevicePart<Marker>],
        ) -> Result<(), String> {
            if self.device.fail_enqueue {
                return Err("launch failed (fake)".into());
            }
            for p in parts {
                if !p.ready.recorded() {
                    return Err("a ready marker that was never recorded".into());
                }
            }
            let n = parts.len();
            let len = parts[0].len;
            for i in 0..len {
                match kind {
                    ReduceKind::Average => {
                        let v = |p: &DevicePart<Marker>| *(p.ptr as *const f32).add(i);
                        let mut acc = parts[0].scale * v(parts[0]);
                        for p in &parts[1..] {
                            acc += p.scale * v(p);
                        }
                        let mean = acc / n as f32;
                        for p in parts {
                            *(p.ptr as *mut f32).add(i) = mean;
                        }
                    }
                    ReduceKind::Sum => {
                        let v = |p: &DevicePart<Marker>| *(p.ptr as *const f64).add(i);
                        let mut acc = v(parts[0]);
                        for p in &parts[1..] {
                            acc += v(p);
                        }
                        for p in parts {
                            *(p.ptr as *mut f64).add(i) = acc;
                            if let Some(h) = p.host {
                                *h.0.add(i) = acc;
                            }
                        }
                    }
                }
            }
            for p in parts {
                p.done.set(true, !self.device.manual);
                if self.device.manual {
                    self.device.pending.lock().unwrap().push(p.done.clone());
                }
            }
            self.device.enqueued.lock().unwrap().push((self.rank, kind));
            Ok(())
        }

        fn compute_waits(&self, marker: &Marker) -> Result<(), String> {
            match marker.recorded() {
                true => Ok(()),
                false => Err("the compute stream would wait on an unrecorded marker".into()),
            }
        }

        fn host_waits(&self, marker: &Marker) -> Result<(), String> {
            let mut s = marker.state.lock().unwrap();
            if !s.0 {
                return Err("the host would wait on an unrecorded marker".into());
            }
            while !s.1 {
                s = marker.changed.wait(s).unwrap();
            }
            Ok(())
        }

        fn is_done(marker: &Marker) -> Result<bool, String> {
            Ok(marker.state.lock().unwrap().1)
        }
    }

    fn group_on(
        world: usize,
        timeout: Duration,
        device: &Arc<Device>,
    ) -> Vec<DeviceCollective<FakeRank>> {
        let group = DeviceGroup::new(world);
        (0..world)
            .map(|rank| {
                let fake = FakeRank {
                    rank,
                    device: device.clone(),
                };
                DeviceCollective::new(&group, rank, timeout, Ok(fake))
            })
            .collect()
    }

    fn group(world: usize) -> (Vec<DeviceCollective<FakeRank>>, Arc<Device>) {
        let device = Arc::new(Device::default());
        (group_on(world, Duration::from_secs(30), &device), device)
    }

    fn grads(v: &mut [f32]) -> DeviceGrads {
        DeviceGrads {
            ptr: v.as_mut_ptr() as u64,
            len: v.len(),
        }
    }

    /// Rank r's gradients at a step: values that round differently in every order.
    fn values(rank: usize, step: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((rank * 7919 + step * 104_729 + i * 31) % 1000) as f32 / 7.0 - 70.0)
            .collect()
    }

    /// Each rank's buffer after `steps` steps of two buckets: [0, 17) scaled by the rank's
    /// share, [17, len) as is.
    const LEN: usize = 41;
    fn scale_of(rank: usize) -> f32 {
        [1.5, 0.5, 0.75, 1.25][rank]
    }

    #[test]
    fn averages_equal_the_cpu_ranks_collective_bit_for_bit_with_every_rank_count() {
        for world in 1..=4usize {
            let (ranks, device) = group(world);
            let on_device: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = ranks
                    .into_iter()
                    .map(|mut c| {
                        s.spawn(move || {
                            let r = c.rank();
                            let mut buf = vec![0.0f32; LEN];
                            for step in 0..5 {
                                buf.copy_from_slice(&values(r, step, LEN));
                                let mut g = grads(&mut buf);
                                let scale = if world == 1 { 1.0 } else { scale_of(r) };
                                c.start_average(&mut g, 0, 0..17, scale).unwrap();
                                c.start_average(&mut g, 1, 17..LEN, 1.0).unwrap();
                                c.finish_averages(&mut g).unwrap();
                            }
                            buf
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let on_cpu: Vec<Vec<f32>> = std::thread::scope(|s| {
                let handles: Vec<_> = LocalGroup::ranks(world, Duration::from_secs(30))
                    .into_iter()
                    .map(|mut c| {
                        s.spawn(move || {
                            let r = c.rank();
                            let mut buf = HostGrads::zeros(LEN);
                            for step in 0..5 {
                                buf.range_mut(0..LEN)
                                    .unwrap()
                                    .copy_from_slice(&values(r, step, LEN));
                                let scale = if world == 1 { 1.0 } else { scale_of(r) };
                                c.start_average(&mut buf, 0, 0..17, scale).unwrap();
                                c.start_average(&mut buf, 1, 17..LEN, 1.0).unwrap();
                                c.finish_averages(&mut buf).unwrap();
                            }
                            buf.as_slice().unwrap().to_vec()
                        })
                    })
                    .collect();
                handles.into_iter().map(|h| h.join().unwrap()).collect()
            });
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for (r, (dev, cpu)) in on_device.iter().zip(&on_cpu).enumerate() {
                assert_eq!(bits(dev), bits(cpu), "world {world}, rank {r}");
                assert_eq!(bits(dev), bits(&on_device[0]), "world {world}, rank {r}");
            }
            // One reduction per round: 2 buckets × 5 steps, whoever came last.
            assert_eq!(device.enqueued.lock().unwrap().len(), 10, "world {world}");
        }
    }

    #[test]
    fn the_last_rank_to_join_enqueues_and_nobody_waits_for_an_absent_rank_on_the_device() {
        let (mut ranks, device) = group(3);
        let late = ranks.pop().unwrap();
        let (go, wait_for_go) = mpsc::channel::<()>();
        let finished: Vec<Arc<AtomicBool>> =
            (0..2).map(|_| Arc::new(AtomicBool::new(false))).collect();
        std::thread::scope(|s| {
            for (c, done) in ranks.into_iter().zip(&finished) {
                s.spawn(move || {
                    let mut c = c;
                    let mut buf = values(c.rank(), 0, 8);
                    let mut g = grads(&mut buf);
                    c.start_average(&mut g, 0, 0..8, 1.0).unwrap();
                    c.finish_averages(&mut g).unwrap();
                    done.store(true, Ordering::SeqCst);
                    buf
                });
            }
            let late = s.spawn(move || {
                let mut c = late;
                wait_for_go.recv().unwrap();
                let mut buf = values(2, 0, 8);
                let mut g = grads(&mut buf);
                c.start_average(&mut g, 0, 0..8, 1.0).unwrap();
                c.finish_averages(&mut g).unwrap();
                buf
            });
            std::thread::sleep(Duration::from_millis(200));
            // Ranks 0 and 1 joined and wait on the host: nothing is on the device yet.
            assert!(device.enqueued.lock().unwrap().is_empty());
            assert!(finished.iter().all(|f| !f.load(Ordering::SeqCst)));
            go.send(()).unwrap();
            let mean = late.join().unwrap();
            let want: Vec<f32> = (0..8)
                .map(|i| (values(0, 0, 8)[i] + values(1, 0, 8)[i] + values(2, 0, 8)[i]) / 3.0)
                .collect();
            assert_eq!(mean, want);
        });
        assert!(finished.iter().all(|f| f.load(Ordering::SeqCst)));
        assert_eq!(
            *device.enqueued.lock().unwrap(),
            vec![(2, ReduceKind::Average)],
            "the late rank enqueued the one reduction"
        );
    }

    #[test]
    fn device_sums_add_in_rank_order_into_each_ranks_host_memory() {
        // 1e16 + 1 rounds to 1e16, so the rank order is visible: (1e16 + 1) − 1e16 = 0, while
        // 1e16 − 1e16 + 1 would be 1.
        let inputs = [[1e16, 2.5], [1.0, 0.25], [-1e16, 4.0]];
        let (ranks, _) = group(3);
        let got: Vec<[f64; 2]> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut dev = inputs[c.rank()];
                        let mut host = [f64::NAN; 2];
                        let marker = unsafe {
                            c.start_device_sum(
                                dev.as_mut_ptr() as u64,
                                2,
                                HostTarget(host.as_mut_ptr()),
                                "step totals",
                            )
                        }
                        .unwrap();
                        c.wait_device_sum(|m| Arc::ptr_eq(m, &marker)).unwrap();
                        // Waiting twice, or for a sum never started, is an error.
                        assert!(c.wait_device_sum(|m| Arc::ptr_eq(m, &marker)).is_err());
                        assert_eq!(dev, host, "the device values hold the sum too");
                        host
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for h in got {
            assert_eq!(h, [0.0, 6.75]);
        }
    }

    #[test]
    fn host_sums_and_broadcasts_interleave_with_device_rounds() {
        let (ranks, _) = group(4);
        std::thread::scope(|s| {
            for mut c in ranks {
                s.spawn(move || {
                    let r = c.rank();
                    let mut w = vec![r as f32; 3];
                    c.broadcast(&mut w, 0).unwrap();
                    assert_eq!(w, vec![0.0; 3]);
                    for step in 0..10 {
                        let mut buf = vec![r as f32 + step as f32; 6];
                        let mut g = grads(&mut buf);
                        c.start_average(&mut g, 0, 0..3, 1.0).unwrap();
                        // A sync-BN sum between two buckets.
                        let mut v = vec![r as f64, 1.0];
                        c.sum(&mut v).unwrap();
                        assert_eq!(v, vec![6.0, 4.0]);
                        c.start_average(&mut g, 1, 3..6, 1.0).unwrap();
                        c.finish_averages(&mut g).unwrap();
                        assert_eq!(buf, vec![1.5 + step as f32; 6]);
                    }
                    let mut w = vec![r as f32; 2];
                    c.broadcast(&mut w, 3).unwrap();
                    assert_eq!(w, vec![3.0; 2]);
                });
            }
        });
    }

    #[test]
    fn a_failing_rank_releases_the_others_at_once_and_nothing_gathering_is_reduced() {
        let (mut ranks, device) = group(2);
        let failing = ranks.pop().unwrap();
        let mut waiter = ranks.pop().unwrap();
        std::thread::scope(|s| {
            let w = s.spawn(move || {
                let mut buf = vec![1.0f32; 4];
                let mut g = grads(&mut buf);
                waiter.start_average(&mut g, 0, 0..4, 1.0).unwrap();
                let t = Instant::now();
                let e = waiter.finish_averages(&mut g).unwrap_err();
                (e, t.elapsed())
            });
            std::thread::sleep(Duration::from_millis(100));
            // What run_rank does with a rank's error.
            failing.abort("rank 1 failed: CUDA_ERROR_ILLEGAL_ADDRESS");
            let (e, waited) = w.join().unwrap();
            assert!(
                e.to_string()
                    .contains("rank 1 failed: CUDA_ERROR_ILLEGAL_ADDRESS"),
                "{e}"
            );
            assert!(matches!(e, CollectiveError::Aborted { rank: 0, .. }), "{e}");
            assert!(waited < Duration::from_secs(5), "{waited:?}");
        });
        assert!(device.enqueued.lock().unwrap().is_empty());
    }

    #[test]
    fn the_watchdog_names_the_rank_that_never_joined() {
        let device = Arc::new(Device::default());
        let mut ranks = group_on(3, Duration::from_millis(200), &device);
        let _absent = ranks.pop().unwrap(); // rank 2 never calls
        let start = Instant::now();
        let errors: Vec<String> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut buf = vec![1.0f32; 4];
                        let mut g = grads(&mut buf);
                        c.start_average(&mut g, 0, 0..4, 1.0).unwrap();
                        c.finish_averages(&mut g).unwrap_err().to_string()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(start.elapsed() < Duration::from_secs(20));
        for e in &errors {
            assert!(e.contains("rank 2 never joined"), "{e}");
            assert!(e.contains("all-reduce of bucket 0 in step 1"), "{e}");
        }
    }

    #[test]
    fn a_different_call_at_the_same_point_is_a_mismatch_not_garbage() {
        let (mut ranks, device) = group(2);
        let mut summer = ranks.pop().unwrap();
        let mut averager = ranks.pop().unwrap();
        let errors: Vec<String> = std::thread::scope(|s| {
            let a = s.spawn(move || {
                let mut buf = vec![1.0f32; 4];
                let mut g = grads(&mut buf);
                match averager.start_average(&mut g, 0, 0..4, 1.0) {
                    Ok(()) => averager.finish_averages(&mut g).unwrap_err().to_string(),
                    Err(e) => e.to_string(),
                }
            });
            let b = s.spawn(move || summer.sum(&mut [1.0, 2.0]).unwrap_err().to_string());
            vec![a.join().unwrap(), b.join().unwrap()]
        });
        assert!(
            errors.iter().any(|e| e.contains("does not match")),
            "{errors:?}"
        );
        assert!(
            errors.iter().any(|e| e.contains("an average of 4 values")),
            "{errors:?}"
        );
        assert!(device.enqueued.lock().unwrap().is_empty());
    }

    #[test]
    fn a_rank_dropped_with_a_round_in_flight_aborts_the_group() {
        let (mut ranks, device) = group(2);
        let mut dropped = ranks.pop().unwrap();
        let mut waiter = ranks.pop().unwrap();
        let mut mine = vec![1.0f32; 4];
        let mut g = grads(&mut mine);
        dropped.start_average(&mut g, 0, 0..4, 1.0).unwrap();
        drop(dropped);
        let mut buf = vec![1.0f32; 4];
        let mut g = grads(&mut buf);
        let e = waiter
            .start_average(&mut g, 0, 0..4, 1.0)
            .and_then(|()| waiter.finish_averages(&mut g))
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 1 stopped with 1 collective(s) in flight"),
            "{e}"
        );
        // The dropped rank's buffer is never reduced into.
        assert!(device.enqueued.lock().unwrap().is_empty());
        assert_eq!(mine, vec![1.0; 4]);
    }

    #[test]
    fn a_rank_leaving_waits_for_the_reductions_it_took_part_in() {
        let device = Arc::new(Device {
            manual: true,
            ..Default::default()
        });
        let mut ranks = group_on(2, Duration::from_secs(30), &device);
        let mut leaving = ranks.pop().unwrap();
        let mut other = ranks.pop().unwrap();
        let (mut a, mut b) = (vec![1.0f32; 4], vec![3.0f32; 4]);
        let (mut ga, mut gb) = (grads(&mut a), grads(&mut b));
        leaving.start_average(&mut gb, 0, 0..4, 1.0).unwrap();
        other.start_average(&mut ga, 0, 0..4, 1.0).unwrap(); // last: enqueued, not yet run
        let left = Arc::new(AtomicBool::new(false));
        std::thread::scope(|s| {
            let flag = left.clone();
            s.spawn(move || {
                leaving.abort("rank 1 failed: out of memory");
                drop(leaving);
                flag.store(true, Ordering::SeqCst);
            });
            std::thread::sleep(Duration::from_millis(150));
            assert!(
                !left.load(Ordering::SeqCst),
                "left before its reduction ran"
            );
            device.complete();
        });
        assert!(left.load(Ordering::SeqCst));
        // The round was reduced before the abort: it ran to its end; the other rank learns of
        // the abort at its next check.
        let e = other.finish_averages(&mut ga).unwrap_err();
        assert!(
            e.to_string().contains("rank 1 failed: out of memory"),
            "{e}"
        );
        assert_eq!(a, vec![2.0; 4]);
    }

    #[test]
    fn an_injected_fault_fails_its_rank_at_that_step_and_names_it() {
        let (mut ranks, _) = group(2);
        ranks[1].fail_at_step(2, "BIRDTRAIN_REHEARSE_FAULT=1@2");
        let results: Vec<Result<usize, String>> = std::thread::scope(|s| {
            let handles: Vec<_> = ranks
                .into_iter()
                .map(|mut c| {
                    s.spawn(move || {
                        let mut buf = vec![1.0f32; 4];
                        for step in 1..=3 {
                            let mut g = grads(&mut buf);
                            let r = c
                                .start_average(&mut g, 0, 0..4, 1.0)
                                .and_then(|()| c.finish_averages(&mut g));
                            if let Err(e) = r {
                                // run_rank's reaction to a rank's own error.
                                if !matches!(e, CollectiveError::Aborted { .. }) {
                                    c.abort(&format!("rank {} failed: {e}", c.rank()));
                                }
                                return Err(e.to_string());
                            }
                            let _ = step;
                        }
                        Ok(3)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let e1 = results[1].as_ref().unwrap_err();
        assert!(e1.starts_with("rank 1: fault injected in step 2"), "{e1}");
        assert!(e1.contains("BIRDTRAIN_REHEARSE_FAULT=1@2"), "{e1}");
        let e0 = results[0].as_ref().unwrap_err();
        assert!(e0.contains("rank 1 failed: rank 1: fault injected"), "{e0}");
    }

    #[test]
    fn a_device_that_cannot_be_set_up_fails_its_rank_and_releases_the_others() {
        let device = Arc::new(Device::default());
        let group = DeviceGroup::new(2);
        let mut ok = DeviceCollective::new(
            &group,
            0,
            Duration::from_secs(30),
            Ok(FakeRank {
                rank: 0,
                device: device.clone(),
            }),
        );
        let mut broken = DeviceCollective::<FakeRank>::new(
            &group,
            1,
            Duration::from_secs(30),
            Err("creating the communication stream: out of memory".into()),
        );
        let e = broken.broadcast(&mut [0.0], 0).unwrap_err();
        assert!(matches!(e, CollectiveError::Buffer { rank: 1, .. }), "{e}");
        assert!(e.to_string().contains("out of memory"), "{e}");
        let e = ok.broadcast(&mut [0.0], 0).unwrap_err();
        assert!(e.to_string().contains("rank 1 failed"), "{e}");
    }

    #[test]
    fn a_reduction_that_cannot_be_enqueued_aborts_the_group_naming_the_rank() {
        let device = Arc::new(Device {
            fail_enqueue: true,
            ..Default::default()
        });
        let mut ranks = group_on(2, Duration::from_secs(30), &device);
        let mut last = ranks.pop().unwrap();
        let mut first = ranks.pop().unwrap();
        let (mut a, mut b) = (vec![1.0f32; 4], vec![3.0f32; 4]);
        let (mut ga, mut gb) = (grads(&mut a), grads(&mut b));
        first.start_average(&mut ga, 0, 0..4, 1.0).unwrap();
        let e = last.start_average(&mut gb, 0, 0..4, 1.0).unwrap_err();
        assert!(
            e.to_string()
                .contains("rank 1: enqueuing the reduction of all-reduce of bucket 0 in step 1 failed: launch failed"),
            "{e}"
        );
        let e = first.finish_averages(&mut ga).unwrap_err();
        assert!(e.to_string().contains("launch failed"), "{e}");
    }
}
