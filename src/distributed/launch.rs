//! `tune run --nproc_per_node N [--nnodes M --node_rank R --rdzv_endpoint HOST:PORT]`, as
//! torchrun launches torchtune's recipes: one process per node, one worker per device in it.
//! The workers of a node are threads of one process (on CPU they share the Flex backend), so
//! when `tune run` dies, every worker dies with it: none can outlive the launcher.

use std::net::{SocketAddr, TcpListener, ToSocketAddrs, UdpSocket};
use std::sync::mpsc;
use std::time::Duration;

use super::World;
use super::ending::{Ending, WorkerError};
pub use super::launch_error::LaunchError;
use super::liveness::{Watch, connect_within};
use super::world::NodeLink;

/// The launch flags.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchPlan {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub rdzv_endpoint: Option<String>,
    /// How long nodes wait for each other at the rendezvous.
    pub rdzv_timeout: Duration,
}

impl Default for LaunchPlan {
    fn default() -> Self {
        Self {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            rdzv_endpoint: None,
            rdzv_timeout: RDZV_TIMEOUT,
        }
    }
}

/// The workers of this node, and for several nodes the liveness connections between them.
#[derive(Debug)]
pub struct Launch {
    pub worlds: Vec<World>,
    watch: Option<Watch>,
}

impl Launch {
    /// Tells the other nodes this one finished (call after the workers succeeded).
    pub fn done(&self) {
        if let Some(w) = &self.watch {
            w.done();
        }
    }
}

impl LaunchError {
    /// For a worker whose collective call failed in a multi-node run: the node that died, if
    /// one did (the root cause), instead of the call's own error.
    pub fn explained(self) -> Self {
        match self {
            Self::Worker { ref error, .. } if error.ending == Ending::CollectiveFailed => {
                match super::liveness::lost_node(Duration::from_secs(2)) {
                    Some(message) => Self::NodeLost(message),
                    None => self,
                }
            }
            other => other,
        }
    }
}

/// How long nodes wait for each other by default (`--rdzv_timeout`).
pub const RDZV_TIMEOUT: Duration = Duration::from_secs(300);

impl LaunchPlan {
    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    pub fn is_distributed(&self) -> bool {
        self.world_size() > 1
    }

    /// Checks the flags and, for several nodes, the endpoint: node 0 must be able to listen
    /// on it (and starts the orchestrator there, and the liveness service on the next port);
    /// the others must reach it.
    pub fn start(&self) -> Result<Launch, LaunchError> {
        if self.nproc_per_node == 0 {
            return Err(LaunchError::NoWorkers);
        }
        if self.nnodes == 0 || self.node_rank >= self.nnodes {
            return Err(LaunchError::NodeRank {
                node_rank: self.node_rank,
                nnodes: self.nnodes,
            });
        }
        let (nodes, watch) = if self.nnodes > 1 {
            let (link, watch) = self.link()?;
            (Some(link), Some(watch))
        } else {
            (None, None)
        };
        let worlds = (0..self.nproc_per_node)
            .map(|local| World {
                rank: self.node_rank * self.nproc_per_node + local,
                size: self.world_size(),
                local_size: self.nproc_per_node,
                nodes: nodes.clone(),
            })
            .collect();
        Ok(Launch { worlds, watch })
    }

