//! `cellgraph plot`: the loss curve of one or more runs as an SVG picture, from the JSON-lines
//! logs `cellgraph train --loss-log` (and `LossLog`) write.
//!
//! Each line with a `loss` is one training step: the x axis counts them in file order (a log
//! appended to by `--resume` continues its curve). Lines with an `accuracy` (written by
//! `--eval-each-epoch`) are drawn as points on a second axis, at the step they follow.

use std::path::{Path, PathBuf};

use clap::Args;
use plotters::prelude::*;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Arguments of `cellgraph plot`.
#[derive(Args)]
#[command(after_help = "\
Each line with a \"loss\" is one training step, counted in file order (a log appended to by
--resume continues its curve); with many steps a moving mean is drawn over the raw loss. Lines
with an \"accuracy\" (train --eval-each-epoch) are points on a second axis, at the step they follow.

Examples:
  cellgraph train --epochs 5 --loss-log lenet.jsonl --eval-each-epoch && cellgraph plot lenet.jsonl -o lenet.svg
  cellgraph plot in-step.jsonl across-steps.jsonl -o compare.svg")]
pub struct PlotArgs {
    /// Logs written by `cellgraph train --loss-log FILE` (one curve each).
    #[arg(required = true, value_name = "LOG")]
    logs: Vec<PathBuf>,
    /// The picture to write (SVG).
    #[arg(short, long, value_name = "FILE.svg")]
    output: PathBuf,
    /// The title [default: the log's file name].
    #[arg(long)]
    title: Option<String>,
}

/// One run's log: `(step, loss)` and `(step, accuracy)` points.
struct Run {
    name: String,
    loss: Vec<(f64, f64)>,
    accuracy: Vec<(f64, f64)>,
}

/// Reads a log; a line that is not JSON, or a file with no loss, is an error naming the line.
fn read(path: &Path) -> Res<Run> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut run = Run { name: path.file_name().unwrap_or_default().to_string_lossy().into_owned(), loss: vec![], accuracy: vec![] };
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("{}:{}: not a JSON line ({e})", path.display(), i + 1))?;
        let step = run.loss.len() as f64;
        // A non-finite loss is logged as null: a gap, not a point.
        if let Some(loss) = v.get("loss") {
            if let Some(l) = loss.as_f64() {
                run.loss.push((step + 1.0, l));
            }
        } else if let Some(a) = v.get("accuracy").and_then(|a| a.as_f64()) {
            run.accuracy.push((step, a));
        }
    }
    if run.loss.is_empty() {
        return Err(format!(
            "{}: no loss in it (expected JSON lines such as {{\"step\": 1, \"loss\": 2.3}}, written by cellgraph train --loss-log)",
            path.display()
        )
        .into());
    }
    Ok(run)
}

/// Runs `cellgraph plot`.
pub fn run(args: PlotArgs) -> Res<()> {
    if args.output.extension().is_none_or(|e| !e.eq_ignore_ascii_case("svg")) {
        return Err(format!("-o {}: cellgraph plot writes SVG; give a file name ending in .svg", args.output.display()).into());
    }
    let runs = args.logs.iter().map(|p| read(p)).collect::<Res<Vec<_>>>()?;
    let what = if runs.iter().any(|r| !r.accuracy.is_empty()) { "training loss and test accuracy" } else { "training loss" };
    let title = args.title.clone().unwrap_or_else(|| match runs.as_slice() {
        [one] => format!("{}: {what}", one.name),
        _ => what.into(),
    });
    let mut svg = String::new();
    draw(&runs, &title, &mut svg).map_err(|e| format!("drawing the plot: {e}"))?;
    std::fs::write(&args.output, svg).map_err(|e| format!("{}: {e}", args.output.display()))?;
    let steps: usize = runs.iter().map(|r| r.loss.len()).sum();
    println!("wrote {} ({} run(s), {steps} steps)", args.output.display(), runs.len());
    Ok(())
}

