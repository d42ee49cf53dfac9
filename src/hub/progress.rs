//! Progress bars for transfers (indicatif), fed by hf-hub's progress events.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use hf_hub::progress::{
    DownloadEvent, FileStatus, Progress, ProgressEvent, ProgressHandler, UploadEvent,
};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// One byte bar for a whole transfer (hidden when not visible), and what it saw: the files
/// that were actually transferred and their bytes, for the report.
#[derive(Clone)]
pub struct TransferBar {
    bar: ProgressBar,
    /// Per file: bytes done, and whether it was transferred (not served from the cache).
    files: Arc<Mutex<HashMap<String, (u64, bool)>>>,
}

impl TransferBar {
    pub fn new(visible: bool, label: &str) -> Self {
        let bar = ProgressBar::no_length();
        if visible {
            bar.set_draw_target(ProgressDrawTarget::stderr());
            let template = "{msg:30!} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
            if let Ok(style) = ProgressStyle::with_template(template) {
                bar.set_style(style.progress_chars("=> "));
            }
            bar.set_message(label.to_string());
        } else {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        Self {
            bar,
            files: Arc::default(),
        }
    }

    /// The handler to give hf-hub.
    pub fn handler(&self) -> Progress {
        Progress::new(self.clone())
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }

    /// The repo paths of the files that were transferred (not served from the cache).
    pub fn fetched_files(&self) -> Vec<String> {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files
            .iter()
            .filter(|(_, (_, moved))| *moved)
            .map(|(name, _)| name.clone())
            .collect()
    }

    /// Bytes transferred and the number of files they made up.
    pub fn fetched(&self) -> (u64, usize) {
        let files = self.files.lock().unwrap_or_else(|e| e.into_inner());
        files
            .values()
            .filter(|(_, moved)| *moved)
            .fold((0, 0), |(bytes, n), (b, _)| (bytes + b, n + 1))
    }
}

impl ProgressHandler for TransferBar {
    fn on_progress(&self, event: &ProgressEvent) {
        match event {
            ProgressEvent::Download(DownloadEvent::Start { total_bytes, .. })
            | ProgressEvent::Upload(UploadEvent::Start { total_bytes, .. }) => {
                self.bar.set_length(*total_bytes);
            }
            ProgressEvent::Download(DownloadEvent::Progress { files: progress }) => {
                let mut files = self.files.lock().unwrap_or_else(|e| e.into_inner());
                for f in progress {
                    let entry = files.entry(f.filename.clone()).or_insert((0, false));
                    entry.0 = entry.0.max(f.bytes_completed);
                    // A file first seen complete came from the cache.
                    entry.1 |= f.status != FileStatus::Complete;
                }
                let done: u64 = files.values().filter(|(_, m)| *m).map(|(b, _)| b).sum();
                self.bar.set_position(done);
            }
            ProgressEvent::Download(DownloadEvent::AggregateProgress {
                bytes_completed, ..
            })
            | ProgressEvent::Upload(UploadEvent::Progress {
                bytes_completed, ..
            }) => self.bar.set_position(*bytes_completed),
            _ => {}
        }
    }
}
