//! tune's patch: all-gather and reduce-scatter across nodes, one node per process.
//!
//! The local collective server is a per-backend static, so two nodes cannot share a process:
//! the test starts the orchestrator on a thread of its own and re-runs this test binary once
//! per node (`node_process`, which does nothing unless `NODE_ENV` is set), each with its local
//! peers on threads. The nodes are started in the reverse order of their PeerIds, so their
//! NodeIds (the order they registered in) differ from the PeerId order the results must follow.
mod tests {
    use std::{
        process::{Child, Command, Stdio},
        time::{Duration, Instant},
    };

    use burn_tensor::{Tensor, TensorData, TensorPrimitive};
    use serial_test::serial;

    use crate::{
        CollectiveConfig, CollectiveError, GlobalCollectiveError, PeerId, ReduceOperation,
        all_gather, all_reduce, finish_collective, reduce_scatter, register, reset_collective,
    };

    type B = burn_flex::Flex;
    type Primitive = burn_backend::tensor::FloatTensor<B>;

    /// "node,orchestrator port,data port,scenario" for a node's process
    const NODE_ENV: &str = "BURN_COLLECTIVE_TEST_NODE";
    /// Each node's peers: uneven, and node 1's only peer sits between the others'.
    const NODES: [&[u32]; 3] = [&[0, 1], &[2], &[3, 4]];
    const WORLD: usize = 5;

