//! Why a launch could not start, or how a worker failed.

use super::ending::WorkerError;

/// A launch that cannot start, or a worker that failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("--nproc_per_node must be at least 1")]
    NoWorkers,
    #[error("--nnodes must be at least 1, and --node_rank ({node_rank}) below --nnodes ({nnodes})")]
    NodeRank { node_rank: usize, nnodes: usize },
    #[error("--nnodes {0} needs --rdzv_endpoint HOST:PORT (where node 0 hosts the rendezvous)")]
    NoEndpoint(usize),
    #[error("--rdzv_endpoint {endpoint}: {message}")]
    Endpoint { endpoint: String, message: String },
    #[error(
        "--rdzv_endpoint {endpoint}: port {port} is in use on this machine; pick a free port for node 0 to host the rendezvous on"
    )]
    PortInUse { endpoint: String, port: u16 },
    #[error(
        "--rdzv_endpoint {endpoint}: node 0 is not reachable after {waited_s} s ({detail}); start node 0 too, or check the host, port and firewall (--rdzv_timeout sets the wait)"
    )]
    Unreachable {
        endpoint: String,
        waited_s: u64,
        detail: String,
    },
    #[error("rank {rank} failed: {}", chain_text(error))]
    Worker {
        rank: usize,
        /// The worker's own error, kept whole: a one-worker run reports it as a single-device
        /// run always has.
        error: WorkerError,
    },
    #[error("{0}")]
    NodeLost(String),
    #[error("rank {rank} panicked: {message}")]
    Panic { rank: usize, message: String },
}

/// An error and its causes on one line, each cause once (a message that already quotes its
/// source is not followed by it again).
fn chain_text(e: &WorkerError) -> String {
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(e);
    while let Some(c) = cause {
        let line = c.to_string();
        if !text.contains(&line) {
            text = format!("{text}: {line}");
        }
        cause = c.source();
    }
    text
}
