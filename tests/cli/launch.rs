//! The launchers cluster users already use, through the binary: the environment a torchrun
//! worker, an `srun` task of docs/gpus.md's sbatch script and a PyTorchJob pod see goes in,
//! `--dry-run --json` comes out (the "Clusters" commands of docs/gpus.md are these); and a torchrun
//! worker restarted after a failure resumes its run instead of refusing the folder.

use crate::cli_support;

use std::process::{Command, Output};

use birdtrain::train::CheckpointMeta;
use cli_support::small_run::{dataset, ok, text, train_args};
use cli_support::{assert_no_panic, assert_one_line_error, s};
use serde_json::{json, Value};

/// The binary with only `env` in its environment (none of the test's own launcher variables).
fn birdtrain(args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_birdtrain"))
        .args(args)
        .env_clear()
        .envs(env.iter().copied())
        .output()
        .expect("the birdtrain binary runs");
    assert_no_panic(args, &out);
    out
}

/// The one line of `--dry-run --json`, parsed; it must have exactly the documented fields.
fn dry_json(args: &[&str], env: &[(&str, &str)]) -> Value {
    let mut all = args.to_vec();
    all.extend(["--dry-run", "--json"]);
    let out = birdtrain(&all, env);
    assert!(out.status.success(), "{}", text(&out));
    let stdout = String::from_utf8(out.stdout).unwrap();
    let lines: Vec<&str> = stdout.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {stdout}");
    let v: Value = serde_json::from_str(lines[0]).unwrap();
    let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "devices",
            "global_batch",
            "launcher",
            "local_ranks",
            "lr",
            "master",
            "node_rank",
            "nodes",
            "rendezvous_port",
            "resume",
            "workers"
        ]
    );
    v
}

fn cores() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get()) as u64
}

/// The training flags of docs/gpus.md's examples; the data folder is on the cluster, not here.
const FLAGS: [&str; 6] = [
    "--data",
    "/shared/285birds",
    "--out",
    "/shared/runs/birds",
    "--batch-size",
    "64",
];

/// What torchrun gives worker 5 of `torchrun --nnodes 2 --nproc-per-node 4 --node-rank 1
/// --master-addr head --master-port 29500 --no-python birdtrain …` (docs/gpus.md's command).
fn torchrun_worker(restart: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("TORCHELASTIC_RUN_ID", "none"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", restart),
        ("TORCHELASTIC_MAX_RESTARTS", "3"),
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        ("OMP_NUM_THREADS", "1"),
        ("WORLD_SIZE", "8"),
        ("RANK", "5"),
        ("GROUP_RANK", "1"),
        ("ROLE_RANK", "5"),
        ("ROLE_WORLD_SIZE", "8"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "4"),
        ("MASTER_ADDR", "head"),
        ("MASTER_PORT", "29500"),
    ]
}