/// The loss axis: from 0 (or the lowest loss, if negative) to the highest, with a margin.
fn loss_range(lo: f64, hi: f64) -> std::ops::Range<f64> {
    let lo = lo.min(0.0);
    lo..hi + (hi - lo).max(1e-6) * 0.05
}

/// The mean over a centred window of `w` points (fewer at the ends).
fn moving_mean(points: &[(f64, f64)], w: usize) -> Vec<(f64, f64)> {
    let mut sums = vec![0.0];
    points.iter().for_each(|p| sums.push(sums[sums.len() - 1] + p.1));
    let n = points.len();
    (0..n)
        .map(|i| {
            (points[i].0, (sums[(i + w / 2 + 1).min(n)] - sums[i.saturating_sub(w / 2)]) / ((i + w / 2 + 1).min(n) - i.saturating_sub(w / 2)) as f64)
        })
        .collect()
}

/// matplotlib's `tab10`: each run takes two, loss then accuracy.
const COLORS: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

type Coords = Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>;
type Chart<'a, 'b> = plotters::chart::DualCoordChartContext<'a, SVGBackend<'b>, Coords, Coords>;

fn draw(runs: &[Run], title: &str, svg: &mut String) -> Res<()> {
    let points = || runs.iter().flat_map(|r| r.loss.iter());
    let steps = points().map(|p| p.0).fold(1.0, f64::max);
    let (lo, hi) = points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
    let with_accuracy = runs.iter().any(|r| !r.accuracy.is_empty());
    let root = SVGBackend::with_string(svg, (960, 540)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .right_y_label_area_size(if with_accuracy { 64 } else { 0 })
        .build_cartesian_2d(0.0..steps, loss_range(lo, hi))?
        .set_secondary_coord(0.0..steps, 0.0..1.0);
    let (labels, descs) = (("sans-serif", 13), ("sans-serif", 15));
    let whole = |x: &f64| format!("{x:.0}");
    chart
        .configure_mesh()
        .x_desc("training step")
        .y_desc("loss")
        .x_label_formatter(&whole)
        .label_style(labels)
        .axis_desc_style(descs)
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    if with_accuracy {
        chart.configure_secondary_axes().y_desc("test accuracy").x_label_formatter(&whole).label_style(labels).axis_desc_style(descs).draw()?;
    }
    for (i, r) in runs.iter().enumerate() {
        let name = if runs.len() == 1 { String::new() } else { format!("{}: ", r.name) };
        draw_run(&mut chart, r, &name, (COLORS[2 * i % 10], COLORS[(2 * i + 1) % 10]))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::MiddleRight)
        .label_font(labels)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}

/// One run: its loss (raw, and a moving mean when there are many steps) and its accuracy.
fn draw_run(chart: &mut Chart, r: &Run, name: &str, (loss, acc): (RGBColor, RGBColor)) -> Res<()> {
    let w = (r.loss.len() / 50) | 1;
    let raw = if w > 1 { loss.mix(0.35) } else { loss.to_rgba() };
    let line = move |c: RGBAColor| move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2));
    chart.draw_series(LineSeries::new(r.loss.iter().copied(), raw.stroke_width(1)))?.label(format!("{name}loss")).legend(line(raw));
    if w > 1 {
        let mean = loss.to_rgba();
        chart
            .draw_series(LineSeries::new(moving_mean(&r.loss, w), mean.stroke_width(2)))?
            .label(format!("{name}loss, mean of {w} steps"))
            .legend(line(mean));
    }
    if !r.accuracy.is_empty() {
        chart.draw_secondary_series(LineSeries::new(r.accuracy.iter().copied(), acc.stroke_width(2)))?;
        chart
            .draw_secondary_series(r.accuracy.iter().map(|&p| Circle::new(p, 4, acc.filled())))?
            .label(format!("{name}test accuracy"))
            .legend(move |(x, y)| Circle::new((x + 8, y), 4, acc.filled()));
    }
    Ok(())
}
