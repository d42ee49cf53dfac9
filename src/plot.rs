//! `tune plot`: the loss and learning-rate curves of a run's `metrics.jsonl` (and a GRPO run's
//! mean reward), drawn with plotters into a PNG (or an SVG when the output ends in `.svg`).
//!
//! Text is rendered with plotters' pure-Rust `ab_glyph` backend from a font embedded in the
//! binary (DejaVu Sans Mono, `assets/fonts/`), so plotting needs no system fontconfig.

use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::FontStyle;

const FONT: &[u8] = include_bytes!("../assets/fonts/DejaVuSansMono.ttf");
const FONT_FAMILY: &str = "sans-serif";

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}, line {line}: {message}")]
    BadLine {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error(
        "{path}: no logged steps with a finite `loss`; is this a tune metrics.jsonl (`<output_dir>/logs/metrics.jsonl`)?"
    )]
    NoData { path: PathBuf },
    #[error("{path}: the output must end in .png or .svg")]
    UnknownFormat { path: PathBuf },
    #[error("drawing {path}: {message}")]
    Draw { path: PathBuf, message: String },
}

/// The curves read from one metrics file: `(step, value)` points in file order.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Curves {
    pub loss: Vec<(f64, f64)>,
    pub lr: Vec<(f64, f64)>,
    /// `val_loss` (runs with `dataset_val`), drawn on the loss chart.
    pub val_loss: Vec<(f64, f64)>,
    /// `rewards` (GRPO runs: the mean reward of each step's completions), a chart of its own.
    pub rewards: Vec<(f64, f64)>,
}

/// Reads `step`, `loss` and `lr` from every line of a metrics.jsonl. A line that is not a JSON
/// object or lacks a numeric `step` is an error naming the line; a resumed run's repeated
/// steps are kept in file order.
pub fn read_metrics(path: &Path) -> Result<Curves, PlotError> {
    let text = std::fs::read_to_string(path).map_err(|source| PlotError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut curves = Curves::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let bad = |message: String| PlotError::BadLine {
            path: path.to_path_buf(),
            line: i + 1,
            message,
        };
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON ({e})")))?;
        let step = value
            .get("step")
            .and_then(serde_json::Value::as_f64)
            .ok_or_else(|| bad("no numeric \"step\"".into()))?;
        let number = |key: &str| {
            value
                .get(key)
                .and_then(serde_json::Value::as_f64)
                .filter(|v| v.is_finite())
        };
        if let Some(loss) = number("loss") {
            curves.loss.push((step, loss));
        }
        if let Some(lr) = number("lr") {
            curves.lr.push((step, lr));
        }
        if let Some(v) = number("val_loss") {
            curves.val_loss.push((step, v));
        }
        if let Some(v) = number("rewards") {
            curves.rewards.push((step, v));
        }
    }
    if curves.loss.is_empty() {
        return Err(PlotError::NoData {
            path: path.to_path_buf(),
        });
    }
    Ok(curves)
}

/// Exponential moving average (TensorBoard's smoothing, weight 0.9), with the same bias
/// correction so the first points are not pulled towards zero.
pub fn smoothed(points: &[(f64, f64)], weight: f64) -> Vec<(f64, f64)> {
    let mut avg = 0.0;
    points
        .iter()
        .enumerate()
        .map(|(i, &(x, y))| {
            avg = avg * weight + (1.0 - weight) * y;
            (x, avg / (1.0 - weight.powi(i as i32 + 1)))
        })
        .collect()
}

/// Draws the loss curve (raw and smoothed) above the learning-rate curve into `out`.
pub fn plot(curves: &Curves, out: &Path, size: (u32, u32)) -> Result<(), PlotError> {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The embedded font is a valid TrueType file; if it were not, text would be missing
        // and plotters reports that as a drawing error below.
        let _ = plotters::style::register_font(FONT_FAMILY, FontStyle::Normal, FONT);
    });
    let draw_err = |message: String| PlotError::Draw {
        path: out.to_path_buf(),
        message,
    };
    let ext = out
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase);
    match ext.as_deref() {
        Some("png") => {
            let root = BitMapBackend::new(out, size).into_drawing_area();
            draw(curves, &root).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        Some("svg") => {
            let root = SVGBackend::new(out, size).into_drawing_area();
            draw(curves, &root).map_err(draw_err)?;
            root.present().map_err(|e| draw_err(e.to_string()))
        }
        _ => Err(PlotError::UnknownFormat {
            path: out.to_path_buf(),
        }),
    }
}

