//! The TCP rendezvous that starts a multi-node run.
//!
//! Node 0 listens on the launch plan's rendezvous port (the `--master` port; under torchrun,
//! whose agent holds `MASTER_PORT`, the port above it). Every other node connects (retrying
//! until the timeout, since nodes start in any order), says hello — protocol version, node
//! rank, node count, local GPU count, dataset fingerprint, model name, the checkpoint it
//! starts from — and waits. Once every node has
//! arrived and agrees with node 0, node 0 creates the NCCL unique id (an opaque byte string from
//! a closure, so this module needs no NCCL) and answers each node its global rank offset, the
//! world size in GPUs and the id. Any disagreement is answered with an error message that both
//! sides report; a node that never arrives fails the rendezvous with the missing node ranks.
//!
//! The checkpoint matters because only the weights are broadcast at the start: the optimizer
//! state, the data position, the moving average and the best epoch each node reads from its
//! own `--resume` folder, so nodes resuming different checkpoints (a folder not shared, or an
//! older copy) would train on silently from different states. Its identity (global step and
//! the weights file's checksum, or a fresh start) must be the same on every node.
//!
//! Wire format: one JSON object per line, each side sends exactly one message. Every socket
//! operation has a deadline; no loop runs unbounded.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

/// Version of the wire protocol; nodes running different versions refuse each other.
pub const PROTOCOL_VERSION: u32 = 2;

/// Longest message accepted (a hello or welcome is a few hundred bytes).
const MAX_MESSAGE_BYTES: u64 = 64 * 1024;

/// Errors of the rendezvous (each message is what the user sees on that node).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RendezvousError {
    /// Node 0 could not listen.
    #[error("node 0 cannot listen on {addr} for the rendezvous: {reason} (is the port in use? pick another --master port)")]
    Bind {
        /// The address.
        addr: String,
        /// The OS error.
        reason: String,
    },
    /// The master address does not resolve.
    #[error("rendezvous address {addr} does not resolve: {reason}")]
    Resolve {
        /// The address.
        addr: String,
        /// Why.
        reason: String,
    },
    /// Nodes missing at the deadline.
    #[error("rendezvous timed out after {waited:?}: node(s) {missing:?} of {nodes} never arrived (arrived: {arrived:?}); start them with the same --master and --nodes, or raise --rendezvous-timeout")]
    MissingNodes {
        /// Node ranks that never said hello.
        missing: Vec<usize>,
        /// Node ranks that did (0 included).
        arrived: Vec<usize>,
        /// Node count.
        nodes: usize,
        /// Time waited.
        waited: Duration,
    },
    /// A joining node never reached node 0.
    #[error("cannot reach the rendezvous master {addr} after {waited:?}: {last_error}; is node 0 running with the same --master?")]
    MasterUnreachable {
        /// The master address.
        addr: String,
        /// Time spent retrying.
        waited: Duration,
        /// The last connection error.
        last_error: String,
    },
    /// Connected, but no answer before the deadline.
    #[error("the rendezvous master {addr} accepted the connection but did not answer within {waited:?} (other nodes may be missing)")]
    MasterSilent {
        /// The master address.
        addr: String,
        /// Time waited.
        waited: Duration,
    },
    /// The nodes disagree (world size, fingerprint, model, duplicate rank, protocol).
    #[error("rendezvous rejected: {reason}")]
    Rejected {
        /// What disagrees, worded for both sides.
        reason: String,
    },
    /// Node 0 could not create the communicator id.
    #[error("node 0 could not create the NCCL unique id: {reason}")]
    UniqueId {
        /// Why.
        reason: String,
    },
    /// The peer spoke something else (not birdtrain, or a broken message).
    #[error("malformed rendezvous message from {peer}: {reason}")]
    Protocol {
        /// The peer address.
        peer: String,
        /// What was wrong.
        reason: String,
    },
    /// A socket error after the connection was made.
    #[error("rendezvous connection with {peer} failed: {reason}")]
    Io {
        /// The peer address.
        peer: String,
        /// The OS error.
        reason: String,
    },
    /// Invalid settings.
    #[error("invalid rendezvous setting: {0}")]
    Config(String),
}

