//! Stand-alone driver for the engine benchmark (the same functions `birdtrain synth` and
//! `birdtrain bench pipeline --json` call), usable without building the trainer:
//!
//! ```text
//! cargo run -p pipeline --release --example pipeline_bench -- synth DIR CLASSES PER_CLASS WIDTHxHEIGHT
//! cargo run -p pipeline --release --example pipeline_bench -- bench DIR EPOCHS BATCH SIZE WORKERS CACHE_DIR
//! ```

use pipeline::bench::{run_pipeline_bench_with, PipelineBenchOptions};
use pipeline::synth::{write_dataset, ImageFormatKind, SynthConfig};

fn arg<T: std::str::FromStr>(args: &[String], i: usize, what: &str) -> Result<T, String> {
    args.get(i)
        .ok_or_else(|| format!("missing argument {i}: {what}"))?
        .parse()
        .map_err(|_| format!("argument {i} ({what}) is not valid: {:?}", args[i]))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("synth") => {
            let size: String = arg(&args, 4, "WIDTHxHEIGHT")?;
            let (w, h) = size.split_once('x').ok_or("size must be WIDTHxHEIGHT")?;
            let summary = write_dataset(&SynthConfig {
                out: arg::<String>(&args, 1, "DIR")?.into(),
                classes: arg(&args, 2, "CLASSES")?,
                train_per_class: arg(&args, 3, "PER_CLASS")?,
                valid_per_class: 0,
                test_per_class: 0,
                width: w.parse()?,
                height: h.parse()?,
                format: ImageFormatKind::Jpg,
                seed: 0,
            })?;
            println!("{summary:?}");
        }
        Some("bench") => {
            let mut opts = PipelineBenchOptions::new(arg::<String>(&args, 1, "DIR")?);
            opts.epochs = arg(&args, 2, "EPOCHS")?;
            opts.batch_size = arg(&args, 3, "BATCH")?;
            opts.image_size = arg(&args, 4, "SIZE")?;
            opts.workers = arg(&args, 5, "WORKERS")?;
            opts.cache_dir = Some(arg::<String>(&args, 6, "CACHE_DIR")?.into());
            run_pipeline_bench_with(&opts, |r| {
                println!("{}", serde_json::to_string(r).expect("plain numbers serialise"));
            })?;
        }
        _ => return Err("usage: pipeline_bench synth DIR CLASSES PER_CLASS WxH | bench DIR EPOCHS BATCH SIZE WORKERS CACHE_DIR".into()),
    }
    Ok(())
}
