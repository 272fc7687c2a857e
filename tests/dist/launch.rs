//! Launch configuration: flags, launcher variables and the device list (the rules of each
//! launcher are unit tests in `src/dist/launch.rs`).

use std::collections::HashMap;

use birdtrain::dist::launch::{
    resolve, Device, GpuCount, LaunchError, LaunchFlags, LaunchPlan, MasterAddr, VisibleGpus,
};

fn devices(n: usize) -> VisibleGpus {
    VisibleGpus::Listed(
        (0..n)
            .map(|ordinal| Device {
                ordinal,
                name: format!("Fake GPU {ordinal}"),
            })
            .collect(),
    )
}

fn run(flags: LaunchFlags, env: &[(&str, &str)], n: usize) -> Result<LaunchPlan, LaunchError> {
    let env: HashMap<String, String> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    resolve(&flags, &|k| env.get(k).cloned(), &devices(n))
}

fn gpus(g: &str) -> LaunchFlags {
    LaunchFlags {
        gpus: Some(g.parse().unwrap()),
        ..LaunchFlags::default()
    }
}

#[test]
fn gpus_flag_parses_counts_and_all() {
    assert_eq!("4".parse::<GpuCount>().unwrap(), GpuCount::Count(4));
    assert_eq!("ALL".parse::<GpuCount>().unwrap(), GpuCount::All);
    let err = "four".parse::<GpuCount>().unwrap_err();
    assert!(err.to_string().contains("four"), "{err}");
}

#[test]
fn single_node_defaults() {
    // No flag: every GPU, as `--help` says.
    let plan = run(LaunchFlags::default(), &[], 4).unwrap();
    assert_eq!(plan.devices, vec![0, 1, 2, 3]);
    assert_eq!((plan.nodes, plan.node_rank), (1, 0));
    assert!(!plan.is_multi_node() && plan.is_master());
    // No GPU and no flag: the CPU.
    assert!(run(LaunchFlags::default(), &[], 0)
        .unwrap()
        .devices
        .is_empty());
    assert_eq!(run(gpus("all"), &[], 3).unwrap().devices, vec![0, 1, 2]);
    assert_eq!(run(gpus("2"), &[], 3).unwrap().devices, vec![0, 1]);
    assert!(run(gpus("0"), &[], 3).unwrap().devices.is_empty());
}

#[test]
fn too_many_gpus_lists_the_devices() {
    let err = run(gpus("8"), &[], 2).unwrap_err();
    let text = err.to_string();
    assert!(matches!(
        err,
        LaunchError::TooManyGpus {
            requested: 8,
            present: 2,
            ..
        }
    ));
    assert!(
        text.contains("0: Fake GPU 0") && text.contains("1: Fake GPU 1"),
        "{text}"
    );
    let err = run(gpus("all"), &[], 0).unwrap_err();
    assert!(matches!(err, LaunchError::NoDevices { .. }), "{err}");
    assert!(err.to_string().contains("--gpus 0"), "hint missing: {err}");
}

