//! The TCP rendezvous on loopback: nodes as threads exchange the id; mismatches and missing
//! nodes fail with clear errors on both sides. Every wait is bounded by a short timeout.

use std::net::TcpListener;
use std::thread;
use std::time::Duration;

use birdtrain::dist::rendezvous::{
    join, rendezvous, serve, Assignment, NodeInfo, RendezvousError, StartPoint,
};

// Generous: only a failing test waits this long, and the machine may be busy.
const TIMEOUT: Duration = Duration::from_secs(30);

fn node(nodes: usize, node_rank: usize, gpus: usize) -> NodeInfo {
    NodeInfo {
        nodes,
        node_rank,
        local_gpus: gpus,
        fingerprint: 0xfeed_beef,
        model: "resnet18".to_string(),
        start: StartPoint::Fresh,
    }
}

fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

type Outcome = Result<Assignment, RendezvousError>;

/// Runs node 0 on a thread and each of `others` on its own thread; returns (server, clients).
fn run(
    me: NodeInfo,
    others: Vec<NodeInfo>,
    server_timeout: Duration,
    client_timeout: Duration,
) -> (Outcome, Vec<Outcome>) {
    let (l, addr) = listener();
    let server = thread::spawn(move || serve(&l, &me, server_timeout, || Ok((0u8..128).collect())));
    let clients: Vec<_> = others
        .into_iter()
        .map(|info| {
            let addr = addr.clone();
            thread::spawn(move || join(&addr, &info, client_timeout))
        })
        .collect();
    let clients = clients.into_iter().map(|c| c.join().unwrap()).collect();
    (server.join().unwrap(), clients)
}

#[test]
fn four_nodes_exchange_the_id_and_rank_offsets() {
    let (server, clients) = run(
        node(4, 0, 2),
        vec![node(4, 3, 1), node(4, 1, 4), node(4, 2, 2)],
        TIMEOUT,
        TIMEOUT,
    );
    let server = server.unwrap();
    let id: Vec<u8> = (0u8..128).collect();
    assert_eq!(server.unique_id, id);
    assert_eq!(server.world_size, 9);
    assert_eq!(server.node_gpus, vec![2, 4, 2, 1]);
    assert_eq!(server.rank_offset, 0);
    let offsets: Vec<usize> = clients
        .iter()
        .map(|c| c.as_ref().unwrap().rank_offset)
        .collect();
    // Clients were listed as node ranks 3, 1, 2.
    assert_eq!(offsets, vec![8, 2, 6]);
    for c in &clients {
        let c = c.as_ref().unwrap();
        assert_eq!(c.unique_id, id);
        assert_eq!(c.world_size, 9);
        assert_eq!(c.node_gpus, vec![2, 4, 2, 1]);
    }
}

#[test]
fn joining_before_the_master_listens_retries() {
    // Reserve a port, release it, start the client first, then the server on that port.
    let (l, addr) = listener();
    drop(l);
    let client_addr = addr.clone();
    let client = thread::spawn(move || join(&client_addr, &node(2, 1, 1), TIMEOUT));
    thread::sleep(Duration::from_millis(300));
    let l = TcpListener::bind(&addr).unwrap();
    let server = serve(&l, &node(2, 0, 1), TIMEOUT, || Ok(vec![7; 128])).unwrap();
    let client = client.join().unwrap().unwrap();
    assert_eq!(client.unique_id, vec![7; 128]);
    assert_eq!((server.world_size, client.rank_offset), (2, 1));
}

