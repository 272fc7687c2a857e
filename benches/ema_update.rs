//! One update of the moving average of the weights (`--model-ema`) on the host: the blend of
//! every parameter and batch-norm statistic of a model toward new weights, as rank 0 does it
//! every `--model-ema-steps` steps.
//!
//! `cargo bench --bench ema_update -- [--model resnet50] [--reps 20]`. The update is timed
//! `reps` times after one warm-up call; the median and fastest are printed with the bytes
//! moved per second (read the average and the weights, write the average). The peer is
//! `benches/torch_ema.py` (torchvision's reference `ExponentialMovingAverage` on the same
//! model, one thread).

use std::time::Instant;

use birdtrain::model::{Arch, Graph, ModelState};
use birdtrain::train::ModelEma;

fn main() {
    let mut model = Arch::ResNet50;
    let mut reps = 20usize;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--bench" => {}
            "--model" => {
                let v = it.next().unwrap_or_default();
                model = v.parse().unwrap_or_else(|e| {
                    eprintln!("error: --model {v}: {e}");
                    std::process::exit(2)
                });
            }
            "--reps" => {
                let v = it.next().unwrap_or_default();
                reps = v.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| {
                    eprintln!("error: --reps {v}: expected a count of at least 1");
                    std::process::exit(2)
                });
            }
            other => {
                eprintln!("error: unknown flag {other} (expected --model or --reps)");
                std::process::exit(2)
            }
        }
    }
    let graph = Graph::new(model, 1000);
    let live = ModelState::init(&graph, 1);
    let mut ema = ModelEma::new(ModelState::init(&graph, 2), 1, 1e-3, 0);
    ema.update(&graph, &live, 0);
    let mut times: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            ema.update(&graph, &live, 0);
            t.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    let values: usize = live.params.iter().chain(&live.buffers).map(Vec::len).sum();
    let bytes = (values * 3 * 4) as f64;
    let median = times[times.len() / 2];
    println!(
        "{model} moving-average update: {values} values · median {:.2} ms · fastest {:.2} ms · {:.1} GB/s at the median",
        median * 1e3,
        times[0] * 1e3,
        bytes / median / 1e9
    );
    // The average must have moved: a check that the timed work was not optimised away.
    assert!(ema.state != live || ema.alpha() == 1.0);
}