    fn link(&self) -> Result<(NodeLink, Watch), LaunchError> {
        let endpoint = self
            .rdzv_endpoint
            .clone()
            .ok_or(LaunchError::NoEndpoint(self.nnodes))?;
        let bad = |message: String| LaunchError::Endpoint {
            endpoint: endpoint.clone(),
            message,
        };
        let addr: SocketAddr = endpoint
            .to_socket_addrs()
            .map_err(|e| bad(format!("not a HOST:PORT address ({e})")))?
            .next()
            .ok_or_else(|| bad("the host name resolves to no address".into()))?;
        let watch_port = addr.port().checked_add(1).ok_or_else(|| {
            bad("the port must be below 65535 (the next port carries node liveness)".into())
        })?;
        let watch = if self.node_rank == 0 {
            // Fail now, with the port named, rather than inside the orchestrator's server.
            let probe = TcpListener::bind(("0.0.0.0", addr.port())).map_err(|_| {
                LaunchError::PortInUse {
                    endpoint: endpoint.clone(),
                    port: addr.port(),
                }
            })?;
            drop(probe);
            let watch = Watch::host(
                &endpoint,
                watch_port,
                self.nnodes,
                self.nproc_per_node,
                self.rdzv_timeout,
            )?;
            start_orchestrator(&endpoint, addr.port())?;
            drop(connect_within(&endpoint, addr, self.rdzv_timeout)?);
            watch
        } else {
            drop(connect_within(&endpoint, addr, self.rdzv_timeout)?);
            let watch_addr = SocketAddr::new(addr.ip(), watch_port);
            Watch::join(
                &endpoint,
                watch_addr,
                self.node_rank,
                self.nproc_per_node,
                self.rdzv_timeout,
            )?
        };
        // The address the other nodes reach this one at: the interface that routes to the
        // endpoint (a UDP "connect" sends nothing).
        let local_ip = UdpSocket::bind(("0.0.0.0", 0))
            .and_then(|s| s.connect(addr).map(|_| s))
            .and_then(|s| s.local_addr())
            .map_err(|e| bad(format!("no route to it ({e})")))?
            .ip();
        let data_port = TcpListener::bind(("0.0.0.0", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| bad(format!("no free port for this node's tensor service ({e})")))?
            .port();
        let link = NodeLink {
            num_nodes: self.nnodes,
            orchestrator: format!("ws://{}", addr),
            node_address: format!("ws://{}", SocketAddr::new(local_ip, data_port)),
            data_port,
        };
        Ok((link, watch))
    }
}

/// Starts burn-collective's global orchestrator as `tune rendezvous --port P`, a child
/// process: the orchestrator takes over SIGINT and SIGTERM to shut itself down, which in the
/// launcher's own process would leave Ctrl-C and `kill` unable to stop training.
fn start_orchestrator(endpoint: &str, port: u16) -> Result<(), LaunchError> {
    let exe = std::env::current_exe().map_err(|e| LaunchError::Endpoint {
        endpoint: endpoint.to_string(),
        message: format!("cannot find the tune binary to host the rendezvous ({e})"),
    })?;
    use std::os::unix::process::CommandExt;
    std::process::Command::new(exe)
        .args(["rendezvous", "--port", &port.to_string()])
        // Its own process group: a Ctrl-C at the terminal stops the run at a step boundary,
        // which needs the rendezvous alive until the launcher exits (it exits with it).
        .process_group(0)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        // Its logs (a node that left without closing its connection, ...) repeat what the
        // nodes report themselves; TUNE_LOG shows them.
        .stderr(if std::env::var_os("TUNE_LOG").is_some() {
            std::process::Stdio::inherit()
        } else {
            std::process::Stdio::null()
        })
        .spawn()
        .map(drop)
        .map_err(|e| LaunchError::Endpoint {
            endpoint: endpoint.to_string(),
            message: format!("cannot start the rendezvous ({e})"),
        })
}

/// `tune rendezvous`: runs the orchestrator until its parent, the launcher of node 0, is gone
/// (checked twice a second), or a signal stops it.
pub fn serve_rendezvous(port: u16) {
    let parent = std::os::unix::process::parent_id();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_millis(500));
            if std::os::unix::process::parent_id() != parent {
                std::process::exit(0);
            }
        }
    });
    let Ok(rt) = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    else {
        return;
    };
    rt.block_on(burn_collective::start_global_orchestrator(port));
}