#[test]
fn a_missing_node_times_out_naming_it() {
    let (server, clients) = run(
        node(4, 0, 1),
        vec![node(4, 1, 1), node(4, 3, 1)],
        Duration::from_secs(2),
        TIMEOUT,
    );
    let err = server.unwrap_err();
    match &err {
        RendezvousError::MissingNodes {
            missing, arrived, ..
        } => {
            assert_eq!(missing, &vec![2]);
            assert_eq!(arrived, &vec![0, 1, 3]);
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("[2]"), "{err}");
    // The nodes that did arrive hear why.
    for c in clients {
        let e = c.unwrap_err();
        assert!(
            matches!(&e, RendezvousError::Rejected { reason } if reason.contains("never arrived")),
            "{e}"
        );
    }
}

#[test]
fn an_absent_master_is_a_clear_error_after_the_timeout() {
    let (l, addr) = listener();
    drop(l);
    let err = join(&addr, &node(2, 1, 1), Duration::from_millis(400)).unwrap_err();
    assert!(
        matches!(&err, RendezvousError::MasterUnreachable { .. }),
        "{err}"
    );
    assert!(err.to_string().contains(&addr), "{err}");
}

#[test]
fn a_silent_master_times_out() {
    // Something listens but never answers (node 0 waiting for other nodes, or a wrong port).
    let (l, addr) = listener();
    let err = join(&addr, &node(2, 1, 1), Duration::from_millis(400)).unwrap_err();
    drop(l);
    assert!(matches!(err, RendezvousError::MasterSilent { .. }), "{err}");
}

fn assert_rejected(server: Outcome, clients: Vec<Outcome>, needle: &str) {
    let s = server.unwrap_err();
    assert!(s.to_string().contains(needle), "server: {s}");
    assert!(
        clients.iter().any(
            |c| matches!(c, Err(RendezvousError::Rejected { reason }) if reason.contains(needle))
        ),
        "no client heard {needle:?}: {clients:?}"
    );
}

#[test]
fn world_size_mismatch_is_caught_on_both_sides() {
    let (server, clients) = run(node(2, 0, 1), vec![node(3, 1, 1)], TIMEOUT, TIMEOUT);
    assert_rejected(server, clients, "world size mismatch");
}

#[test]
fn fingerprint_mismatch_is_caught() {
    let mut other = node(2, 1, 1);
    other.fingerprint = 1;
    let (server, clients) = run(node(2, 0, 1), vec![other], TIMEOUT, TIMEOUT);
    assert_rejected(server, clients, "dataset fingerprint mismatch");
}

#[test]
fn model_mismatch_is_caught() {
    let mut other = node(2, 1, 1);
    other.model = "resnet50".into();
    let (server, clients) = run(node(2, 0, 1), vec![other], TIMEOUT, TIMEOUT);
    assert_rejected(server, clients, "model mismatch");
}

#[test]
fn duplicate_node_rank_is_caught() {
    let (server, clients) = run(
        node(3, 0, 1),
        vec![node(3, 1, 1), node(3, 1, 1)],
        TIMEOUT,
        TIMEOUT,
    );
    assert_rejected(server, clients, "duplicate node rank 1");
}

#[test]
fn unique_id_failure_reaches_every_node() {
    let (l, addr) = listener();
    let server = thread::spawn(move || {
        serve(&l, &node(2, 0, 1), TIMEOUT, || {
            Err("libnccl.so.2 not found".to_string())
        })
    });
    let client = join(&addr, &node(2, 1, 1), TIMEOUT).unwrap_err();
    assert!(
        client.to_string().contains("libnccl.so.2 not found"),
        "{client}"
    );
    assert!(matches!(
        server.join().unwrap(),
        Err(RendezvousError::UniqueId { .. })
    ));
}

#[test]
fn stray_connections_do_not_break_the_rendezvous() {
    use std::io::Write;
    let (l, addr) = listener();
    let server = thread::spawn(move || serve(&l, &node(2, 0, 1), TIMEOUT, || Ok(vec![1; 128])));
    {
        let mut stray = std::net::TcpStream::connect(&addr).unwrap();
        stray.write_all(b"GET / HTTP/1.0\r\n\r\n").unwrap();
    }
    let client = join(&addr, &node(2, 1, 3), TIMEOUT).unwrap();
    assert_eq!(client.world_size, 4);
    assert_eq!(server.join().unwrap().unwrap().node_gpus, vec![1, 3]);
}

#[test]
fn a_single_node_needs_no_network() {
    let a = rendezvous(None, &node(1, 0, 4), TIMEOUT, || Ok(vec![9; 128])).unwrap();
    assert_eq!((a.world_size, a.rank_offset), (4, 0));
    assert_eq!(a.unique_id, vec![9; 128]);
}

const CHILD_ENV: &str = "BIRDTRAIN_RENDEZVOUS_CHILD";

#[test]
fn separate_processes_exchange_the_id_over_loopback() {
    use std::process::{Command, Stdio};
    let (l, addr) = listener();
    let exe = std::env::current_exe().unwrap();
    let children: Vec<_> = [1usize, 2]
        .iter()
        .map(|rank| {
            Command::new(&exe)
                .args([
                    "--exact",
                    "rendezvous::rendezvous_child_process",
                    "--ignored",
                    "--nocapture",
                ])
                .env(CHILD_ENV, format!("{addr} {rank}"))
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let id: Vec<u8> = (100u8..228).collect();
    let served = serve(&l, &node(3, 0, 2), TIMEOUT, || Ok(id.clone()));
    let outputs: Vec<String> = children
        .into_iter()
        .map(|c| {
            let out = c.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string();
            assert!(
                out.status.success(),
                "child failed: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            text
        })
        .collect();
    let served = served.unwrap();
    assert_eq!(served.node_gpus, vec![2, 1, 2]);
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    assert!(
        outputs[0].contains(&format!("offset=2 world=5 id={hex}")),
        "{}",
        outputs[0]
    );
    assert!(
        outputs[1].contains(&format!("offset=3 world=5 id={hex}")),
        "{}",
        outputs[1]
    );
}

/// The joining node of `separate_processes_exchange_the_id_over_loopback`, run as a child
/// process (ignored when run directly).
#[test]
#[ignore = "helper process of separate_processes_exchange_the_id_over_loopback"]
fn rendezvous_child_process() {
    // Run directly (`--ignored` over the whole suite) there is no parent to talk to.
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        eprintln!("helper only: nothing to do without a parent test");
        return;
    };
    let (addr, rank) = spec.split_once(' ').unwrap();
    let rank: usize = rank.parse().unwrap();
    let a = join(addr, &node(3, rank, rank), TIMEOUT).unwrap();
    let hex: String = a.unique_id.iter().map(|b| format!("{b:02x}")).collect();
    println!("offset={} world={} id={hex}", a.rank_offset, a.world_size);
}
