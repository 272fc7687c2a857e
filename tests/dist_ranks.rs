//! Checks of the per-GPU thread launcher that need no GPU (they fail before any CUDA call).

use birdtrain::dist::launch::LaunchPlan;
use birdtrain::dist::ranks::{run_local_ranks, RanksError};
use birdtrain::dist::rendezvous::Assignment;

const T: std::time::Duration = std::time::Duration::from_secs(5);

fn plan(devices: Vec<usize>) -> LaunchPlan {
    LaunchPlan {
        nodes: 2,
        node_rank: 1,
        ..LaunchPlan::single_node(devices)
    }
}

fn assignment(node_gpus: Vec<usize>) -> Assignment {
    Assignment {
        rank_offset: node_gpus[0],
        world_size: node_gpus.iter().sum(),
        node_gpus,
        unique_id: vec![0; 128],
    }
}

#[test]
fn a_cpu_plan_has_no_driver_threads() {
    let err = run_local_ranks(&plan(vec![]), &assignment(vec![1, 1]), T, |_| Ok(())).unwrap_err();
    assert!(matches!(err, RanksError::NoDevices), "{err}");
}

#[test]
fn the_rendezvous_and_the_plan_must_agree_on_this_nodes_gpus() {
    let err =
        run_local_ranks(&plan(vec![0, 1]), &assignment(vec![2, 3]), T, |_| Ok(())).unwrap_err();
    assert!(
        matches!(
            err,
            RanksError::Mismatch {
                assigned: 3,
                local: 2
            }
        ),
        "{err}"
    );
}
