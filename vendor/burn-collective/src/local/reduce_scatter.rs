//! tune's patch: reduce-scatter of 1-D tensors into uneven, `sizes`-defined slices.
//!
//! Every peer passes a tensor of the same length L and the same `sizes` (one length per peer,
//! in PeerId order over all peers of all nodes, summing to L). Peer k gets elements
//! `[sizes[..k].sum(), sizes[..=k].sum())` of the element-wise sum (divided by the number of
//! peers for `Mean`).
//!
//! Locally it is the first half of a ring all-reduce: N-1 steps, in each of which every peer
//! sends its running sum of one slice to the next peer in PeerId order (onto that peer's
//! device), which adds its own part. The slices are chained so that peer k ends with its own
//! slice k.
//!
//! Summation order: with N local peers in PeerId order (positions 0..N), slice k is summed as
//! `((x[k+1] + x[k+2]) + x[k+3]) + ... + x[k]` (positions mod N), so it starts with the peer
//! after its owner and ends with the owner. A fixed-order sum `x[0] + x[1] + ...` may differ
//! from it in the last bits; integer-valued floats (small enough) are summed exactly either way.
//! With several nodes, each node first sums its peers' tensors in PeerId order
//! (`(x[a] + x[b]) + x[c] ...`), then the node sums are added in the same ring order over the
//! nodes (ordered by their lowest PeerId), see `global/node/gather_scatter.rs`.

use std::{ops::Range, sync::mpsc::SyncSender};

use burn_backend::{Backend, Slice, TensorMetadata};
use burn_communication::Protocol;

use crate::{CollectiveError, PeerId, ReduceOperation, global::node::base::Node};

/// Type sent to the collective client upon completion of a reduce-scatter
pub(crate) type ReduceScatterResult<T> = Result<T, CollectiveError>;

/// An on-going reduce-scatter operation
pub(crate) struct ReduceScatterOp<B: Backend> {
    calls: Vec<ReduceScatterOpCall<B>>,
    /// The first caller's tensor length, `sizes` and operation: every caller must pass the same
    len: usize,
    sizes: Vec<usize>,
    op: ReduceOperation,
    dtype: burn_std::DType,
}

struct ReduceScatterOpCall<B: Backend> {
    caller: PeerId,
    input: B::FloatTensorPrimitive,
    result_sender: SyncSender<ReduceScatterResult<B::FloatTensorPrimitive>>,
}

impl<B: Backend> ReduceScatterOp<B> {
    /// Checks one caller's own arguments: a 1-D tensor, and `sizes` summing to its length.
    pub fn check_call(
        input: &B::FloatTensorPrimitive,
        sizes: &[usize],
    ) -> Result<(), CollectiveError> {
        let shape = input.shape();
        if shape.num_dims() != 1 {
            return Err(CollectiveError::ReduceScatterNotOneDimensional);
        }
        if sizes.iter().sum::<usize>() != shape[0] {
            return Err(CollectiveError::ReduceScatterInvalidSizes);
        }
        Ok(())
    }

    /// A new operation with the first caller's arguments (checked by
    /// [`check_call`](Self::check_call)).
    pub fn new(input: &B::FloatTensorPrimitive, op: ReduceOperation, sizes: Vec<usize>) -> Self {
        Self {
            calls: vec![],
            len: input.shape()[0],
            sizes,
            op,
            dtype: input.dtype(),
        }
    }

    /// Registers a call; `Ok(true)` once every local peer has called.
    pub fn register_call(
        &mut self,
        caller: PeerId,
        input: B::FloatTensorPrimitive,
        result_sender: SyncSender<ReduceScatterResult<B::FloatTensorPrimitive>>,
        op: ReduceOperation,
        sizes: &[usize],
        peer_count: usize,
    ) -> Result<bool, CollectiveError> {
        let shape = input.shape();
        if shape.num_dims() != 1 {
            return Err(CollectiveError::ReduceScatterNotOneDimensional);
        }
        if shape[0] != self.len || input.dtype() != self.dtype {
            return Err(CollectiveError::ReduceScatterShapeMismatch);
        }
        if sizes != self.sizes.as_slice() {
            return Err(CollectiveError::ReduceScatterSizesMismatch);
        }
        if op != self.op {
            return Err(CollectiveError::ReduceScatterOperationMismatch);
        }
        if self.calls.iter().any(|c| c.caller == caller) {
            return Err(CollectiveError::ReduceScatterCalledTwice);
        }
        self.calls.push(ReduceScatterOpCall {
            caller,
            input,
            result_sender,
        });
        Ok(self.calls.len() == peer_count)
    }

