//! tune's patch: all-gather of 1-D tensors whose lengths may differ between peers.
//!
//! Locally (the worker threads of one process) it is a ring: N-1 steps, in each of which every
//! peer forwards the piece it received last (its own on the first step) to the next peer in
//! PeerId order, onto that peer's device. With several nodes, each node's pieces are
//! concatenated into one node piece, the node pieces go around a ring of nodes (see
//! `global/node/gather_scatter.rs`), and every local peer gets the whole concatenation.
//! Nothing is summed: the result is bit-identical to a plain concatenation.

use std::sync::mpsc::SyncSender;

use burn_backend::{Backend, TensorData, TensorMetadata};
use burn_communication::Protocol;
use burn_std::DType;

use crate::{CollectiveError, PeerId, global::node::base::Node};

/// Type sent to the collective client upon completion of an all-gather
pub(crate) type AllGatherResult<T> = Result<T, CollectiveError>;

/// An on-going all-gather operation
pub(crate) struct AllGatherOp<B: Backend> {
    calls: Vec<AllGatherOpCall<B>>,
    /// The dtype of the first caller's tensor: every piece must have it
    dtype: DType,
}

struct AllGatherOpCall<B: Backend> {
    caller: PeerId,
    input: B::FloatTensorPrimitive,
    result_sender: SyncSender<AllGatherResult<B::FloatTensorPrimitive>>,
}

impl<B: Backend> AllGatherOp<B> {
    pub fn new(dtype: DType) -> Self {
        Self {
            calls: vec![],
            dtype,
        }
    }

    /// Registers a call; `Ok(true)` once every local peer has called.
    pub fn register_call(
        &mut self,
        caller: PeerId,
        input: B::FloatTensorPrimitive,
        result_sender: SyncSender<AllGatherResult<B::FloatTensorPrimitive>>,
        peer_count: usize,
    ) -> Result<bool, CollectiveError> {
        if input.shape().num_dims() != 1 {
            return Err(CollectiveError::AllGatherNotOneDimensional);
        }
        if input.dtype() != self.dtype {
            return Err(CollectiveError::AllGatherDTypeMismatch);
        }
        if self.calls.iter().any(|c| c.caller == caller) {
            return Err(CollectiveError::AllGatherCalledTwice);
        }
        self.calls.push(AllGatherOpCall {
            caller,
            input,
            result_sender,
        });
        Ok(self.calls.len() == peer_count)
    }

    /// Runs the all-gather (every local peer has called) and answers every caller.
    pub async fn execute<P: Protocol>(mut self, global_client: &mut Option<Node<B, P>>) {
        self.calls.sort_by_key(|c| c.caller.0);
        let inputs = self.calls.iter().map(|c| c.input.clone()).collect();
        let result = match global_client.as_mut() {
            Some(node) => all_gather_with_global::<B, P>(inputs, self.dtype, node).await,
            None => Ok(all_gather_ring::<B>(inputs)),
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

/// Ring all-gather among local peers. `inputs` are the peers' 1-D pieces in PeerId order;
/// returns each peer's result (the concatenation of all pieces) on that peer's device.
///
/// Step s (0..N-1): peer i sends piece (i - s) mod N, the one it received at step s-1 (its own
/// at step 0), to peer i+1. Empty pieces are not moved (and not concatenated); when every
/// piece is empty each peer gets its own (empty) input back.
pub(crate) fn all_gather_ring<B: Backend>(
    inputs: Vec<B::FloatTensorPrimitive>,
) -> Vec<B::FloatTensorPrimitive> {
    let n = inputs.len();
    let devices: Vec<_> = inputs.iter().map(B::float_device).collect();
    let is_empty: Vec<bool> = inputs.iter().map(|t| t.shape()[0] == 0).collect();
    // pieces[i][j]: peer i's copy of peer j's piece (on peer i's device)
    let mut pieces: Vec<Vec<Option<B::FloatTensorPrimitive>>> = (0..n)
        .map(|i| {
            let mut row = vec![None; n];
            if !is_empty[i] {
                row[i] = Some(inputs[i].clone());
            }
            row
        })
        .collect();

    for step in 0..n.saturating_sub(1) {
        for i in 0..n {
            let j = (i + n - step) % n;
            let dest = (i + 1) % n;
            if let Some(piece) = pieces[i][j].clone() {
                pieces[dest][j] = Some(B::float_to_device(piece, &devices[dest]));
            }
        }
    }

    pieces
        .into_iter()
        .zip(inputs)
        .map(|(row, input)| {
            let mut row: Vec<_> = row.into_iter().flatten().collect();
            match row.len() {
                0 => input,
                1 => row.remove(0),
                _ => B::float_cat(row, 0),
            }
        })
        .collect()
}

/// All-gather with several nodes: the local pieces (in PeerId order) become one node piece,
/// node pieces go around the ring of nodes, and each local peer gets the whole result.
async fn all_gather_with_global<B: Backend, P: Protocol>(
    inputs: Vec<B::FloatTensorPrimitive>,
    dtype: DType,
    node: &mut Node<B, P>,
) -> Result<Vec<B::FloatTensorPrimitive>, CollectiveError> {
    let mut datas = Vec::with_capacity(inputs.len());
    for input in &inputs {
        datas.push(into_data::<B>(input.clone()).await?);
    }
    let node_piece = concat_data(datas, dtype);

    let all = node
        .all_gather(node_piece, dtype)
        .await
        .map_err(CollectiveError::Global)?;
    let full = concat_data(all, dtype);
    if full.num_elements() == 0 {
        // every piece is empty: each peer's own input is the (empty) result
        return Ok(inputs);
    }
    Ok(inputs
        .iter()
        .map(|input| B::float_from_data(full.clone(), &B::float_device(input)))
        .collect())
}

/// Reads a tensor back to the host.
pub(crate) async fn into_data<B: Backend>(
    tensor: B::FloatTensorPrimitive,
) -> Result<TensorData, CollectiveError> {
    B::float_into_data(tensor)
        .await
        .map_err(|err| CollectiveError::Other(format!("cannot read a tensor back: {err:?}")))
}

/// Concatenates 1-D tensor data of one dtype (bytes one after the other).
pub(crate) fn concat_data(pieces: Vec<TensorData>, dtype: DType) -> TensorData {
    let len: usize = pieces.iter().map(|d| d.num_elements()).sum();
    let mut bytes = Vec::with_capacity(pieces.iter().map(|d| d.as_bytes().len()).sum());
    for piece in &pieces {
        bytes.extend_from_slice(piece.as_bytes());
    }
    TensorData::from_bytes_vec(bytes, [len], dtype)
}
