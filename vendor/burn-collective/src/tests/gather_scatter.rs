//! tune's patch: tests of all-gather and reduce-scatter among the threads of one process,
//! against plain Rust references.
mod tests {
    use burn_tensor::{DType, Tensor, TensorData, TensorPrimitive};
    use serial_test::serial;

    use crate::{
        CollectiveConfig, CollectiveError, PeerId, ReduceOperation, all_gather, reduce_scatter,
        register, reset_collective,
    };

    type B = burn_flex::Flex;

    fn tensor(values: Vec<f32>) -> burn_backend::tensor::FloatTensor<B> {
        let len = values.len();
        Tensor::<B, 1>::from_data(TensorData::new(values, [len]), &Default::default())
            .into_primitive()
            .tensor()
    }

    fn values(t: burn_backend::tensor::FloatTensor<B>) -> Vec<f32> {
        let data = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(t)).into_data();
        assert_eq!(data.dtype, DType::F32);
        assert_eq!(data.shape.num_dims(), 1);
        data.to_vec::<f32>().unwrap()
    }

    /// A deterministic non-integer value for element `i` of peer `peer`'s tensor in `round`.
    fn value(peer: usize, round: usize, i: usize) -> f32 {
        let x = (peer * 7919 + round * 104_729 + i * 31) % 1000;
        x as f32 / 37.0 - 13.5
    }

    /// Runs `work(peer, round)` on one thread per peer, `rounds` times in a row after
    /// registering, and returns every result, indexed [round][peer].
    fn run_peers<T: Send + 'static>(
        peers: usize,
        rounds: usize,
        work: impl Fn(PeerId, usize) -> T + Send + Sync + 'static,
    ) -> Vec<Vec<T>> {
        reset_collective::<B>();
        let work = std::sync::Arc::new(work);
        let config = CollectiveConfig::default().with_num_devices(peers);
        let handles: Vec<_> = (0..peers)
            .map(|peer| {
                let config = config.clone();
                let work = work.clone();
                std::thread::spawn(move || {
                    let id = PeerId::from(peer);
                    register::<B>(id, Default::default(), config).unwrap();
                    (0..rounds).map(|round| work(id, round)).collect::<Vec<_>>()
                })
            })
            .collect();
        let per_peer: Vec<Vec<T>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        let mut per_round: Vec<Vec<T>> = (0..rounds).map(|_| vec![]).collect();
        for results in per_peer {
            for (round, result) in results.into_iter().enumerate() {
                per_round[round].push(result);
            }
        }
        per_round
    }

    /// All-gathers, `lens[round][peer]` elements per peer, and checks every peer's result
    /// is exactly the concatenation in PeerId order.
    fn check_all_gather(lens: Vec<Vec<usize>>) {
        let peers = lens[0].len();
        let rounds = lens.len();
        let lens_for_peers = lens.clone();
        let results = run_peers(peers, rounds, move |id, round| {
            let peer = id.0 as usize;
            let len = lens_for_peers[round][peer];
            let input = tensor((0..len).map(|i| value(peer, round, i)).collect());
            values(all_gather::<B>(id, input).unwrap())
        });
        for (round, results) in results.into_iter().enumerate() {
            let expected: Vec<f32> = (0..peers)
                .flat_map(|peer| (0..lens[round][peer]).map(move |i| value(peer, round, i)))
                .collect();
            for (peer, result) in results.into_iter().enumerate() {
                assert_eq!(result, expected, "round {round}, peer {peer}");
            }
        }
    }

    #[test]
    #[serial]
    fn all_gather_one_peer() {
        check_all_gather(vec![vec![5], vec![0], vec![1]]);
    }

    #[test]
    #[serial]
    fn all_gather_two_peers() {
        check_all_gather(vec![
            vec![3, 5],
            vec![0, 2],
            vec![4, 0],
            vec![0, 0],
            vec![1, 1],
        ]);
    }

    #[test]
    #[serial]
    fn all_gather_three_peers() {
        check_all_gather(vec![
            vec![7, 1, 4],
            vec![0, 3, 0],
            vec![1, 0, 1],
            vec![0, 0, 0],
            vec![2, 2, 2],
        ]);
    }

    #[test]
    #[serial]
    fn all_gather_four_peers() {
        check_all_gather(vec![
            vec![10, 3, 0, 6],
            vec![1, 0, 0, 0],
            vec![0, 0, 0, 1],
            vec![0, 0, 0, 0],
            vec![1, 1, 1, 1],
            vec![64, 65, 63, 1],
        ]);
    }

    /// Reduce-scatters with `sizes[round]` (one per peer), and checks each peer's slice against
    /// a sum in PeerId order (within a relative tolerance; exactly when `integers`).
    fn check_reduce_scatter(sizes: Vec<Vec<usize>>, op: ReduceOperation, integers: bool) {
        let peers = sizes[0].len();
        let rounds = sizes.len();
        let input = move |peer: usize, round: usize, i: usize| {
            if integers {
                ((peer * 13 + round * 7 + i * 3) % 41) as f32 - 20.0
            } else {
                value(peer, round, i)
            }
        };
        let sizes_for_peers = sizes.clone();
        let results = run_peers(peers, rounds, move |id, round| {
            let peer = id.0 as usize;
            let sizes = sizes_for_peers[round].clone();
            let len: usize = sizes.iter().sum();
            let t = tensor((0..len).map(|i| input(peer, round, i)).collect());
            values(reduce_scatter::<B>(id, t, op, sizes).unwrap())
        });
        for (round, results) in results.into_iter().enumerate() {
            let len: usize = sizes[round].iter().sum();
            let mut total = vec![0f32; len];
            for peer in 0..peers {
                for (i, t) in total.iter_mut().enumerate() {
                    *t += input(peer, round, i);
                }
            }
            if op == ReduceOperation::Mean {
                total.iter_mut().for_each(|t| *t /= peers as f32);
            }
            let mut start = 0;
            for (peer, result) in results.into_iter().enumerate() {
                let end = start + sizes[round][peer];
                let expected = &total[start..end];
                assert_eq!(result.len(), expected.len(), "round {round}, peer {peer}");
                if integers {
                    assert_eq!(result, expected, "round {round}, peer {peer}");
                } else {
                    for (r, e) in result.iter().zip(expected) {
                        assert!(
                            (r - e).abs() <= 1e-5 * (1.0 + e.abs()),
                            "round {round}, peer {peer}: {r} != {e}"
                        );
                    }
                }
                start = end;
            }
        }
    }

    const SIZES_1: [&[usize]; 3] = [&[5], &[0], &[1]];
    const SIZES_2: [&[usize]; 5] = [&[3, 5], &[0, 2], &[4, 0], &[0, 0], &[1, 1]];
    const SIZES_3: [&[usize]; 5] = [&[7, 1, 4], &[0, 3, 0], &[1, 0, 1], &[0, 0, 0], &[2, 2, 2]];
    const SIZES_4: [&[usize]; 6] = [
        &[10, 3, 0, 6],
        &[1, 0, 0, 0],
        &[0, 0, 0, 1],
        &[0, 0, 0, 0],
        &[1, 1, 1, 1],
        &[64, 65, 63, 1],
    ];

    fn sizes(list: &[&[usize]]) -> Vec<Vec<usize>> {
        list.iter().map(|s| s.to_vec()).collect()
    }

    #[test]
    #[serial]
    fn reduce_scatter_one_peer() {
        check_reduce_scatter(sizes(&SIZES_1), ReduceOperation::Sum, false);
        check_reduce_scatter(sizes(&SIZES_1), ReduceOperation::Mean, false);
    }

    #[test]
    #[serial]
    fn reduce_scatter_two_peers() {
        check_reduce_scatter(sizes(&SIZES_2), ReduceOperation::Sum, false);
        check_reduce_scatter(sizes(&SIZES_2), ReduceOperation::Mean, false);
        check_reduce_scatter(sizes(&SIZES_2), ReduceOperation::Sum, true);
    }

    #[test]
    #[serial]
    fn reduce_scatter_three_peers() {
        check_reduce_scatter(sizes(&SIZES_3), ReduceOperation::Sum, false);
        check_reduce_scatter(sizes(&SIZES_3), ReduceOperation::Mean, false);
        check_reduce_scatter(sizes(&SIZES_3), ReduceOperation::Sum, true);
    }

    #[test]
    #[serial]
    fn reduce_scatter_four_peers() {
        check_reduce_scatter(sizes(&SIZES_4), ReduceOperation::Sum, false);
        check_reduce_scatter(sizes(&SIZES_4), ReduceOperation::Mean, false);
        check_reduce_scatter(sizes(&SIZES_4), ReduceOperation::Sum, true);
        check_reduce_scatter(sizes(&SIZES_4), ReduceOperation::Mean, true);
    }

    /// The documented ring order: with 3 peers, slice k is `(x[k+1] + x[k+2]) + x[k]`.
    /// 1e8 + 1 - 1e8 in f32 depends on the order, which pins it down.
    #[test]
    #[serial]
    fn reduce_scatter_sums_in_ring_order() {
        let inputs = [[1.0f32, 1e8, -1e8], [1e8, -1e8, 1.0], [-1e8, 1.0, 1e8]];
        let results = run_peers(3, 1, move |id, _| {
            let t = tensor(inputs[id.0 as usize].to_vec());
            values(reduce_scatter::<B>(id, t, ReduceOperation::Sum, vec![1, 1, 1]).unwrap())
        });
        for (k, result) in results[0].iter().enumerate() {
            let x = |p: usize| inputs[p][k];
            let expected = (x((k + 1) % 3) + x((k + 2) % 3)) + x(k);
            assert_eq!(result, &vec![expected], "slice {k}");
        }
    }

    #[test]
    #[serial]
    fn all_gather_then_reduce_scatter_then_all_gather() {
        // different operations in a row on the same peers
        let results = run_peers(3, 1, |id, _| {
            let peer = id.0 as usize;
            let gathered = values(all_gather::<B>(id, tensor(vec![peer as f32; peer])).unwrap());
            let len = gathered.len();
            let summed = values(
                reduce_scatter::<B>(id, tensor(gathered), ReduceOperation::Sum, vec![0, 1, 2])
                    .unwrap(),
            );
            assert_eq!(len, 3);
            values(all_gather::<B>(id, tensor(summed)).unwrap())
        });
        for result in &results[0] {
            assert_eq!(result, &vec![3.0, 6.0, 6.0]);
        }
    }

    #[test]
    #[serial]
    fn reduce_scatter_sizes_mismatch_is_an_error() {
        let results = run_peers(2, 1, |id, _| {
            let sizes = if id.0 == 0 { vec![1, 1] } else { vec![2, 0] };
            reduce_scatter::<B>(id, tensor(vec![1.0, 2.0]), ReduceOperation::Sum, sizes).map(|_| ())
        });
        for result in &results[0] {
            assert!(
                matches!(result, Err(CollectiveError::ReduceScatterSizesMismatch)),
                "{result:?}"
            );
        }
    }

    #[test]
    #[serial]
    fn reduce_scatter_op_mismatch_is_an_error() {
        let results = run_peers(2, 1, |id, _| {
            let op = if id.0 == 0 {
                ReduceOperation::Sum
            } else {
                ReduceOperation::Mean
            };
            reduce_scatter::<B>(id, tensor(vec![1.0, 2.0]), op, vec![1, 1]).map(|_| ())
        });
        for result in &results[0] {
            assert!(
                matches!(result, Err(CollectiveError::ReduceScatterOperationMismatch)),
                "{result:?}"
            );
        }
    }

    #[test]
    #[serial]
    fn reduce_scatter_bad_sizes_are_an_error() {
        // sizes that do not sum to the length: each call fails on its own
        let results = run_peers(2, 1, |id, _| {
            reduce_scatter::<B>(id, tensor(vec![1.0, 2.0]), ReduceOperation::Sum, vec![1, 2])
                .map(|_| ())
        });
        // not one entry per peer: the operation fails once every peer has called
        let results_2 = run_peers(2, 1, |id, _| {
            reduce_scatter::<B>(id, tensor(vec![1.0, 2.0]), ReduceOperation::Sum, vec![2])
                .map(|_| ())
        });
        for result in results[0].iter().chain(&results_2[0]) {
            assert!(
                matches!(result, Err(CollectiveError::ReduceScatterInvalidSizes)),
                "{result:?}"
            );
        }
    }

    #[test]
    #[serial]
    fn all_gather_of_a_2d_tensor_is_an_error() {
        let results = run_peers(1, 1, |id, _| {
            let t = Tensor::<B, 2>::zeros([2, 2], &Default::default())
                .into_primitive()
                .tensor();
            all_gather::<B>(id, t).map(|_| ())
        });
        assert!(matches!(
            results[0][0],
            Err(CollectiveError::AllGatherNotOneDimensional)
        ));
    }
}