#[test]
fn a_torchrun_worker_drives_its_gpu_and_meets_above_torchruns_port() {
    let v = dry_json(&FLAGS, &torchrun_worker("0"));
    let workers = (cores() / 4).max(1);
    assert_eq!(
        v,
        json!({
            "nodes": 8, "node_rank": 5, "master": "head:29500", "rendezvous_port": 29501,
            "local_ranks": 1, "devices": [1], "global_batch": 512, "lr": 1.6,
            "workers": workers, "launcher": "torchrun", "resume": false
        })
    );
    // --master names the rendezvous itself; --workers wins over the shared default.
    let mut flags = FLAGS.to_vec();
    flags.extend(["--master", "head:7000", "--workers", "3"]);
    let v = dry_json(&flags, &torchrun_worker("0"));
    assert_eq!(
        (v["rendezvous_port"].clone(), v["workers"].clone()),
        (json!(7000), json!(3))
    );
    // --gpus 4 in a one-process-per-GPU launch names the flag the user gave.
    let mut flags = FLAGS.to_vec();
    flags.extend(["--gpus", "4", "--dry-run"]);
    let out = birdtrain(&flags, &torchrun_worker("0"));
    assert_one_line_error(&out, &["LOCAL_RANK=1", "--gpus 4", "torchrun"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn one_device_per_worker_is_the_workers_gpu() {
    let mut env = torchrun_worker("0");
    env.retain(|(k, _)| *k != "LOCAL_RANK");
    env.extend([("LOCAL_RANK", "3"), ("CUDA_VISIBLE_DEVICES", "3")]);
    assert_eq!(dry_json(&FLAGS, &env)["devices"], json!([0]));
    env.retain(|(k, _)| *k != "CUDA_VISIBLE_DEVICES");
    assert_eq!(dry_json(&FLAGS, &env)["devices"], json!([3]));
}

/// What `srun` gives the task on the second machine of docs/gpus.md's sbatch script
/// (`--nodes 2 --ntasks-per-node 1 --gpus-per-node 4`).
fn srun_task() -> Vec<(&'static str, &'static str)> {
    vec![
        ("SLURM_JOB_ID", "4242"),
        ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ("SLURM_STEP_NODELIST", "gpu[07-08]"),
        ("SLURM_JOB_NUM_NODES", "2"),
        ("SLURM_NNODES", "2"),
        ("SLURM_NTASKS", "2"),
        ("SLURM_NTASKS_PER_NODE", "1"),
        ("SLURM_PROCID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_LOCALID", "0"),
        ("SLURM_CPUS_PER_TASK", "32"),
        ("SLURM_GPUS_ON_NODE", "4"),
        ("CUDA_VISIBLE_DEVICES", "0,1,2,3"),
    ]
}

#[test]
fn an_srun_task_per_machine_drives_every_gpu_slurm_gave_it() {
    let v = dry_json(&FLAGS, &srun_task());
    assert_eq!(
        v,
        json!({
            "nodes": 2, "node_rank": 1, "master": "gpu07:29500", "rendezvous_port": 29500,
            "local_ranks": 4, "devices": [0, 1, 2, 3], "global_batch": 512, "lr": 1.6,
            "workers": cores(), "launcher": "slurm", "resume": false
        })
    );
    // One task per GPU (--ntasks-per-node 4 --gpus-per-task 1): each its own.
    let mut env: Vec<_> = srun_task()
        .into_iter()
        .filter(|(k, _)| {
            ![
                "SLURM_NTASKS",
                "SLURM_PROCID",
                "SLURM_LOCALID",
                "CUDA_VISIBLE_DEVICES",
            ]
            .contains(k)
        })
        .collect();
    env.extend([
        ("SLURM_NTASKS", "8"),
        ("SLURM_PROCID", "6"),
        ("SLURM_LOCALID", "2"),
    ]);
    let v = dry_json(&FLAGS, &env);
    assert_eq!(
        (
            v["nodes"].clone(),
            v["node_rank"].clone(),
            v["devices"].clone()
        ),
        (json!(8), json!(6), json!([2]))
    );
    env.push(("CUDA_VISIBLE_DEVICES", "0,1"));
    let out = birdtrain(&[FLAGS.as_slice(), &["--dry-run"]].concat(), &env);
    assert_one_line_error(&out, &["SLURM_LOCALID=2", "2 GPU(s) visible", "hint"]);
    // torchrun inside the job: torchrun's variables win.
    let mut both = srun_task();
    both.retain(|(k, _)| *k != "CUDA_VISIBLE_DEVICES");
    both.extend(torchrun_worker("0"));
    assert_eq!(dry_json(&FLAGS, &both)["launcher"], "torchrun");
}

#[test]
fn a_pytorchjob_pod_drives_its_gpus() {
    // The training operator sets these in every pod of a PyTorchJob (no LOCAL_RANK).
    let pod = [
        ("WORLD_SIZE", "2"),
        ("RANK", "1"),
        ("MASTER_ADDR", "birds-master-0"),
        ("MASTER_PORT", "23456"),
        ("PYTHONUNBUFFERED", "1"),
    ];
    // The command of docs/gpus.md's manifest.
    let flags = [
        "--data",
        "/data/285birds",
        "--out",
        "/runs/birds",
        "--gpus",
        "8",
        "--cache-dir",
        "/cache",
        "--rendezvous-timeout",
        "900",
        "--batch-size",
        "64",
    ];
    let v = dry_json(&flags, &pod);
    assert_eq!(
        v,
        json!({
            "nodes": 2, "node_rank": 1, "master": "birds-master-0:23456",
            "rendezvous_port": 23456, "local_ranks": 8, "devices": [0, 1, 2, 3, 4, 5, 6, 7],
            "global_batch": 1024, "lr": 3.2, "workers": cores(), "launcher": "env",
            "resume": false
        })
    );
}

#[test]
fn a_dry_run_reads_no_data_and_writes_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("run");
    // No data folder, no GPU driver here: a real run would refuse both.
    let v = dry_json(
        &[
            "--data",
            s(&tmp.path().join("absent")),
            "--out",
            s(&out),
            "--gpus",
            "2",
            "--replicas",
            "3",
        ],
        &[],
    );
    assert_eq!(
        v,
        json!({
            "nodes": 1, "node_rank": 0, "master": null, "rendezvous_port": null,
            "local_ranks": 2, "devices": [0, 1], "global_batch": 64, "lr": 0.2,
            "workers": cores(), "launcher": "flags", "resume": false
        })
    );
    assert!(!out.exists(), "no run folder");
    // The CPU: its replicas make the batch; auto batches are measured by the run alone.
    let v = dry_json(
        &[
            "--data",
            "d",
            "--gpus",
            "0",
            "--replicas",
            "3",
            "--lr",
            "0.1",
        ],
        &[],
    );
    assert_eq!(
        (v["devices"].clone(), v["global_batch"].clone()),
        (json!([]), json!(96))
    );
    let v = dry_json(&["--data", "d", "--gpus", "1", "--batch-size", "auto"], &[]);
    assert_eq!(
        (v["global_batch"].clone(), v["lr"].clone()),
        (Value::Null, Value::Null)
    );
    // …where the run can measure it: one process, on GPUs.
    let mut auto = FLAGS[..4].to_vec();
    auto.extend(["--batch-size", "auto", "--dry-run"]);
    let out = birdtrain(&auto, &torchrun_worker("0"));
    assert_one_line_error(&out, &["--batch-size", "each of the 8 processes"]);
    let out = birdtrain(
        &[
            "--data",
            "d",
            "--gpus",
            "0",
            "--batch-size",
            "auto",
            "--dry-run",
        ],
        &[],
    );
    assert_one_line_error(&out, &["--batch-size", "on the CPU"]);
    // Without the driver, "every GPU" has no count unless CUDA_VISIBLE_DEVICES says it.
    let out = birdtrain(&["--data", "d", "--gpus", "all", "--dry-run"], &[]);
    assert_one_line_error(&out, &["--gpus all", "CUDA_VISIBLE_DEVICES"]);
    let v = dry_json(
        &["--data", "d", "--gpus", "all"],
        &[("CUDA_VISIBLE_DEVICES", "4,5,6")],
    );
    assert_eq!(v["devices"], json!([0, 1, 2]));
    // The text report says the same.
    let out = birdtrain(&["--data", "d", "--gpus", "2", "--dry-run"], &[]);
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(
        stdout.contains("devices          [0, 1]") && stdout.contains("global batch     64"),
        "{stdout}"
    );
}

#[test]
fn a_dry_run_never_loads_the_gpu_driver() {
    // glibc's loader names every library it looks for under LD_DEBUG=libs: a run asks for
    // libcuda (found or not) before anything else, a dry run never does.
    let debug = [("LD_DEBUG", "libs")];
    let run = birdtrain(&["--data", "absent", "--gpus", "2"], &debug);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.contains("libcuda"),
        "the loader's trace shows no probe:\n{stderr}"
    );
    let dry = birdtrain(
        &["--data", "absent", "--gpus", "2", "--dry-run", "--json"],
        &debug,
    );
    assert!(dry.status.success(), "{}", text(&dry));
    let stderr = String::from_utf8_lossy(&dry.stderr);
    assert!(!stderr.contains("libcuda"), "{stderr}");
}

#[test]
fn json_without_dry_run_and_dry_run_outside_training_are_refused() {
    let out = birdtrain(&["--data", "d", "--json"], &[]);
    assert_one_line_error(&out, &["--dry-run"]);
    assert_eq!(out.status.code(), Some(2));
    let out = birdtrain(&["lr-find", "--data", "d", "--dry-run"], &[]);
    assert_one_line_error(&out, &["--dry-run", "training command"]);
    assert_eq!(out.status.code(), Some(2));
}

/// A CPU worker of `torchrun --nproc-per-node 1 --max-restarts 1`, at attempt `restart`.
fn cpu_worker(restart: &'static str) -> Vec<(&'static str, &'static str)> {
    vec![
        ("TORCHELASTIC_RUN_ID", "birds"),
        ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ("TORCHELASTIC_RESTART_COUNT", restart),
        ("TORCHELASTIC_MAX_RESTARTS", "1"),
        ("WORLD_SIZE", "1"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("LOCAL_WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29500"),
    ]
}

fn run(args: &[String], env: &[(&str, &str)]) -> Output {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    birdtrain(&args, env)
}

#[test]
fn a_restarted_torchrun_worker_resumes_the_run_in_out() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 2, 4);
    let (cache, out) = (tmp.path().join("cache"), tmp.path().join("run"));
    ok(run(&train_args(&data, &cache, &out, 1), &cpu_worker("0")));
    let again = train_args(&data, &cache, &out, 2);
    // The first attempt of a new command refuses a run already there…
    let refused = run(&again, &cpu_worker("0"));
    assert_one_line_error(&refused, &["holds a run already"]);
    let same: Vec<&str> = again.iter().map(String::as_str).collect();
    assert_eq!(dry_json(&same, &cpu_worker("0"))["resume"], false);
    assert_eq!(dry_json(&same, &cpu_worker("1"))["resume"], true);
    // …and a restarted worker of the same command line resumes it.
    let resumed = ok(run(&again, &cpu_worker("1")));
    let stdout = String::from_utf8_lossy(&resumed.stdout);
    assert!(
        stdout.contains(&format!(
            "TORCHELASTIC_RESTART_COUNT=1: resuming the run in {}",
            out.display()
        )),
        "{}",
        text(&resumed)
    );
    assert_eq!(CheckpointMeta::load(&out).unwrap().epoch, 2);
    // Without --out a restarted worker could not find its run.
    let mut no_out = train_args(&data, &cache, &out, 2);
    let at = no_out.iter().position(|a| a == "--out").unwrap();
    no_out.drain(at..at + 2);
    let e = run(&no_out, &cpu_worker("1"));
    assert_one_line_error(&e, &["--out", "TORCHELASTIC_RESTART_COUNT"]);
}

#[test]
fn a_flag_over_a_launcher_value_wins_and_the_run_says_so() {
    let tmp = tempfile::tempdir().unwrap();
    let data = dataset(&tmp.path().join("data"), 2, 4);
    let (cache, out) = (tmp.path().join("cache"), tmp.path().join("run"));
    let mut args = train_args(&data, &cache, &out, 1);
    args.extend(["--nodes", "1", "--node-rank", "0"].map(String::from));
    let mut task = srun_task();
    task.retain(|(k, _)| *k != "CUDA_VISIBLE_DEVICES");
    let trained = ok(run(&args, &task));
    let stdout = String::from_utf8_lossy(&trained.stdout);
    assert!(
        stdout.contains("--nodes 1 overrides SLURM_NTASKS=2")
            && stdout.contains("--node-rank 0 overrides SLURM_PROCID=1"),
        "{}",
        text(&trained)
    );
    assert!(
        out.join("checkpoint.json").exists(),
        "node 0 writes the run"
    );
}