    /// Runs the reduce-scatter (every local peer has called) and answers every caller.
    pub async fn execute<P: Protocol>(mut self, global_client: &mut Option<Node<B, P>>) {
        self.calls.sort_by_key(|c| c.caller.0);
        let inputs: Vec<_> = self.calls.iter().map(|c| c.input.clone()).collect();
        let result = match global_client.as_mut() {
            Some(node) => {
                let peers: Vec<_> = self.calls.iter().map(|c| c.caller).collect();
                node.reduce_scatter(&peers, inputs, &self.sizes, self.op)
                    .await
            }
            None => {
                if self.sizes.len() != inputs.len() {
                    Err(CollectiveError::ReduceScatterInvalidSizes)
                } else {
                    let ranges = size_ranges(&self.sizes);
                    let count = inputs.len();
                    Ok(reduce_scatter_ring::<B>(inputs, &ranges)
                        .into_iter()
                        .map(|t| apply_mean::<B>(t, self.op, count))
                        .collect())
                }
            }
        };
        match result {
            Ok(outputs) => {
                for (call, out) in self.calls.iter().zip(outputs) {
                    let _ = call.result_sender.send(Ok(out));
                }
            }
            Err(err) => self.fail(err),
        }
    }

    /// Sends the error to every caller so far.
    pub fn fail(self, err: CollectiveError) {
        for call in &self.calls {
            let _ = call.result_sender.send(Err(err.clone()));
        }
    }
}

/// The consecutive ranges that `sizes` cut `0..sizes.sum()` into.
pub(crate) fn size_ranges(sizes: &[usize]) -> Vec<Range<usize>> {
    let mut start = 0;
    sizes
        .iter()
        .map(|size| {
            let range = start..start + size;
            start += size;
            range
        })
        .collect()
}

/// Elements `range` of a 1-D tensor (an empty range gives a zero-length tensor of the same
/// dtype on the same device).
pub(crate) fn slice_1d<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    range: Range<usize>,
) -> B::FloatTensorPrimitive {
    B::float_slice(tensor, &[Slice::from(range)])
}

/// Divides by `count` for a mean.
pub(crate) fn apply_mean<B: Backend>(
    tensor: B::FloatTensorPrimitive,
    op: ReduceOperation,
    count: usize,
) -> B::FloatTensorPrimitive {
    match op {
        ReduceOperation::Sum => tensor,
        ReduceOperation::Mean => B::float_div_scalar(tensor, (count as f32).into()),
    }
}

/// Ring reduce-scatter (sum) among local peers. `inputs` are the peers' tensors in PeerId
/// order, `ranges[k]` the slice peer k gets; returns each peer's summed slice on its device.
///
/// Step s (0..N-1): peer i sends its running sum of slice (i - 1 - s) mod N (its own part at
/// step 0) to peer i+1, which adds its own part of that slice; that sum is what peer i+1 sends
/// at step s+1. After N-1 steps peer k holds the whole sum of slice k. Empty slices are never
/// sent; their owner gets a zero-length slice of its own input.
pub(crate) fn reduce_scatter_ring<B: Backend>(
    inputs: Vec<B::FloatTensorPrimitive>,
    ranges: &[Range<usize>],
) -> Vec<B::FloatTensorPrimitive> {
    let n = inputs.len();
    let devices: Vec<_> = inputs.iter().map(B::float_device).collect();
    let part = |i: usize, j: usize| slice_1d::<B>(inputs[i].clone(), ranges[j].clone());

    // held[i]: peer i's running sum of the slice it sends next (None: empty slice)
    let mut held: Vec<Option<B::FloatTensorPrimitive>> = (0..n)
        .map(|i| {
            let j = (i + n - 1) % n;
            (!ranges[j].is_empty()).then(|| part(i, j))
        })
        .collect();

    for step in 0..n.saturating_sub(1) {
        // every peer sends at once: take all the outgoing sums before any is replaced
        let outgoing = std::mem::replace(&mut held, vec![None; n]);
        for (i, sent) in outgoing.into_iter().enumerate() {
            let Some(sent) = sent else { continue };
            let dest = (i + 1) % n;
            // the slice peer i sends at this step; peer `dest` adds its own part of it
            let j = (i + 2 * n - 1 - step) % n;
            let moved = B::float_to_device(sent, &devices[dest]);
            held[dest] = Some(B::float_add(moved, part(dest, j)));
        }
    }

    // peer k now holds slice k
    held.into_iter()
        .enumerate()
        .map(|(k, sum)| match sum {
            Some(sum) => sum,
            None => slice_1d::<B>(inputs[k].clone(), 0..0),
        })
        .collect()
}
