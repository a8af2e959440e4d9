//! `distattn timeline`: the per-step timelines a multi-GPU benchmark recorded, as an overlap
//! table and as SVG charts, so that hidden and exposed transfers are seen.

use anyhow::{bail, Context, Result};
use clap::Args;
use distattn::timeline::{Timeline, TimelineRun};
use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use std::path::{Path, PathBuf};

#[derive(Args)]
#[command(after_help = "\
FILE is the --timelines file of `distattn bench --gpus N` or of distattn-multigpu-bench
(bench/multigpu.sh writes it as timelines-<mask>.json): a list of runs, each with every rank's compute and transfer interval
per step (each transfer on its own; older files hold one span per step), in ms from that
rank's start event. Hidden = transfer time during which the rank computed; exposed = transfer
time with no compute running.
With --svg, each run becomes DIR/<strategy>-<mask>-<seq>-<pass>.svg (-2, -3, ... after the
first of runs that share those, e.g. two head dims or iterations): one panel per phase
(forward, backward), two lanes per rank (compute, transfer), alternate shades per step.")]
pub struct TimelineArgs {
    /// Timelines file (JSON) written by a multi-GPU benchmark.
    file: PathBuf,
    /// Draw one SVG chart per run into this folder (created if missing).
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,
    /// Only runs of this strategy.
    #[arg(long)]
    strategy: Option<String>,
    /// Only runs of this total sequence length.
    #[arg(long)]
    seq: Option<usize>,
    /// Only runs of this pass (fwd or fwd+bwd).
    #[arg(long)]
    pass: Option<String>,
}

pub fn timeline(args: TimelineArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.file).with_context(|| format!("reading {}", args.file.display()))?;
    let runs: Vec<TimelineRun> = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a timelines file (a JSON list of runs)", args.file.display()))?;
    let runs: Vec<&TimelineRun> = runs
        .iter()
        .filter(|r| args.strategy.as_ref().is_none_or(|s| &r.strategy == s))
        .filter(|r| args.seq.is_none_or(|n| r.seq == n))
        .filter(|r| args.pass.as_ref().is_none_or(|p| &r.pass == p))
        .collect();
    if runs.is_empty() {
        bail!("no run in {} matches the filters", args.file.display());
    }
    if let Some(dir) = &args.svg {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    println!(
        "{:<10} {:<24} {:>8} {:<8} {:<9} {:>4} {:>9} {:>9} {:>9} {:>7} {:>9}",
        "strategy", "mask", "seq", "pass", "phase", "rank", "total ms", "compute", "transfer", "hidden", "exposed"
    );
    let mut drawn: std::collections::HashMap<String, usize> = std::collections::HashMap::new();
    for run in runs {
        for (k, phase) in run.phases().iter().enumerate() {
            for t in phase {
                let o = t.overlap();
                println!(
                    "{:<10} {:<24} {:>8} {:<8} {:<9} {:>4} {:>9.3} {:>9.3} {:>9.3} {:>6.0}% {:>9.3}",
                    run.strategy,
                    run.mask,
                    run.seq,
                    run.pass,
                    run.phase_name(k),
                    t.rank,
                    t.total_ms,
                    o.compute_ms,
                    o.comm_ms,
                    100.0 * o.hidden_fraction(),
                    o.exposed_ms
                );
            }
        }
        if let Some(dir) = &args.svg {
            let name: String = format!("{}-{}-{}-{}", run.strategy, run.mask, run.seq, run.pass)
                .chars()
                .map(|c| if c.is_ascii_alphanumeric() || c == '-' || c == '.' { c } else { '_' })
                .collect();
            // Runs the name does not tell apart each keep their own chart.
            let n = drawn.entry(name.clone()).and_modify(|n| *n += 1).or_insert(1);
            let path = dir.join(if *n == 1 { format!("{name}.svg") } else { format!("{name}-{n}.svg") });
            draw(run, &path)?;
            println!("  -> {}", path.display());
        }
    }
    Ok(())
}

const LANE_PX: u32 = 22;
const PANEL_EXTRA_PX: u32 = 70;
/// The title strip: the run's title, and the colour legend under it.
const TITLE_PX: u32 = 64;
/// Bar colours by kind, two shades alternating by step so that neighbouring steps stand apart.
const COMPUTE: [RGBColor; 2] = [RGBColor(31, 119, 180), RGBColor(120, 170, 215)];
const TRANSFER: [RGBColor; 2] = [RGBColor(230, 120, 20), RGBColor(245, 180, 110)];