#[test]
fn launch_environment_is_used() {
    let env = [
        ("WORLD_SIZE", "4"),
        ("RANK", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
        ("LOCAL_RANK", "1"),
    ];
    let plan = run(LaunchFlags::default(), &env, 2).unwrap();
    assert_eq!((plan.nodes, plan.node_rank), (4, 2));
    assert_eq!(plan.devices, vec![1], "LOCAL_RANK picks the GPU");
    // Without torchrun's own variables nothing holds MASTER_PORT: the rendezvous takes it.
    assert_eq!(
        plan.rendezvous_addr().unwrap().to_string(),
        "10.1.2.3:29500"
    );
    assert!(plan.overrides.is_empty());
}

#[test]
fn flags_win_over_environment_and_say_so() {
    let env = [
        ("WORLD_SIZE", "4"),
        ("RANK", "2"),
        ("MASTER_ADDR", "10.1.2.3"),
        ("MASTER_PORT", "29500"),
    ];
    let flags = LaunchFlags {
        gpus: Some(GpuCount::All),
        nodes: Some(2),
        node_rank: Some(1),
        master: Some("head:1234".to_string()),
    };
    let plan = run(flags, &env, 2).unwrap();
    assert_eq!((plan.nodes, plan.node_rank), (2, 1));
    assert_eq!(
        plan.master,
        Some(MasterAddr {
            host: "head".into(),
            port: 1234
        })
    );
    assert_eq!(plan.overrides.len(), 3, "{:?}", plan.overrides);
    assert!(plan.overrides[0].contains("--nodes 2 overrides WORLD_SIZE=4"));
}

#[test]
fn conflicts_are_clear_errors() {
    let two_nodes = LaunchFlags {
        nodes: Some(2),
        ..LaunchFlags::default()
    };
    assert!(matches!(
        run(
            two_nodes.clone(),
            &[("MASTER_ADDR", "h"), ("MASTER_PORT", "1")],
            1
        ),
        Err(LaunchError::MissingNodeRank { nodes: 2 })
    ));
    assert!(matches!(
        run(two_nodes.clone(), &[("RANK", "1")], 1),
        Err(LaunchError::MissingMaster { nodes: 2, .. })
    ));
    assert!(matches!(
        run(
            two_nodes,
            &[("RANK", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")],
            1
        ),
        Err(LaunchError::NodeRankOutOfRange {
            node_rank: 2,
            nodes: 2,
            source_name: "RANK",
            ..
        })
    ));
    assert!(matches!(
        run(LaunchFlags::default(), &[("MASTER_ADDR", "h")], 1),
        Err(LaunchError::PartialMasterEnv {
            set: "MASTER_ADDR",
            ..
        })
    ));
    assert!(matches!(
        run(gpus("2"), &[("LOCAL_RANK", "0")], 2),
        Err(LaunchError::LocalGpuConflict {
            var: "LOCAL_RANK",
            index: 0,
            ..
        })
    ));
    assert!(matches!(
        run(LaunchFlags::default(), &[("LOCAL_RANK", "3")], 2),
        Err(LaunchError::LocalGpuMissing {
            var: "LOCAL_RANK",
            index: 3,
            ..
        })
    ));
    assert!(matches!(
        run(LaunchFlags::default(), &[("WORLD_SIZE", "two")], 1),
        Err(LaunchError::InvalidEnv {
            var: "WORLD_SIZE",
            ..
        })
    ));
    assert!(matches!(
        run(
            LaunchFlags {
                nodes: Some(0),
                ..LaunchFlags::default()
            },
            &[],
            1
        ),
        Err(LaunchError::ZeroNodes {
            source_name: "--nodes"
        })
    ));
    let cpu_multi = LaunchFlags {
        gpus: Some(GpuCount::Count(0)),
        nodes: Some(2),
        node_rank: Some(0),
        master: Some("h:1".into()),
    };
    assert!(matches!(
        run(cpu_multi, &[], 1),
        Err(LaunchError::CpuMultiNode { nodes: 2 })
    ));
}

#[test]
fn master_addresses_parse() {
    let v6 = MasterAddr::parse("[::1]:29500", "--master").unwrap();
    assert_eq!((v6.host.as_str(), v6.port), ("::1", 29500));
    assert_eq!(v6.to_string(), "[::1]:29500");
    for bad in ["host", "host:", ":80", "host:99999", "host:0"] {
        let err = MasterAddr::parse(bad, "--master").unwrap_err();
        assert!(err.to_string().contains("host:port"), "{bad}: {err}");
    }
}

#[test]
fn dist_flags_parse_with_defaults_and_feed_the_launch_plan() {
    use birdtrain::cli::train_args::DistArgs;
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        dist: DistArgs,
    }
    let d = Cli::parse_from(["t"]).dist.to_settings();
    assert_eq!((d.bucket_mb, d.prefetch_depth), (25.0, 2));
    assert_eq!(d.bucket_settings().target_bytes, 25 << 20);
    assert!(d.trace.is_none());
    let d = Cli::parse_from([
        "t",
        "--nodes",
        "2",
        "--node-rank",
        "1",
        "--master",
        "10.0.0.1:29500",
        "--bucket-mb",
        "8",
        "--prefetch-depth",
        "3",
        "--trace",
        "t.json",
    ])
    .dist
    .to_settings();
    let flags = d.launch_flags(Some("all")).unwrap();
    assert_eq!(flags.gpus, Some(GpuCount::All));
    let plan = resolve(&flags, &|_| None, &devices(2)).unwrap();
    assert_eq!((plan.nodes, plan.node_rank, plan.devices.len()), (2, 1, 2));
    assert!(d.launch_flags(Some("many")).is_err());
}
