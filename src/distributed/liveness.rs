//! Node liveness for multi-node runs: every node keeps one TCP connection to node 0's launcher
//! (at the rendezvous port + 1) and says `done` when its workers have finished. A connection
//! that closes without it means that node's process died or failed; the nodes still running
//! would otherwise wait for it inside a collective call forever, so they stop at once with an
//! error naming it. This carries no tensors: the collectives are burn-collective's.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::launch_error::LaunchError;

const DONE: &str = "done";

/// This node's side of the liveness connections.
#[derive(Debug)]
pub struct Watch {
    streams: Arc<Mutex<Vec<TcpStream>>>,
}

/// How long a node whose peer vanished waits before stopping: a peer that stopped on an error
/// this node hits too (a different config at the rendezvous) lets this node report its own,
/// more precise error first.
const GRACE: Duration = Duration::from_secs(1);

/// The node this process saw die, as the message to report (set once, at the first loss).
static LOST: Mutex<Option<String>> = Mutex::new(None);

/// Whether a peer node died, waiting up to `wait` for word of it: a collective call that
/// failed because a node vanished may return before this node's liveness connection closes.
pub fn lost_node(wait: Duration) -> Option<String> {
    let deadline = Instant::now() + wait;
    loop {
        if let Some(message) = LOST.lock().ok().and_then(|l| l.clone()) {
            return Some(message);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn lost(node: usize, nproc_per_node: usize) -> ! {
    let first = node * nproc_per_node;
    let ranks = if nproc_per_node == 1 {
        format!("rank {first}")
    } else {
        format!("ranks {first}-{}", first + nproc_per_node - 1)
    };
    let message = format!(
        "node {node} ({ranks}) stopped before the run finished (its process failed or was killed; its own log says why); stopping this node too"
    );
    if let Ok(mut l) = LOST.lock() {
        l.get_or_insert(message.clone());
    }
    // This node's own error, if it has a more precise one, is reported meanwhile.
    std::thread::sleep(GRACE);
    // One write, so no other thread's output lands inside the line.
    let _ = std::io::stderr()
        .lock()
        .write_all(format!("error: {message}\n").as_bytes());
    std::process::exit(1);
}

/// Reads `stream` until `done` or its end; an end without `done` stops this process.
fn watch(stream: TcpStream, node: usize, nproc_per_node: usize) {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => lost(node, nproc_per_node),
                Ok(_) if line.trim() == DONE => return,
                Ok(_) => {}
            }
        }
    });
}

impl Watch {
    /// Node 0: accepts the other `nnodes - 1` nodes on `port` within `timeout`.
    pub fn host(
        endpoint: &str,
        port: u16,
        nnodes: usize,
        nproc_per_node: usize,
        timeout: Duration,
    ) -> Result<Self, LaunchError> {
        let listener =
            TcpListener::bind(("0.0.0.0", port)).map_err(|_| LaunchError::PortInUse {
                endpoint: endpoint.to_string(),
                port,
            })?;
        let streams = Arc::new(Mutex::new(Vec::new()));
        let accepted = streams.clone();
        // Accepting waits for the other nodes in the background: the workers' own rendezvous
        // (burn-collective's register) waits for them too.
        std::thread::spawn(move || {
            let deadline = Instant::now() + timeout;
            let _ = listener.set_nonblocking(true);
            let mut joined = 1;
            while joined < nnodes {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let _ = stream.set_nonblocking(false);
                        let mut reader = BufReader::new(match stream.try_clone() {
                            Ok(s) => s,
                            Err(_) => continue,
                        });
                        let mut hello = String::new();
                        if reader.read_line(&mut hello).is_err() {
                            continue;
                        }
                        let node = hello
                            .trim()
                            .strip_prefix("node ")
                            .and_then(|n| n.parse().ok())
                            .unwrap_or(usize::MAX);
                        if let Ok(mut all) = accepted.lock()
                            && let Ok(s) = stream.try_clone()
                        {
                            all.push(s);
                        }
                        watch(stream, node, nproc_per_node);
                        joined += 1;
                    }
                    Err(_) if Instant::now() >= deadline => {
                        eprintln!(
                            "error: only {joined} of {nnodes} nodes joined within {} s (--rdzv_timeout); start the others with the same --rdzv_endpoint and --nnodes",
                            timeout.as_secs()
                        );
                        std::process::exit(1);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        Ok(Self { streams })
    }

    /// Node `node_rank` > 0: connects to node 0 at `addr`.
    pub fn join(
        endpoint: &str,
        addr: SocketAddr,
        node_rank: usize,
        nproc_per_node: usize,
        timeout: Duration,
    ) -> Result<Self, LaunchError> {
        let mut stream = connect_within(endpoint, addr, timeout)?;
        writeln!(stream, "node {node_rank}").map_err(|e| LaunchError::Endpoint {
            endpoint: endpoint.to_string(),
            message: format!("lost node 0 while joining ({e})"),
        })?;
        let watched = stream.try_clone().map_err(|e| LaunchError::Endpoint {
            endpoint: endpoint.to_string(),
            message: e.to_string(),
        })?;
        watch(watched, 0, nproc_per_node);
        Ok(Self {
            streams: Arc::new(Mutex::new(vec![stream])),
        })
    }

    /// This node's workers finished: the others need not wait for it any more.
    pub fn done(&self) {
        if let Ok(mut all) = self.streams.lock() {
            for s in all.iter_mut() {
                let _ = writeln!(s, "{DONE}");
                let _ = s.flush();
            }
        }
    }
}

/// Connects to `addr`, retrying until `timeout` (node 0 may start after the others).
pub(super) fn connect_within(
    endpoint: &str,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, LaunchError> {
    let start = Instant::now();
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(stream) => return Ok(stream),
            Err(e) if start.elapsed() >= timeout => {
                return Err(LaunchError::Unreachable {
                    endpoint: endpoint.to_string(),
                    waited_s: timeout.as_secs(),
                    detail: e.to_string(),
                });
            }
            Err(_) => std::thread::sleep(Duration::from_millis(100)),
        }
    }
}