/// Runs `work` once per world, each on its own thread named after its rank, and returns when
/// all have succeeded, or as soon as one fails (its error or panic, naming the rank). The
/// caller then exits the process, which ends the workers still blocked in a collective call.
pub fn run_workers<F>(worlds: Vec<World>, work: F) -> Result<(), LaunchError>
where
    F: Fn(World) -> Result<(), WorkerError> + Send + Sync + 'static,
{
    if worlds.len() == 1 {
        let world = worlds.into_iter().next().expect("one world");
        let rank = world.rank;
        return work(world).map_err(|error| LaunchError::Worker { rank, error });
    }
    let work = std::sync::Arc::new(work);
    let (tx, rx) = mpsc::channel();
    let count = worlds.len();
    for world in worlds {
        let (tx, work) = (tx.clone(), work.clone());
        let rank = world.rank;
        let spawned = std::thread::Builder::new()
            .name(format!("rank {rank}"))
            .spawn(move || {
                let outcome =
                    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work(world)));
                let _ = tx.send((rank, outcome));
            });
        if let Err(e) = spawned {
            return Err(LaunchError::Worker {
                rank,
                error: WorkerError::failed(format!("could not start its thread: {e}")),
            });
        }
    }
    drop(tx);
    // A stop signal ends every worker at the same step: wait for all of them (rank 0 may still
    // be saving) and report rank 0's stop, which names the checkpoint.
    let mut stopped: Option<(usize, WorkerError)> = None;
    for _ in 0..count {
        let Ok((rank, outcome)) = rx.recv() else {
            break;
        };
        match outcome {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.stop_signal().is_some() => {
                if stopped.as_ref().is_none_or(|(r, _)| rank < *r) {
                    stopped = Some((rank, e));
                }
            }
            Ok(Err(error)) => return Err(LaunchError::Worker { rank, error }),
            Err(payload) => {
                let message = payload
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "no message".into());
                return Err(LaunchError::Panic { rank, message });
            }
        }
    }
    match stopped {
        Some((rank, error)) => Err(LaunchError::Worker { rank, error }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn ranks_are_node_major() {
        let plan = LaunchPlan {
            nproc_per_node: 2,
            ..Default::default()
        };
        let worlds = plan.start().unwrap().worlds;
        assert_eq!(worlds.iter().map(|w| w.rank).collect::<Vec<_>>(), [0, 1]);
        assert!(worlds.iter().all(|w| w.size == 2 && w.local_size == 2));
    }

    #[test]
    fn bad_flags_are_named() {
        let plan = LaunchPlan {
            nproc_per_node: 0,
            ..Default::default()
        };
        assert!(
            plan.start()
                .unwrap_err()
                .to_string()
                .contains("--nproc_per_node")
        );
        let plan = LaunchPlan {
            nnodes: 2,
            node_rank: 2,
            ..Default::default()
        };
        assert!(
            plan.start()
                .unwrap_err()
                .to_string()
                .contains("--node_rank (2)")
        );
        let plan = LaunchPlan {
            nnodes: 2,
            ..Default::default()
        };
        assert!(
            plan.start()
                .unwrap_err()
                .to_string()
                .contains("--rdzv_endpoint")
        );
    }

    #[test]
    fn a_failing_worker_is_named_and_ends_the_wait() {
        let plan = LaunchPlan {
            nproc_per_node: 3,
            ..Default::default()
        };
        let started = Instant::now();
        let err = run_workers(plan.start().unwrap().worlds, |w| {
            if w.rank == 1 {
                return Err(WorkerError::failed("out of data"));
            }
            // The others would wait on rank 1 forever in a collective call.
            std::thread::sleep(Duration::from_secs(3600));
            Ok(())
        })
        .unwrap_err();
        assert!(started.elapsed() < Duration::from_secs(30));
        assert_eq!(err.to_string(), "rank 1 failed: out of data");
        let err = run_workers(plan.start().unwrap().worlds, |w| {
            if w.rank == 2 {
                panic!("boom")
            }
            std::thread::sleep(Duration::from_secs(3600));
            Ok(())
        })
        .unwrap_err();
        assert_eq!(err.to_string(), "rank 2 panicked: boom");
    }
}
