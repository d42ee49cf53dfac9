//! tune's patch: ring all-gather and ring reduce-scatter across nodes.
//!
//! The ring visits the nodes in the order of their lowest PeerId (not of their NodeId, which
//! follows the order in which they registered), so the node pieces are in PeerId order as long
//! as each node's peers are a contiguous run of PeerIds (which is checked). Like the ring
//! all-reduce (`ring.rs`), each step exposes one tensor on this node's data service and
//! downloads one from the previous node, with the step number as transfer id; every operation
//! ends with a sync of all nodes, so the ids of the next operation cannot meet these.

use std::{collections::HashMap, ops::Range, sync::Arc};

use burn_backend::{Backend, TensorData, TensorMetadata};
use burn_communication::{Address, Protocol, data_service::TensorDataService};
use burn_std::DType;

use crate::{
    NodeId, PeerId, global::shared::GlobalCollectiveError, local::slice_1d, node::sync::SyncService,
};

/// The nodes in ring order (by their lowest PeerId), each with its peers in PeerId order.
/// Errors when a node's peers are not a contiguous run of the PeerIds of all nodes.
pub(crate) fn node_ring(
    nodes: &HashMap<NodeId, Address>,
    node_peers: &HashMap<NodeId, Vec<PeerId>>,
) -> Result<Vec<(NodeId, Vec<PeerId>)>, GlobalCollectiveError> {
    let mut ring = Vec::with_capacity(nodes.len());
    for id in nodes.keys() {
        let mut peers = node_peers
            .get(id)
            .cloned()
            .ok_or(GlobalCollectiveError::WrongOrchestratorResponse)?;
        if peers.is_empty() {
            return Err(GlobalCollectiveError::WrongOrchestratorResponse);
        }
        peers.sort_by_key(|p| p.0);
        ring.push((*id, peers));
    }
    ring.sort_by_key(|(_, peers)| peers[0].0);
    // contiguous: every node's highest PeerId is below the next node's lowest one
    for pair in ring.windows(2) {
        if pair[0].1.last().unwrap().0 >= pair[1].1[0].0 {
            return Err(GlobalCollectiveError::PeersNotContiguous);
        }
    }
    Ok(ring)
}

/// The position of `node` in the ring, and the address and id of the node before it.
fn ring_neighbours(
    node: NodeId,
    ring: &[(NodeId, Vec<PeerId>)],
    nodes: &HashMap<NodeId, Address>,
) -> Result<(usize, Address, NodeId), GlobalCollectiveError> {
    let pos = ring
        .iter()
        .position(|(id, _)| *id == node)
        .ok_or(GlobalCollectiveError::WrongOrchestratorResponse)?;
    let prev = ring[(pos + ring.len() - 1) % ring.len()].0;
    let addr = nodes
        .get(&prev)
        .cloned()
        .ok_or(GlobalCollectiveError::WrongOrchestratorResponse)?;
    Ok((pos, addr, prev))
}

/// Ring all-gather of one 1-D piece per node. Returns every node's piece, in ring order.
///
/// Step s (0..M-1): the node at ring position r exposes piece (r - s) mod M (its own at step
/// 0, then the one it received last) and downloads piece (r - 1 - s) mod M from the node
/// before it. Pieces travel as host data and may be empty.
pub(crate) async fn ring_all_gather<B, P>(
    node: NodeId,
    ring: &[(NodeId, Vec<PeerId>)],
    nodes: &HashMap<NodeId, Address>,
    data_service: &Arc<TensorDataService<B, P>>,
    sync_service: &SyncService<P>,
    piece: TensorData,
    dtype: DType,
) -> Result<Vec<TensorData>, GlobalCollectiveError>
where
    B: Backend,
    P: Protocol,
{
    let m = ring.len();
    let (pos, prev_addr, prev_id) = ring_neighbours(node, ring, nodes)?;
    let mut pieces: Vec<Option<TensorData>> = vec![None; m];
    pieces[pos] = Some(piece);

    for step in 0..m.saturating_sub(1) {
        let transfer_id = (step as u64).into();
        let send = (pos + m - step) % m;
        let recv = (pos + 2 * m - 1 - step) % m;
        let data = pieces[send]
            .clone()
            .expect("the piece received at the last step");
        data_service.expose_data(data, 1, transfer_id).await;

        let data = data_service
            .download_tensor(prev_addr.clone(), transfer_id)
            .await
            .ok_or(GlobalCollectiveError::PeerLost(prev_id))?;
        if data.dtype != dtype || data.shape.num_dims() != 1 {
            return Err(GlobalCollectiveError::PeerSentIncoherentTensor);
        }
        pieces[recv] = Some(data);
    }

    sync_service.sync().await?;
    Ok(pieces
        .into_iter()
        .map(|p| p.expect("every piece came around the ring"))
        .collect())
}

/// Ring reduce-scatter (sum) across nodes of one tensor per node (the sum of its peers'),
/// where the node at ring position n gets the slice `node_ranges[n]`. Returns this node's
/// summed slice, on the tensor's device, or None when it is empty.
///
/// Step s (0..M-1): the node at ring position r exposes its running sum of slice
/// (r - 1 - s) mod M (its own part at step 0) and downloads the previous node's running sum
/// of slice (r - 2 - s) mod M, to which it adds its own part. Slice k is thus summed as
/// `((S[k+1] + S[k+2]) + ...) + S[k]` over ring positions. Empty slices are never sent
/// (every node knows the ranges, so the receiver skips them too).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn ring_reduce_scatter<B, P>(
    node: NodeId,
    ring: &[(NodeId, Vec<PeerId>)],
    nodes: &HashMap<NodeId, Address>,
    data_service: &Arc<TensorDataService<B, P>>,
    sync_service: &SyncService<P>,
    tensor: B::FloatTensorPrimitive,
    node_ranges: &[Range<usize>],
) -> Result<Option<B::FloatTensorPrimitive>, GlobalCollectiveError>
where
    B: Backend,
    P: Protocol,
{
    let m = ring.len();
    let (pos, prev_addr, prev_id) = ring_neighbours(node, ring, nodes)?;
    let device = B::float_device(&tensor);
    let dtype = tensor.dtype();
    let part = |j: usize| slice_1d::<B>(tensor.clone(), node_ranges[j].clone());

    let first = (pos + m - 1) % m;
    let mut held = (!node_ranges[first].is_empty()).then(|| part(first));

    for step in 0..m.saturating_sub(1) {
        let transfer_id = (step as u64).into();
        let recv = (pos + 2 * m - 2 - step) % m;
        if let Some(sum) = held.take() {
            data_service.expose(sum, 1, transfer_id).await;
        }
        if node_ranges[recv].is_empty() {
            continue;
        }
        let data = data_service
            .download_tensor(prev_addr.clone(), transfer_id)
            .await
            .ok_or(GlobalCollectiveError::PeerLost(prev_id))?;
        if data.dtype != dtype
            || data.shape.num_dims() != 1
            || data.shape[0] != node_ranges[recv].len()
        {
            return Err(GlobalCollectiveError::PeerSentIncoherentTensor);
        }
        let received = B::float_from_data(data, &device);
        held = Some(B::float_add(received, part(recv)));
    }

    sync_service.sync().await?;
    Ok(held)
}