/// Draws one run: a panel per phase, a compute and a transfer lane per rank.
fn draw(run: &TimelineRun, path: &Path) -> Result<()> {
    let phases = run.phases();
    let heights: Vec<u32> = phases.iter().map(|p| 2 * p.len() as u32 * LANE_PX + PANEL_EXTRA_PX).collect();
    let root = SVGBackend::new(path, (1000, TITLE_PX + heights.iter().sum::<u32>())).into_drawing_area();
    let fail = |e: &dyn std::fmt::Display| anyhow::anyhow!("drawing {}: {e}", path.display());
    root.fill(&WHITE).map_err(|e| fail(&e))?;
    let (title, mut rest) = root.split_vertically(TITLE_PX);
    let gpus = phases.first().map_or(0, |p| p.len());
    let legend = title
        .titled(
            &format!("{} · {} · {} tokens · {} · {gpus} GPUs", run.strategy, run.mask, run.seq, run.pass),
            ("sans-serif", 20),
        )
        .map_err(|e| fail(&e))?;
    draw_legend(&legend).map_err(|e| fail(&e))?;
    for (k, phase) in phases.iter().enumerate() {
        let (area, below) = rest.split_vertically(heights[k]);
        rest = below;
        draw_phase(&area, &run.phase_name(k), phase).map_err(|e| fail(&e))?;
    }
    root.present().map_err(|e| fail(&e))?;
    Ok(())
}

type DrawResult<T> = std::result::Result<T, DrawingAreaErrorKind<<SVGBackend<'static> as DrawingBackend>::ErrorType>>;

/// A swatch and a label per bar kind and shade, in a row under the title.
fn draw_legend(area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> DrawResult<()> {
    let entries = [
        (COMPUTE[0], "compute, even steps"),
        (COMPUTE[1], "compute, odd steps"),
        (TRANSFER[0], "transfer, even steps"),
        (TRANSFER[1], "transfer, odd steps"),
    ];
    let mut x = 130;
    for (colour, label) in entries {
        area.draw(&Rectangle::new([(x, 6), (x + 14, 18)], colour.filled()))?;
        area.draw(&Text::new(label, (x + 20, 5), ("sans-serif", 13)))?;
        x += 190;
    }
    Ok(())
}

fn draw_phase(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    name: &str,
    ranks: &[&Timeline],
) -> DrawResult<()> {
    let lanes = 2 * ranks.len() as u32;
    // 4% of room past the last bar, so that it ends inside the frame.
    let x_max = 1.04 * ranks.iter().map(|t| t.total_ms).fold(0.0, f64::max).max(1e-3);
    let hidden: f64 = ranks.iter().map(|t| t.overlap().hidden_ms).sum();
    let comm: f64 = ranks.iter().map(|t| t.overlap().comm_ms).sum();
    let spans_only = ranks.iter().flat_map(|t| &t.steps).any(|s| s.comm.is_some() && s.transfers.is_empty());
    let caption = if comm > 0.0 {
        format!("{name}: {:.0}% of transfer time hidden under compute", 100.0 * hidden / comm)
    } else {
        format!("{name}: no transfers")
    };
    // Files from before transfers were timed one by one hold a span per step, waits included.
    let caption = if spans_only {
        format!("{caption} (transfers as one span per step: first start to last end)")
    } else {
        caption
    };
    // Lane 0 at the top: rank 0 compute, rank 0 transfer, rank 1 compute, ...
    let lane_name = |v: &SegmentValue<u32>| match v {
        SegmentValue::CenterOf(i) if *i < lanes => {
            let l = lanes - 1 - i;
            format!(
                "rank {} {}",
                ranks[(l / 2) as usize].rank,
                if l.is_multiple_of(2) { "compute" } else { "transfer" }
            )
        }
        _ => String::new(),
    };
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 15))
        .margin(6)
        .margin_right(24)
        .x_label_area_size(28)
        .y_label_area_size(120)
        .build_cartesian_2d(0f64..x_max, (0..lanes).into_segmented())?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(lanes as usize)
        .y_label_formatter(&lane_name)
        .x_desc("ms from the rank's start")
        .draw()?;
    for (r, t) in ranks.iter().enumerate() {
        for s in &t.steps {
            let bars = s.compute.map(|iv| (2 * r as u32, iv, COMPUTE)).into_iter();
            let bars = bars.chain(s.transfer_intervals().into_iter().map(|iv| (2 * r as u32 + 1, iv, TRANSFER)));
            chart.draw_series(bars.map(|(lane, (a, b), shades)| {
                let y = lanes - 1 - lane;
                Rectangle::new(
                    [(a, SegmentValue::Exact(y)), (b, SegmentValue::Exact(y + 1))],
                    shades[s.step % 2].filled(),
                )
            }))?;
        }
    }
    Ok(())
}
