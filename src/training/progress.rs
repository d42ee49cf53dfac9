//! The per-epoch progress bar: loss, lr and tokens/s, as torchtune shows them.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub struct EpochProgress {
    bar: ProgressBar,
}

impl EpochProgress {
    pub fn new(epoch: usize, steps: usize, done: usize, visible: bool) -> Self {
        let bar = ProgressBar::with_draw_target(
            Some(steps as u64),
            if visible {
                ProgressDrawTarget::stderr()
            } else {
                ProgressDrawTarget::hidden()
            },
        );
        if let Ok(style) =
            ProgressStyle::with_template("{prefix} {bar:30} {pos}/{len} [{elapsed}<{eta}] {msg}")
        {
            bar.set_style(style);
        }
        bar.set_prefix(format!("epoch {}", epoch + 1));
        bar.set_position(done as u64);
        Self { bar }
    }

    pub fn advance(&mut self, loss: f64, lr: f64, tokens_per_second: f64) {
        self.bar.set_message(format!(
            "loss {loss:.4} lr {lr:.2e} tok/s {tokens_per_second:.0}"
        ));
        self.bar.inc(1);
    }

    /// Runs `f` with the bar hidden, so log lines print cleanly.
    pub fn suspend<T>(&self, f: impl FnOnce() -> T) -> T {
        self.bar.suspend(f)
    }

    pub fn println(&self, line: String) {
        self.bar.println(line);
    }

    pub fn finish(&self) {
        self.bar.finish();
    }
}
