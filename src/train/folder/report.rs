//! `RUN/report.png`: loss and accuracy per epoch (train vs valid) and training throughput;
//! `RUN/lr_find.png`: the learning-rate range test's loss against the rate.
//!
//! Drawn with plotters' bitmap backend; text uses DejaVu Sans embedded from the `dejavu`
//! crate, so the picture has labels on machines with no system fonts.

use std::path::Path;
use std::sync::Once;

use plotters::prelude::*;
use plotters::style::FontStyle;

use image::ImageEncoder;

use super::files::{commit_temp, write_temp};
use super::metrics::{EpochMetrics, MetricsSplit};
use super::FolderError;

const FONT: &str = "sans-serif";

fn register_font() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // The bytes are a known-good TTF shipped by the crate; failure would be a build bug.
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular())
            .map_err(|_| ())
            .expect("embedded DejaVu Sans parses");
    });
}

fn series(
    lines: &[EpochMetrics],
    split: MetricsSplit,
    f: fn(&EpochMetrics) -> f64,
) -> Vec<(f64, f64)> {
    lines
        .iter()
        .filter(|m| m.split == split)
        .map(|m| (m.epoch as f64, f(m)))
        .collect()
}

/// `curves` and, when the run kept a moving average of the weights, its validation curve.
fn with_average(mut curves: Vec<Curve<'static>>, average: Vec<(f64, f64)>) -> Vec<Curve<'static>> {
    if !average.is_empty() {
        curves.push(("valid (moving average)", MAGENTA, average));
    }
    curves
}

/// Draws the report of `lines` (as read from `metrics.jsonl`) into `path` (PNG), through a
/// temporary file and a rename.
pub fn write_report(path: &Path, lines: &[EpochMetrics]) -> Result<(), FolderError> {
    write_png(path, REPORT_SIZE, |pixels| draw(pixels, lines))
}

/// Sides of `report.png` and `lr_find.png`, in pixels.
const REPORT_SIZE: (u32, u32) = (1500, 480);
const LR_PLOT_SIZE: (u32, u32) = (800, 520);

/// Runs `draw` on an RGB picture of `size` in memory, then writes it as a PNG to a temporary
/// file beside `path` and renames it into place. Drawing in memory keeps the file's errors
/// the run folder's (a full disk gets its hint), apart from the drawing's own.
fn write_png(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&mut [u8]) -> Result<(), Box<dyn std::error::Error>>,
) -> Result<(), FolderError> {
    register_font();
    let mut pixels = vec![0u8; size.0 as usize * size.1 as usize * 3];
    draw(&mut pixels).map_err(|e| FolderError::Report {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let mut png = Vec::new();
    image::codecs::png::PngEncoder::new(&mut png)
        .write_image(&pixels, size.0, size.1, image::ExtendedColorType::Rgb8)
        .map_err(|e| FolderError::Report {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    let tmp = write_temp(path, &png)?;
    commit_temp(&tmp, path)
}

fn draw(pixels: &mut [u8], lines: &[EpochMetrics]) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::with_buffer(pixels, REPORT_SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let panels = root.split_evenly((1, 3));
    let last_epoch = lines.iter().map(|m| m.epoch).max().unwrap_or(1).max(1) as f64;
    let x_range = 1.0..last_epoch.max(2.0);

    let loss_max = lines
        .iter()
        .map(|m| m.loss)
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    panel(
        &panels[0],
        "Loss per epoch",
        "loss",
        x_range.clone(),
        0.0..loss_max,
        &with_average(
            vec![
                (
                    "train",
                    BLUE,
                    series(lines, MetricsSplit::Train, |m| m.loss),
                ),
                ("valid", RED, series(lines, MetricsSplit::Valid, |m| m.loss)),
            ],
            series(lines, MetricsSplit::ValidEma, |m| m.loss),
        ),
    )?;
    panel(
        &panels[1],
        "Top-1 accuracy per epoch",
        "accuracy",
        x_range.clone(),
        0.0..1.0,
        &with_average(
            vec![
                (
                    "train",
                    BLUE,
                    series(lines, MetricsSplit::Train, |m| m.accuracy),
                ),
                (
                    "valid",
                    RED,
                    series(lines, MetricsSplit::Valid, |m| m.accuracy),
                ),
            ],
            series(lines, MetricsSplit::ValidEma, |m| m.accuracy),
        ),
    )?;
    let speed_max = lines
        .iter()
        .filter(|m| m.split == MetricsSplit::Train)
        .map(|m| m.images_per_sec)
        .fold(0.0f64, f64::max)
        .max(1.0)
        * 1.2;
    panel(
        &panels[2],
        "Training throughput",
        "images/s",
        x_range,
        0.0..speed_max,
        &[(
            "train images/s",
            GREEN,
            series(lines, MetricsSplit::Train, |m| m.images_per_sec),
        )],
    )?;
    root.present()?;
    Ok(())
}

/// Draws `birdtrain lr-find`'s curve into `path` (PNG): the loss and its smoothed form
/// against the learning rate on a log scale, `suggested` (lr, smoothed loss) marked.
pub fn write_lr_plot(
    path: &Path,
    points: &[(f64, f64, f64)],
    suggested: Option<(f64, f64)>,
) -> Result<(), FolderError> {
    write_png(path, LR_PLOT_SIZE, |pixels| {
        draw_lr(pixels, points, suggested)
    })
}

fn draw_lr(
    pixels: &mut [u8],
    points: &[(f64, f64, f64)],
    suggested: Option<(f64, f64)>,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = BitMapBackend::with_buffer(pixels, LR_PLOT_SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let lr = |f: fn(f64, f64) -> f64, start| points.iter().map(|p| p.0).fold(start, f);
    let (lo, hi) = (lr(f64::min, f64::INFINITY), lr(f64::max, 0.0));
    let (lo, hi) = if lo.is_finite() && hi > lo {
        (lo, hi)
    } else {
        (1e-6, 1.0)
    };
    let finite = points
        .iter()
        .flat_map(|p| [p.1, p.2])
        .filter(|v| v.is_finite());
    let (y_lo, y_hi) = finite.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    let (y_lo, y_hi) = if y_hi > y_lo {
        (y_lo, y_hi + 0.05 * (y_hi - y_lo))
    } else {
        (0.0, 1.0)
    };
    let mut chart = ChartBuilder::on(&root)
        .caption("Learning-rate range test", (FONT, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d((lo..hi).log_scale(), y_lo..y_hi)?;
    chart
        .configure_mesh()
        .x_desc("learning rate (--lr units, for a batch of 256)")
        .y_desc("training loss")
        .x_label_formatter(&|v| format!("{v:.0e}"))
        .label_style((FONT, 14))
        .draw()?;
    let curves: [Curve<'_>; 2] = [
        (
            "loss",
            RGBColor(150, 170, 230),
            points.iter().map(|p| (p.0, p.1)).collect(),
        ),
        ("smoothed", RED, points.iter().map(|p| (p.0, p.2)).collect()),
    ];
    for (name, colour, line) in curves {
        chart
            .draw_series(LineSeries::new(line, colour.stroke_width(2)))?
            .label(name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
    }
    if let Some(point) = suggested {
        chart
            .draw_series([Circle::new(point, 7, GREEN.filled())])?
            .label(format!("suggested --lr {:.2e}", point.0))
            .legend(|(x, y)| Circle::new((x + 9, y), 5, GREEN.filled()));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    root.present()?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// One curve: legend label, colour, (epoch, value) points.
type Curve<'a> = (&'a str, RGBColor, Vec<(f64, f64)>);

fn panel(
    area: &Area<'_>,
    title: &str,
    y_label: &str,
    x: std::ops::Range<f64>,
    y: std::ops::Range<f64>,
    curves: &[Curve<'_>],
) -> Result<(), Box<dyn std::error::Error>> {
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(x, y)?;
    chart
        .configure_mesh()
        .x_desc("epoch")
        .y_desc(y_label)
        .label_style((FONT, 14))
        .draw()?;
    for (name, colour, points) in curves {
        let colour = *colour;
        chart
            .draw_series(LineSeries::new(
                points.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], colour.stroke_width(2))
            });
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font((FONT, 14))
        .draw()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_a_png() {
        let dir = tempfile::tempdir().unwrap();
        let mut lines = Vec::new();
        for epoch in 1..=3 {
            for (split, acc) in [
                (MetricsSplit::Train, 0.3),
                (MetricsSplit::Valid, 0.25),
                (MetricsSplit::ValidEma, 0.2),
            ] {
                lines.push(EpochMetrics {
                    epoch,
                    split,
                    loss: 2.0 / epoch as f64,
                    accuracy: acc * epoch as f64,
                    top5: 0.9,
                    images_per_sec: 500.0 + epoch as f64,
                    seconds: 1.0,
                });
            }
        }
        let path = dir.path().join("report.png");
        write_report(&path, &lines).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(bytes.len() > 10_000, "a blank picture would be tiny");
        // The moving average's curve is drawn when the run kept one.
        lines.retain(|m| m.split != MetricsSplit::ValidEma);
        write_report(&path, &lines).unwrap();
        assert_ne!(std::fs::read(&path).unwrap(), bytes);
    }

    #[test]
    fn the_lr_sweep_is_drawn_with_its_suggestion_and_without_points() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("lr_find.png");
        let points: Vec<(f64, f64, f64)> = (0..40)
            .map(|i| {
                let lr = 1e-5 * 1.4f64.powi(i);
                (lr, 2.0 - (i as f64 / 20.0), 2.0 - (i as f64 / 25.0))
            })
            .chain([(1.0, f64::NAN, f64::INFINITY)])
            .collect();
        write_lr_plot(&path, &points, Some((points[20].0, points[20].2))).unwrap();
        let marked = std::fs::read(&path).unwrap();
        assert_eq!(&marked[1..4], b"PNG");
        write_lr_plot(&path, &points, None).unwrap();
        assert_ne!(std::fs::read(&path).unwrap(), marked, "the mark is drawn");
        // A sweep stopped before its first point still leaves a picture.
        write_lr_plot(&path, &[], None).unwrap();
    }
}