/// What this node knows about itself, and the rendezvous settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeInfo {
    /// Total nodes (rendezvous participants).
    pub nodes: usize,
    /// This node's rank, 0..nodes.
    pub node_rank: usize,
    /// GPUs this node drives (its NCCL ranks).
    pub local_gpus: usize,
    /// Fingerprint of the dataset (every node must train on the same data).
    pub fingerprint: u64,
    /// Model name (every node must build the same model).
    pub model: String,
    /// The checkpoint this node starts from (every node must start from the same one).
    pub start: StartPoint,
}

/// Where a node's training starts: a fresh start or a checkpoint, named by what identifies
/// it. Only the weights are broadcast from rank 0, so every node must start from the same
/// point ([`serve`] refuses a node that does not).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPoint {
    /// No `--resume`: weights from the seed or `--init-from`, nothing else carried over.
    #[default]
    Fresh,
    /// `--resume` of a checkpoint.
    Checkpoint {
        /// Its global step.
        step: u64,
        /// The checksum of its weights file, as its sidecar records it.
        weights: String,
    },
}

impl std::fmt::Display for StartPoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartPoint::Fresh => f.write_str("a fresh start (no --resume)"),
            StartPoint::Checkpoint { step, weights } => write!(
                f,
                "the checkpoint of global step {step} (weights checksum {weights})"
            ),
        }
    }
}

/// What every node learns from the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    /// Global NCCL rank of this node's first GPU.
    pub rank_offset: usize,
    /// Total GPUs (NCCL ranks) over all nodes.
    pub world_size: usize,
    /// GPUs per node, indexed by node rank.
    pub node_gpus: Vec<usize>,
    /// The NCCL unique id, as node 0 created it.
    pub unique_id: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
struct Hello {
    protocol: u32,
    node_rank: usize,
    nodes: usize,
    gpus: usize,
    fingerprint: u64,
    model: String,
    /// Absent from an older version's hello, which the protocol check then refuses by name.
    #[serde(default)]
    start: StartPoint,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
enum Reply {
    Welcome {
        rank_offset: usize,
        world_size: usize,
        node_gpus: Vec<usize>,
        unique_id: String,
    },
    Error {
        reason: String,
    },
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if s.len() % 2 != 0 {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok())
        .collect()
}

fn io_err(peer: &str, e: std::io::Error) -> RendezvousError {
    RendezvousError::Io {
        peer: peer.to_string(),
        reason: e.to_string(),
    }
}

fn read_message(stream: &TcpStream, peer: &str) -> Result<String, RendezvousError> {
    let mut line = String::new();
    let reader = stream.try_clone().map_err(|e| io_err(peer, e))?;
    BufReader::new(reader.take(MAX_MESSAGE_BYTES))
        .read_line(&mut line)
        .map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                RendezvousError::MasterSilent {
                    addr: peer.to_string(),
                    waited: Duration::ZERO,
                }
            }
            _ => io_err(peer, e),
        })?;
    if !line.ends_with('\n') {
        return Err(RendezvousError::Protocol {
            peer: peer.to_string(),
            reason: if line.is_empty() {
                "connection closed without a message".to_string()
            } else {
                "message not terminated by a newline (or too long)".to_string()
            },
        });
    }
    Ok(line)
}

