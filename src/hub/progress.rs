//! Progress bars for transfers (indicatif).

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// A byte progress bar, hidden when `visible` is false.
pub fn bytes_bar(visible: bool, total: Option<u64>, label: &str) -> ProgressBar {
    let bar = match total {
        Some(total) => ProgressBar::new(total),
        None => ProgressBar::no_length(),
    };
    if !visible {
        bar.set_draw_target(ProgressDrawTarget::hidden());
        return bar;
    }
    bar.set_draw_target(ProgressDrawTarget::stderr());
    let template = "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_message(label.to_string());
    bar
}