fn draw<DB: DrawingBackend>(curves: &Curves, root: &DrawingArea<DB, Shift>) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let (height, _) = (root.dim_in_pixel().1, ());
    let (top, bottom) = if curves.lr.is_empty() {
        (root.clone(), None)
    } else {
        let (t, b) = root.split_vertically(height * 3 / 5);
        (t, Some(b))
    };
    // A GRPO run: the loss above its mean reward.
    let (top, rewards_area) = if curves.rewards.is_empty() {
        (top, None)
    } else {
        let half = top.dim_in_pixel().1 / 2;
        let (t, r) = top.split_vertically(half);
        (t, Some(r))
    };

    let steps = x_range(&curves.loss);
    let mut chart = ChartBuilder::on(&top)
        .caption(
            if curves.val_loss.is_empty() {
                "training loss"
            } else {
                "training and validation loss"
            },
            (FONT_FAMILY, 22),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            steps.clone(),
            y_range(&[curves.loss.as_slice(), curves.val_loss.as_slice()].concat()),
        )
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("loss")
        .label_style((FONT_FAMILY, 14))
        .draw()
        .map_err(err)?;
    let raw_color = if curves.loss.len() > 20 {
        BLUE.mix(0.3)
    } else {
        BLUE.mix(1.0)
    };
    chart
        .draw_series(LineSeries::new(curves.loss.iter().copied(), raw_color))
        .map_err(err)?
        .label("loss")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], raw_color));
    if curves.loss.len() > 20 {
        chart
            .draw_series(LineSeries::new(
                smoothed(&curves.loss, 0.9),
                BLUE.stroke_width(2),
            ))
            .map_err(err)?
            .label("smoothed (EMA 0.9)")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], BLUE.stroke_width(2)));
    }
    if !curves.val_loss.is_empty() {
        let color = RGBColor(230, 120, 0);
        chart
            .draw_series(LineSeries::new(
                curves.val_loss.iter().copied(),
                color.stroke_width(2),
            ))
            .map_err(err)?
            .label("validation loss")
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(
                curves
                    .val_loss
                    .iter()
                    .map(|&p| Circle::new(p, 3, color.filled())),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .label_font((FONT_FAMILY, 14))
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;

    if let Some(area) = rewards_area {
        draw_rewards(&curves.rewards, steps.clone(), &area)?;
    }

    if let Some(bottom) = bottom {
        let mut chart = ChartBuilder::on(&bottom)
            .caption("learning rate", (FONT_FAMILY, 22))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(70)
            .build_cartesian_2d(steps, y_range(&curves.lr))
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc("step")
            .y_desc("lr")
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v:.1e}"))
            .label_style((FONT_FAMILY, 14))
            .draw()
            .map_err(err)?;
        chart
            .draw_series(LineSeries::new(
                curves.lr.iter().copied(),
                RED.stroke_width(2),
            ))
            .map_err(err)?;
    }
    Ok(())
}

/// The mean reward per step, raw and smoothed (EMA 0.9) when there are many steps.
fn draw_rewards<DB: DrawingBackend>(
    rewards: &[(f64, f64)],
    steps: Range<f64>,
    area: &DrawingArea<DB, Shift>,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    let green = RGBColor(0, 140, 60);
    let mut chart = ChartBuilder::on(area)
        .caption("mean reward", (FONT_FAMILY, 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(steps, y_range(rewards))
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("reward")
        .label_style((FONT_FAMILY, 14))
        .draw()
        .map_err(err)?;
    let many = rewards.len() > 20;
    chart
        .draw_series(LineSeries::new(
            rewards.iter().copied(),
            green.mix(if many { 0.3 } else { 1.0 }),
        ))
        .map_err(err)?;
    if many {
        chart
            .draw_series(LineSeries::new(
                smoothed(rewards, 0.9),
                green.stroke_width(2),
            ))
            .map_err(err)?;
    }
    Ok(())
}

fn x_range(points: &[(f64, f64)]) -> Range<f64> {
    padded(points.iter().map(|p| p.0), 0.0)
}

fn y_range(points: &[(f64, f64)]) -> Range<f64> {
    padded(points.iter().map(|p| p.1), 0.05)
}

/// `min..max` of the values, widened by `pad` of the span (and to a unit span when flat).
fn padded(values: impl Iterator<Item = f64>, pad: f64) -> Range<f64> {
    let (lo, hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return 0.0..1.0;
    }
    if hi - lo <= f64::EPSILON * hi.abs().max(1.0) {
        let half = (hi.abs() * 0.1).max(1e-12);
        return (lo - half)..(hi + half);
    }
    let margin = (hi - lo) * pad;
    (lo - margin)..(hi + margin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smoothing_starts_at_the_first_value_and_follows_a_constant() {
        let s = smoothed(&[(1.0, 4.0), (2.0, 4.0), (3.0, 4.0)], 0.9);
        for (_, y) in s {
            assert!((y - 4.0).abs() < 1e-12);
        }
    }

    #[test]
    fn flat_ranges_are_widened() {
        let r = padded([2.0, 2.0].into_iter(), 0.05);
        assert!(r.start < 2.0 && r.end > 2.0);
    }
}
