//! Per-shape timing of the CPU backend's convolutions: every distinct convolution of a model
//! at a batch and image size, forward, data gradient and weight gradient, with GFLOP/s.
//!
//! `cargo bench --bench cpu_conv -- [--model resnet50] [--image-size 64] [--batch-size 32]
//! [--threads 2] [--reps 5]`. Each shape is timed `reps` times after one warm-up call and the
//! fastest is kept (the least disturbed by other work on a shared machine); the last lines sum the passes per kernel kind (the same names as
//! `birdtrain bench step --gpus 0 --breakdown`), so a kernel change can be measured shape by
//! shape without a whole training step. `BIRDTRAIN_CPU_SIMD` picks the vector width.

use std::collections::BTreeMap;
use std::time::Instant;

use birdtrain::backend::cpu::{conv_kind, CpuBackend};
use birdtrain::backend::{Backend, ConvShape};
use birdtrain::model::{Arch, Graph};

struct Args {
    model: Arch,
    image_size: u32,
    batch: usize,
    threads: usize,
    reps: usize,
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        model: Arch::ResNet50,
        image_size: 64,
        batch: 32,
        threads: 2,
        reps: 5,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--bench" {
            continue; // cargo bench passes this to harness-less benches
        }
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<usize>()
                .map_err(|_| format!("{flag}: {value:?} is not a whole number"))
        };
        match flag.as_str() {
            "--model" => a.model = value.parse().map_err(|e| format!("--model: {e}"))?,
            "--image-size" => a.image_size = number()? as u32,
            "--batch-size" => a.batch = number()?,
            "--threads" => a.threads = number()?,
            "--reps" => a.reps = number()?.max(1),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    Ok(a)
}

fn best_ms(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let t: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    t.into_iter().fold(f64::INFINITY, f64::min)
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let backend = match CpuBackend::new(args.threads) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    };
    let graph = Graph::new(args.model, 1000);
    let dims = graph.value_dims(args.image_size);
    // Distinct shapes with how often the model uses each.
    let mut shapes: Vec<(ConvShape, usize, bool)> = Vec::new();
    for node in graph.nodes() {
        if let Some(s) = graph.conv_shape(node, &dims, args.batch) {
            let first = matches!(node, birdtrain::model::Node::Conv { input: 0, .. });
            match shapes.iter_mut().find(|(t, _, _)| *t == s) {
                Some(e) => e.1 += 1,
                None => shapes.push((s, 1, first)),
            }
        }
    }
    println!(
        "{} batch {} at {}px, {} threads, {}",
        args.model,
        args.batch,
        args.image_size,
        backend.threads(),
        backend.simd_level()
    );
    println!(
        "{:>4} {:>4} {:>4} {:>3} {:>2} {:>5}  {:>9} {:>9} {:>9}  (GFLOP/s)",
        "hw", "ci", "co", "k", "s", "uses", "fwd", "dgrad", "wgrad"
    );
    let mut totals: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    let fill = |len: usize, seed: u32| -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / 16777216.0
                    - 0.5
            })
            .collect()
    };
    for (s, uses, first) in &shapes {
        let x = fill(s.x_len(), 1);
        let w = fill(s.w_len(), 2);
        let dy = fill(s.y_len(), 3);
        let mut y = vec![0.0; s.y_len()];
        let mut dx = vec![0.0; s.x_len()];
        let mut dw = vec![0.0; s.w_len()];
        let gflop = s.flops() / 1e9;
        let mut row = Vec::new();
        for op in ["conv_fwd", "conv_dgrad", "conv_wgrad"] {
            if op == "conv_dgrad" && *first {
                row.push(f64::NAN);
                continue;
            }
            let ms = best_ms(args.reps, || {
                let r = match op {
                    "conv_fwd" => backend.conv_forward(s, &x, &w, &mut y),
                    "conv_dgrad" => backend.conv_backward_data(s, &dy, &w, &mut dx, false),
                    _ => backend.conv_backward_weight(s, &x, &dy, &mut dw),
                };
                if let Err(e) = r {
                    eprintln!("error: {e}");
                    std::process::exit(1);
                }
            });
            let t = totals.entry(conv_kind(op, s)).or_default();
            t.0 += ms * *uses as f64;
            t.1 += gflop * *uses as f64;
            row.push(gflop / ms * 1e3);
        }
        println!(
            "{:>4} {:>4} {:>4} {:>3} {:>2} {:>5}  {:>9.1} {:>9.1} {:>9.1}",
            s.h, s.c_in, s.c_out, s.kernel, s.stride, uses, row[0], row[1], row[2]
        );
    }
    let mut kinds: Vec<_> = totals.into_iter().collect();
    kinds.sort_by(|a, b| b.1 .0.total_cmp(&a.1 .0));
    let all: f64 = kinds.iter().map(|(_, t)| t.0).sum();
    println!("{:<18} {:>9} {:>9}", "kind", "ms/step", "GFLOP/s");
    for (k, (ms, gflop)) in &kinds {
        println!("{k:<18} {ms:>9.2} {:>9.1}", gflop / ms * 1e3);
    }
    println!("{:<18} {all:>9.2}", "all convolutions");
}
