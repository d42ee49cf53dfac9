//! `tune plot`: a metrics.jsonl becomes a PNG with the loss and learning-rate curves; bad
//! input is a clear error naming the file and line.

use crate::support;

use support::*;

fn write_metrics(dir: &TempDir, lines: &[String]) -> std::path::PathBuf {
    let path = dir.path().join("metrics.jsonl");
    std::fs::write(&path, lines.join("\n")).unwrap();
    path
}

fn synthetic_run(steps: usize) -> Vec<String> {
    (1..=steps)
        .map(|s| {
            let loss = 7.0 * (-(s as f64) / 20.0).exp() + 0.3 * ((s * 7 % 5) as f64 / 5.0);
            let lr = 1e-3 * (s as f64 / steps as f64);
            format!(r#"{{"step": {s}, "epoch": 0, "loss": {loss}, "lr": {lr}, "tokens_per_second": 1000.0}}"#)
        })
        .collect()
}

#[test]
fn plot_draws_loss_and_lr_curves_into_a_png() {
    let dir = temp_dir("plot-png");
    let metrics = write_metrics(&dir, &synthetic_run(40));
    let out = dir.path().join("loss.png");
    let run = tune_ok(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--width",
        "900",
        "--height",
        "600",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("40 loss points, 40 lr points"), "{stderr}");

    let img = image::open(&out).expect("a PNG").to_rgb8();
    assert_eq!(img.dimensions(), (900, 600));
    // The loss curve is drawn in blue in the top panel, the lr curve in red in the bottom one.
    let (mut blue_top, mut red_bottom, mut dark) = (0, 0, 0);
    for (_, y, p) in img.enumerate_pixels() {
        let [r, g, b] = p.0;
        if b > 200 && r < 60 && g < 60 && y < 360 {
            blue_top += 1;
        }
        if r > 200 && g < 60 && b < 60 && y >= 360 {
            red_bottom += 1;
        }
        if r < 40 && g < 40 && b < 40 {
            dark += 1;
        }
    }
    assert!(blue_top > 300, "loss curve pixels: {blue_top}");
    assert!(red_bottom > 300, "lr curve pixels: {red_bottom}");
    // Axes, tick labels and captions.
    assert!(dark > 1000, "text and axis pixels: {dark}");
}

/// A GRPO run's metrics: its mean reward gets a chart of its own (green), between the loss and
/// the learning rate.
#[test]
fn plot_draws_a_grpo_runs_mean_reward() {
    let dir = temp_dir("plot-rewards");
    let lines: Vec<String> = (1..=40)
        .map(|s| {
            let reward = 4.0 + 12.0 * (1.0 - (-(s as f64) / 10.0).exp());
            format!(r#"{{"step": {s}, "loss": 0.0, "lr": 0.001, "rewards": {reward}}}"#)
        })
        .collect();
    let metrics = write_metrics(&dir, &lines);
    let out = dir.path().join("grpo.png");
    let run = tune_ok(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--width",
        "900",
        "--height",
        "600",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(stderr.contains("40 reward points"), "{stderr}");
    let img = image::open(&out).expect("a PNG").to_rgb8();
    // The reward panel is the lower half of the top 3/5 (rows 180..360).
    let green = img
        .enumerate_pixels()
        .filter(|(_, y, p)| {
            let [r, g, b] = p.0;
            (180..360).contains(y) && g > 120 && r < 60 && b < 100
        })
        .count();
    assert!(green > 300, "reward curve pixels: {green}");
}

#[test]
fn plot_writes_svg_by_extension() {
    let dir = temp_dir("plot-svg");
    let metrics = write_metrics(&dir, &synthetic_run(5));
    let out = dir.path().join("loss.svg");
    tune_ok(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    let svg = std::fs::read_to_string(&out).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("training loss"));
}

#[test]
fn bad_metrics_lines_name_the_file_and_line() {
    let dir = temp_dir("plot-bad");
    let mut lines = synthetic_run(3);
    lines.insert(2, "{\"step\": 3, \"loss\": ".to_string());
    let metrics = write_metrics(&dir, &lines);
    let run = tune(&["plot", metrics.to_str().unwrap(), "-o", "/tmp/never.png"]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("metrics.jsonl, line 3: not JSON"),
        "{stderr}"
    );

    let metrics = write_metrics(&dir, &[r#"{"epoch": 0, "loss": 1.0}"#.to_string()]);
    let stderr =
        String::from_utf8_lossy(&tune(&["plot", metrics.to_str().unwrap()]).stderr).into_owned();
    assert!(stderr.contains("line 1: no numeric \"step\""), "{stderr}");

    let metrics = write_metrics(&dir, &[r#"{"step": 1, "lr": 0.1}"#.to_string()]);
    let stderr =
        String::from_utf8_lossy(&tune(&["plot", metrics.to_str().unwrap()]).stderr).into_owned();
    assert!(
        stderr.contains("no logged steps with a finite `loss`"),
        "{stderr}"
    );
}

#[test]
fn missing_file_and_unknown_format_are_errors() {
    let dir = temp_dir("plot-missing");
    let run = tune(&["plot", dir.path().join("nope.jsonl").to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("nope.jsonl"), "{stderr}");

    let metrics = write_metrics(&dir, &synthetic_run(3));
    let out = dir.path().join("loss.jpg");
    let run = tune(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("must end in .png or .svg"), "{stderr}");

    // A size the renderer cannot allocate is refused up front (it panicked).
    let png = dir.path().join("loss.png");
    let run = tune(&[
        "plot",
        metrics.to_str().unwrap(),
        "-o",
        png.to_str().unwrap(),
        "--width",
        "100000",
        "--height",
        "100000",
    ]);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert_eq!(run.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("100000 is not in 100..=16384"), "{stderr}");
    assert!(!png.exists());
}