    const GATHER_LENS: [[usize; WORLD]; 5] = [
        [3, 1, 4, 0, 2],
        [0, 0, 5, 0, 0],
        [0, 0, 0, 0, 0],
        [1, 0, 0, 0, 1],
        [2, 2, 2, 2, 2],
    ];
    /// Slices, including nodes whose slice is empty (nodes 0 and 2, then 1 and 2, then all).
    const SCATTER_SIZES: [[usize; WORLD]; 6] = [
        [2, 3, 1, 0, 4],
        [0, 0, 3, 0, 0],
        [3, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [1, 1, 1, 1, 1],
        [40, 1, 33, 0, 27],
    ];

    fn tensor(values: Vec<f32>) -> Primitive {
        let len = values.len();
        Tensor::<B, 1>::from_data(TensorData::new(values, [len]), &Default::default())
            .into_primitive()
            .tensor()
    }

    fn values(t: Primitive) -> Vec<f32> {
        Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t))
            .into_data()
            .to_vec::<f32>()
            .unwrap()
    }

    fn value(peer: usize, round: usize, i: usize, integers: bool) -> f32 {
        let x = (peer * 7919 + round * 104_729 + i * 31) % 1000;
        if integers {
            (x % 41) as f32 - 20.0
        } else {
            x as f32 / 37.0 - 13.5
        }
    }

    /// One local peer's part: all-gathers and reduce-scatters in a row, each checked against
    /// a plain Rust reference, then an all-reduce (the existing operation still works after).
    fn run_peer(id: PeerId) {
        let peer = id.0 as usize;
        for (round, lens) in GATHER_LENS.iter().enumerate() {
            let input = (0..lens[peer]).map(|i| value(peer, round, i, false));
            let result = values(all_gather::<B>(id, tensor(input.collect())).unwrap());
            let expected: Vec<f32> = (0..WORLD)
                .flat_map(|p| (0..lens[p]).map(move |i| value(p, round, i, false)))
                .collect();
            assert_eq!(result, expected, "all-gather round {round}, peer {peer}");

            let sizes = SCATTER_SIZES[round];
            for (op, integers) in [
                (ReduceOperation::Sum, true),
                (ReduceOperation::Sum, false),
                (ReduceOperation::Mean, false),
            ] {
                let len: usize = sizes.iter().sum();
                let input = (0..len).map(|i| value(peer, round, i, integers));
                let result = values(
                    reduce_scatter::<B>(id, tensor(input.collect()), op, sizes.to_vec()).unwrap(),
                );
                let start: usize = sizes[..peer].iter().sum();
                let expected: Vec<f32> = (start..start + sizes[peer])
                    .map(|i| {
                        let sum: f32 = (0..WORLD).map(|p| value(p, round, i, integers)).sum();
                        match op {
                            ReduceOperation::Sum => sum,
                            ReduceOperation::Mean => sum / WORLD as f32,
                        }
                    })
                    .collect();
                let what = format!("reduce-scatter round {round}, {op:?}, peer {peer}");
                assert_eq!(result.len(), expected.len(), "{what}");
                if integers {
                    assert_eq!(result, expected, "{what}");
                } else {
                    for (r, e) in result.iter().zip(&expected) {
                        assert!(
                            (r - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "{what}: {r} != {e}"
                        );
                    }
                }
            }
        }
        let summed =
            values(all_reduce::<B>(id, tensor(vec![1.0; 6]), ReduceOperation::Sum).unwrap());
        assert_eq!(summed, vec![WORLD as f32; 6]);
    }

    /// The part of a node whose neighbour (node 2) leaves after the first all-gather: the next
    /// all-gather must fail with an error, not panic or hang.
    fn run_peer_lost(id: PeerId, node: usize) {
        let first = all_gather::<B>(id, tensor(vec![id.0 as f32])).unwrap();
        assert_eq!(values(first), vec![0.0, 1.0, 2.0, 3.0, 4.0]);
        if node == 2 {
            // leave without a word, like a crashed process
            std::thread::sleep(Duration::from_millis(200));
            std::process::exit(0);
        }
        std::thread::sleep(Duration::from_millis(500));
        let second = all_gather::<B>(id, tensor(vec![id.0 as f32]));
        assert!(
            matches!(
                second,
                Err(CollectiveError::Global(GlobalCollectiveError::PeerLost(_)))
            ),
            "{second:?}"
        );
    }

    /// A node's process: registers its peers (one thread each) and runs the scenario.
    #[test]
    fn node_process() {
        let Ok(spec) = std::env::var(NODE_ENV) else {
            return;
        };
        let parts: Vec<&str> = spec.split(',').collect();
        let node: usize = parts[0].parse().unwrap();
        let orchestrator_port: u16 = parts[1].parse().unwrap();
        let data_port: u16 = parts[2].parse().unwrap();
        let scenario = parts[3].to_string();

        reset_collective::<B>();
        let peers = NODES[node];
        let config = CollectiveConfig::default()
            .with_num_devices(peers.len())
            .with_num_nodes(NODES.len() as u32)
            .with_global_address(
                format!("ws://127.0.0.1:{orchestrator_port}")
                    .parse()
                    .unwrap(),
            )
            .with_node_address(format!("ws://127.0.0.1:{data_port}").parse().unwrap())
            .with_data_service_port(data_port);
        let threads: Vec<_> = peers
            .iter()
            .map(|&peer| {
                let config = config.clone();
                let scenario = scenario.clone();
                std::thread::spawn(move || {
                    let id = PeerId(peer);
                    register::<B>(id, Default::default(), config).unwrap();
                    match scenario.as_str() {
                        "ops" => {
                            run_peer(id);
                            finish_collective::<B>(id).unwrap();
                        }
                        _ => run_peer_lost(id, node),
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
        // the other nodes may still be reading from this one's data service
        std::thread::sleep(Duration::from_millis(500));
    }

    fn free_port() -> u16 {
        std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    /// Starts the orchestrator and one process per node (the last node first), and waits for
    /// them all, killing them after `timeout`.
    fn run_nodes(scenario: &str, timeout: Duration) {
        let orchestrator_port = free_port();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(crate::start_global_orchestrator(orchestrator_port));
        });

        let exe = std::env::current_exe().unwrap();
        let mut children: Vec<(usize, Child)> = vec![];
        for node in (0..NODES.len()).rev() {
            let child = Command::new(&exe)
                .args([
                    "--exact",
                    "tests::multi_node::tests::node_process",
                    "--nocapture",
                    "--test-threads=1",
                ])
                .env(
                    NODE_ENV,
                    format!("{node},{orchestrator_port},{},{scenario}", free_port()),
                )
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            children.push((node, child));
            std::thread::sleep(Duration::from_millis(300));
        }

        let deadline = Instant::now() + timeout;
        let mut failures = vec![];
        for (node, mut child) in children {
            let status = loop {
                if let Some(status) = child.try_wait().unwrap() {
                    break Some(status);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    let _ = child.wait();
                    break None;
                }
                std::thread::sleep(Duration::from_millis(50));
            };
            let output = child.wait_with_output().unwrap();
            if status.map(|s| !s.success()).unwrap_or(true) {
                failures.push(format!(
                    "node {node}: {}\n--- stdout\n{}\n--- stderr\n{}",
                    status.map_or("timed out".to_string(), |s| s.to_string()),
                    String::from_utf8_lossy(&output.stdout),
                    String::from_utf8_lossy(&output.stderr)
                ));
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }

    #[test]
    #[serial]
    fn multi_node_all_gather_and_reduce_scatter() {
        if std::env::var(NODE_ENV).is_ok() {
            return;
        }
        run_nodes("ops", Duration::from_secs(120));
    }

    #[test]
    #[serial]
    fn multi_node_lost_peer_is_an_error() {
        if std::env::var(NODE_ENV).is_ok() {
            return;
        }
        run_nodes("lost", Duration::from_secs(120));
    }
}