fn send<T: Serialize>(mut stream: &TcpStream, peer: &str, msg: &T) -> Result<(), RendezvousError> {
    let mut text = serde_json::to_string(msg).map_err(|e| RendezvousError::Protocol {
        peer: peer.to_string(),
        reason: e.to_string(),
    })?;
    text.push('\n');
    stream
        .write_all(text.as_bytes())
        .and_then(|_| stream.flush())
        .map_err(|e| io_err(peer, e))
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

/// A socket timeout must be non-zero.
fn socket_timeout(deadline: Instant) -> Duration {
    remaining(deadline).max(Duration::from_millis(1))
}

fn check_config(me: &NodeInfo, timeout: Duration) -> Result<(), RendezvousError> {
    if me.nodes == 0 || me.node_rank >= me.nodes {
        return Err(RendezvousError::Config(format!(
            "node rank {} outside 0..{}",
            me.node_rank, me.nodes
        )));
    }
    if me.local_gpus == 0 {
        return Err(RendezvousError::Config(
            "a node needs at least one GPU to join an NCCL rendezvous".to_string(),
        ));
    }
    if timeout.is_zero() {
        return Err(RendezvousError::Config(
            "the rendezvous timeout must be positive".to_string(),
        ));
    }
    Ok(())
}

/// Node 0's check of one hello against itself and the nodes already arrived.
fn validate(me: &NodeInfo, hello: &Hello, arrived: &[Option<Hello>]) -> Result<(), String> {
    if hello.protocol != PROTOCOL_VERSION {
        return Err(format!(
            "node {} speaks rendezvous protocol {} but node 0 speaks {}; run the same birdtrain version on every node",
            hello.node_rank, hello.protocol, PROTOCOL_VERSION
        ));
    }
    if hello.nodes != me.nodes {
        return Err(format!(
            "world size mismatch: node {} was started with {} nodes but node 0 with {}; pass the same --nodes (WORLD_SIZE) everywhere",
            hello.node_rank, hello.nodes, me.nodes
        ));
    }
    if hello.node_rank == 0 || hello.node_rank >= me.nodes {
        return Err(format!(
            "node rank {} is invalid for {} nodes: joining nodes take ranks 1..{}",
            hello.node_rank,
            me.nodes,
            me.nodes - 1
        ));
    }
    if arrived[hello.node_rank].is_some() {
        return Err(format!(
            "duplicate node rank {}: two nodes were started with --node-rank {}",
            hello.node_rank, hello.node_rank
        ));
    }
    if hello.gpus == 0 {
        return Err(format!("node {} has no GPU", hello.node_rank));
    }
    if hello.fingerprint != me.fingerprint {
        return Err(format!(
            "dataset fingerprint mismatch: node {} has {:016x} but node 0 has {:016x}; every node must see the same dataset (same files, same resize settings)",
            hello.node_rank, hello.fingerprint, me.fingerprint
        ));
    }
    if hello.model != me.model {
        return Err(format!(
            "model mismatch: node {} builds {:?} but node 0 builds {:?}; pass the same --model everywhere",
            hello.node_rank, hello.model, me.model
        ));
    }
    if hello.start != me.start {
        return Err(format!(
            "checkpoint mismatch: node {} starts from {} but node 0 from {}; only the weights are broadcast, so every node must resume the same checkpoint (hint: share the run folder between the nodes, or copy node 0's to the others, and pass the same --resume everywhere)",
            hello.node_rank, hello.start, me.start
        ));
    }
    Ok(())
}

/// Runs node 0's side on `listener`: waits for every other node until `timeout`, checks them,
/// creates the id with `make_id` and answers each node.
pub fn serve(
    listener: &TcpListener,
    me: &NodeInfo,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Assignment, RendezvousError> {
    check_config(me, timeout)?;
    if me.node_rank != 0 {
        return Err(RendezvousError::Config(format!(
            "only node 0 serves the rendezvous, not node {}",
            me.node_rank
        )));
    }
    let local = listener
        .local_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".to_string());
    let started = Instant::now();
    let deadline = started + timeout;
    listener
        .set_nonblocking(true)
        .map_err(|e| io_err(&local, e))?;

    let mut arrived: Vec<Option<Hello>> = vec![None; me.nodes];
    let mut streams: Vec<(TcpStream, String, usize)> = Vec::new();
    let fail_all = |streams: &[(TcpStream, String, usize)], reason: &str| {
        for (s, peer, _) in streams {
            // Best effort: the node may already be gone.
            let _ = send(
                s,
                peer,
                &Reply::Error {
                    reason: reason.to_string(),
                },
            );
        }
    };

    while streams.len() + 1 < me.nodes {
        let (stream, peer) = match listener.accept() {
            Ok((s, addr)) => (s, addr.to_string()),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    let err = RendezvousError::MissingNodes {
                        missing: (1..me.nodes).filter(|&r| arrived[r].is_none()).collect(),
                        arrived: (0..me.nodes)
                            .filter(|&r| r == 0 || arrived[r].is_some())
                            .collect(),
                        nodes: me.nodes,
                        waited: started.elapsed(),
                    };
                    fail_all(&streams, &err.to_string());
                    return Err(err);
                }
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(e) => {
                tracing::warn!("rendezvous accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let setup = stream
            .set_nonblocking(false)
            .and_then(|_| stream.set_read_timeout(Some(socket_timeout(deadline))))
            .and_then(|_| stream.set_write_timeout(Some(Duration::from_secs(5))));
        if let Err(e) = setup {
            tracing::warn!("rendezvous connection from {peer} unusable: {e}");
            continue;
        }
        let hello = read_message(&stream, &peer).and_then(|line| {
            serde_json::from_str::<Hello>(&line).map_err(|e| RendezvousError::Protocol {
                peer: peer.clone(),
                reason: format!("not a birdtrain hello: {e}"),
            })
        });
        let hello = match hello {
            Ok(h) => h,
            Err(e) => {
                // A stray connection (a port scan, a health check) must not kill the run.
                tracing::warn!("ignoring rendezvous connection: {e}");
                continue;
            }
        };
        if let Err(reason) = validate(me, &hello, &arrived) {
            let _ = send(
                &stream,
                &peer,
                &Reply::Error {
                    reason: reason.clone(),
                },
            );
            fail_all(&streams, &reason);
            return Err(RendezvousError::Rejected { reason });
        }
        tracing::info!("rendezvous: node {} arrived from {peer}", hello.node_rank);
        let rank = hello.node_rank;
        arrived[rank] = Some(hello);
        streams.push((stream, peer, rank));
    }

    let unique_id = match make_id() {
        Ok(id) => id,
        Err(reason) => {
            let err = RendezvousError::UniqueId { reason };
            fail_all(&streams, &err.to_string());
            return Err(err);
        }
    };
    let node_gpus: Vec<usize> = (0..me.nodes)
        .map(|r| {
            if r == 0 {
                me.local_gpus
            } else {
                arrived[r].as_ref().map_or(0, |h| h.gpus)
            }
        })
        .collect();
    let world_size = node_gpus.iter().sum();
    let offset_of = |rank: usize| node_gpus[..rank].iter().sum::<usize>();
    let id_hex = hex(&unique_id);
    for (stream, peer, rank) in &streams {
        let rank = *rank;
        send(
            stream,
            peer,
            &Reply::Welcome {
                rank_offset: offset_of(rank),
                world_size,
                node_gpus: node_gpus.clone(),
                unique_id: id_hex.clone(),
            },
        )?;
    }
    Ok(Assignment {
        rank_offset: 0,
        world_size,
        node_gpus,
        unique_id,
    })
}

/// Runs a joining node's side: connects to `master` (retrying until `timeout`), says hello and
/// waits for node 0's answer until the same deadline.
pub fn join(master: &str, me: &NodeInfo, timeout: Duration) -> Result<Assignment, RendezvousError> {
    check_config(me, timeout)?;
    if me.node_rank == 0 {
        return Err(RendezvousError::Config(
            "node 0 serves the rendezvous; it does not join".to_string(),
        ));
    }
    let started = Instant::now();
    let deadline = started + timeout;
    let mut last_error = String::from("no attempt made");
    let stream = loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(RendezvousError::MasterUnreachable {
                addr: master.to_string(),
                waited: started.elapsed(),
                last_error,
            });
        }
        // Resolve on every attempt: the master's name may only start resolving later.
        match master.to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                let attempt = remaining(deadline)
                    .min(Duration::from_secs(2))
                    .max(Duration::from_millis(1));
                let mut connected = None;
                for addr in &addrs {
                    match TcpStream::connect_timeout(addr, attempt) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
                if addrs.is_empty() {
                    last_error = "the name resolved to no address".to_string();
                }
                if let Some(s) = connected {
                    break s;
                }
            }
            Err(e) => last_error = format!("cannot resolve: {e}"),
        }
        std::thread::sleep(remaining(deadline).min(Duration::from_millis(100)));
    };

    let peer = master.to_string();
    stream
        .set_read_timeout(Some(socket_timeout(deadline)))
        .and_then(|_| stream.set_write_timeout(Some(socket_timeout(deadline))))
        .map_err(|e| io_err(&peer, e))?;
    send(
        &stream,
        &peer,
        &Hello {
            protocol: PROTOCOL_VERSION,
            node_rank: me.node_rank,
            nodes: me.nodes,
            gpus: me.local_gpus,
            fingerprint: me.fingerprint,
            model: me.model.clone(),
            start: me.start.clone(),
        },
    )?;
    let line = match read_message(&stream, &peer) {
        Ok(line) => line,
        Err(RendezvousError::MasterSilent { .. }) => {
            return Err(RendezvousError::MasterSilent {
                addr: peer,
                waited: started.elapsed(),
            });
        }
        Err(e) => return Err(e),
    };
    let reply: Reply = serde_json::from_str(&line).map_err(|e| RendezvousError::Protocol {
        peer: peer.clone(),
        reason: format!("not a birdtrain reply: {e}"),
    })?;
    match reply {
        Reply::Error { reason } => Err(RendezvousError::Rejected { reason }),
        Reply::Welcome {
            rank_offset,
            world_size,
            node_gpus,
            unique_id,
        } => {
            let unique_id = unhex(&unique_id).ok_or_else(|| RendezvousError::Protocol {
                peer: peer.clone(),
                reason: "unique id is not hexadecimal".to_string(),
            })?;
            let consistent = node_gpus.len() == me.nodes
                && node_gpus.get(me.node_rank) == Some(&me.local_gpus)
                && node_gpus.iter().sum::<usize>() == world_size
                && node_gpus[..me.node_rank].iter().sum::<usize>() == rank_offset;
            if !consistent {
                return Err(RendezvousError::Protocol {
                    peer,
                    reason: format!(
                        "inconsistent assignment (offset {rank_offset}, world {world_size}, per node {node_gpus:?})"
                    ),
                });
            }
            Ok(Assignment {
                rank_offset,
                world_size,
                node_gpus,
                unique_id,
            })
        }
    }
}

/// Binds node 0's listener for `master` (`host:port`) on every interface of that port, so the
/// address the other nodes use needs not match a local interface name.
pub fn bind(master: &str) -> Result<TcpListener, RendezvousError> {
    let port = master
        .rsplit_once(':')
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .ok_or_else(|| RendezvousError::Resolve {
            addr: master.to_string(),
            reason: "expected host:port".to_string(),
        })?;
    let v6 = master.starts_with('[');
    let any: SocketAddr = if v6 {
        SocketAddr::from(([0u16; 8], port))
    } else {
        SocketAddr::from(([0u8; 4], port))
    };
    TcpListener::bind(any).map_err(|e| RendezvousError::Bind {
        addr: any.to_string(),
        reason: e.to_string(),
    })
}

/// The whole rendezvous for this node: node 0 binds and serves, the others join; a single node
/// needs no network and just creates the id.
pub fn rendezvous(
    master: Option<&str>,
    me: &NodeInfo,
    timeout: Duration,
    make_id: impl FnOnce() -> Result<Vec<u8>, String>,
) -> Result<Assignment, RendezvousError> {
    check_config(me, timeout)?;
    if me.nodes == 1 {
        let unique_id = make_id().map_err(|reason| RendezvousError::UniqueId { reason })?;
        return Ok(Assignment {
            rank_offset: 0,
            world_size: me.local_gpus,
            node_gpus: vec![me.local_gpus],
            unique_id,
        });
    }
    let master = master.ok_or_else(|| {
        RendezvousError::Config("several nodes need a --master host:port".to_string())
    })?;
    if me.node_rank == 0 {
        let listener = bind(master)?;
        serve(&listener, me, timeout, make_id)
    } else {
        join(master, me, timeout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(30);

    fn node(node_rank: usize, start: StartPoint) -> NodeInfo {
        NodeInfo {
            nodes: 2,
            node_rank,
            local_gpus: 1,
            fingerprint: 7,
            model: "resnet50".into(),
            start,
        }
    }

    fn resumed(step: u64, weights: &str) -> StartPoint {
        StartPoint::Checkpoint {
            step,
            weights: weights.into(),
        }
    }

    /// Node 0 serves on loopback while node 1 joins from a thread.
    fn meet(
        first: StartPoint,
        second: StartPoint,
    ) -> (
        Result<Assignment, RendezvousError>,
        Result<Assignment, RendezvousError>,
    ) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let joiner = std::thread::spawn(move || join(&addr, &node(1, second), TIMEOUT));
        let served = serve(&listener, &node(0, first), TIMEOUT, || Ok(vec![1; 128]));
        (served, joiner.join().unwrap())
    }

    #[test]
    fn nodes_starting_from_the_same_point_meet() {
        for start in [StartPoint::Fresh, resumed(120, "00aa11bb22cc33dd")] {
            let (served, joined) = meet(start.clone(), start.clone());
            assert_eq!(served.unwrap().world_size, 2, "{start}");
            assert_eq!(joined.unwrap().rank_offset, 1, "{start}");
        }
    }

    #[test]
    fn a_node_resuming_another_checkpoint_is_refused_on_both_sides_naming_both_values() {
        let cases = [
            // Another step (an older copy of the run folder).
            (
                resumed(120, "aaaa"),
                resumed(80, "bbbb"),
                ["step 120", "step 80"],
            ),
            // The same step, other weights (another run's folder).
            (resumed(120, "aaaa"), resumed(120, "cccc"), ["aaaa", "cccc"]),
            // One node resumes, the other starts afresh (its --resume folder missing).
            (
                resumed(120, "aaaa"),
                StartPoint::Fresh,
                ["step 120", "fresh start"],
            ),
            (
                StartPoint::Fresh,
                resumed(40, "dddd"),
                ["fresh start", "step 40"],
            ),
        ];
        for (first, second, named) in cases {
            let (served, joined) = meet(first.clone(), second.clone());
            let reason = match served.unwrap_err() {
                RendezvousError::Rejected { reason } => reason,
                other => panic!("{first} vs {second}: {other}"),
            };
            // Which node has which, in one line, with the way out.
            let node_1 = format!("node 1 starts from {second}");
            let node_0 = format!("node 0 from {first}");
            assert!(
                reason.contains(&node_1) && reason.contains(&node_0),
                "{reason}"
            );
            for value in named {
                assert!(reason.contains(value), "{value}: {reason}");
            }
            assert!(
                reason.contains("share the run folder") && reason.contains("copy"),
                "{reason}"
            );
            assert!(!reason.contains('\n'), "{reason}");
            match joined.unwrap_err() {
                RendezvousError::Rejected { reason: theirs } => assert_eq!(theirs, reason),
                other => panic!("node 1: {other}"),
            }
        }
    }

    #[test]
    fn a_hello_of_the_previous_protocol_is_refused_by_version_not_ignored() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let old = std::thread::spawn(move || {
            let stream = TcpStream::connect(&addr).unwrap();
            stream.set_read_timeout(Some(TIMEOUT)).unwrap();
            // Version 1 had no checkpoint identity.
            let hello = r#"{"protocol":1,"node_rank":1,"nodes":2,"gpus":1,"fingerprint":7,"model":"resnet50"}"#;
            (&stream)
                .write_all(format!("{hello}\n").as_bytes())
                .unwrap();
            read_message(&stream, "node 0").unwrap()
        });
        let e = serve(&listener, &node(0, StartPoint::Fresh), TIMEOUT, || {
            Ok(vec![1; 128])
        })
        .unwrap_err();
        assert!(e.to_string().contains("protocol 1"), "{e}");
        let reply: Reply = serde_json::from_str(&old.join().unwrap()).unwrap();
        assert!(
            matches!(&reply, Reply::Error { reason } if reason.contains("protocol 1")),
            "{reply:?}"
        );
    }

    #[test]
    fn hex_round_trips_and_rejects_garbage() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert!(unhex("abc").is_none());
        assert!(unhex("zz").is_none());
    }
}
