use burn_backend::Backend;
use burn_communication::Protocol;
use burn_communication::data_service::TensorDataServer;
use burn_communication::{Address, ProtocolServer, data_service::TensorDataService};
use std::collections::HashMap;
use std::{marker::PhantomData, sync::Arc};
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

use crate::node::gather_scatter::{node_ring, ring_all_gather, ring_reduce_scatter};
use crate::node::sync::SyncService;
use crate::{
    AllReduceStrategy, PeerId, ReduceOperation,
    global::{
        node::{
            centralized::centralized_all_reduce_sum, ring::ring_all_reduce_sum,
            tree::tree_all_reduce_sum, worker::GlobalClientWorker,
        },
        shared::{GlobalCollectiveError, RemoteRequest, RemoteResponse},
    },
    local::server::get_collective_server_runtime,
};
use crate::{BroadcastStrategy, GlobalRegisterParams, NodeId, ReduceStrategy};
use crate::{
    CollectiveError,
    local::{apply_mean, size_ranges, slice_1d},
};
use burn_backend::TensorData;
use burn_std::DType;
use std::ops::Range;

/// Must be synchronized between all nodes for collective operations to work
pub(crate) struct NodeState {
    pub node_id: NodeId,
    pub nodes: HashMap<NodeId, Address>,
    pub num_global_devices: u32,
    /// tune's patch: each node's peers, for the ring order of all-gather and reduce-scatter
    pub node_peers: HashMap<NodeId, Vec<PeerId>>,
}

/// A node talks to the global orchestrator as well as other nodes with a peer-to-peer service
pub(crate) struct Node<B, P>
where
    B: Backend,
    P: Protocol,
{
    // State is written during `register` and read during other operations,
    // sometimes by multiple threads (ex. syncing during an all-reduce)
    state: Arc<RwLock<Option<NodeState>>>,
    data_service: Arc<TensorDataService<B, P>>,
    sync_service: Arc<SyncService<P>>,
    worker: GlobalClientWorker<P::Client>,
    _n: PhantomData<P>,
}

impl<B, P> Node<B, P>
where
    B: Backend,
    P: Protocol,
{
    pub fn new(global_address: &Address, comms_server: P::Server) -> Self {
        let state = Arc::new(tokio::sync::RwLock::new(None));
        let cancel_token = CancellationToken::new();
        let data_service = Arc::new(TensorDataService::new(cancel_token.clone()));
        let sync_service = Arc::new(SyncService::new(state.clone()));

        let runtime = get_collective_server_runtime();
        let server = comms_server
            .route_tensor_data_service(data_service.clone())
            .route("/sync", {
                let sync_service = sync_service.clone();
                async move |channel: <P::Server as ProtocolServer>::Channel| {
                    sync_service.handle_sync_connection(channel).await;
                }
            })
            .serve({
                let cancel_token = cancel_token.clone();
                async move { cancel_token.cancelled().await }
            });

        runtime.spawn(server);

        let worker = GlobalClientWorker::new(&runtime, cancel_token.clone(), global_address);

        Self {
            state,
            data_service,
            sync_service,
            worker,
            _n: PhantomData,
        }
    }

    pub async fn register(
        &mut self,
        peers: Vec<PeerId>,
        global_params: GlobalRegisterParams,
    ) -> Result<(), GlobalCollectiveError> {
        let req = RemoteRequest::Register {
            node_addr: global_params.node_address,
            num_nodes: global_params.num_nodes,
            peers,
        };
        match self.worker.request(req).await {
            RemoteResponse::Register {
                node_id,
                nodes,
                num_global_devices,
                node_peers,
            } => {
                let mut state = self.state.write().await;
                *state = Some(NodeState {
                    node_id,
                    nodes,
                    num_global_devices,
                    node_peers,
                });
            }
            RemoteResponse::Error(err) => {
                return Err(err);
            }
            resp => {
                log::error!("Response to a register request should be an ack, not {resp:?}");
                return Err(GlobalCollectiveError::WrongOrchestratorResponse);
            }
        }

        Ok(())
    }

    /// Performs an all-reduce
    ///
    /// Reads the NodeState
    pub async fn all_reduce(
        &self,
        tensor: B::FloatTensorPrimitive,
        strategy: AllReduceStrategy,
        op: ReduceOperation,
    ) -> Result<B::FloatTensorPrimitive, GlobalCollectiveError> {
        let state = self.state.read().await;
        let Some(ref state) = *state else {
            return Err(GlobalCollectiveError::AllReduceBeforeRegister);
        };
        let node = state.node_id;
        let nodes = &state.nodes;

        let mut result = match strategy {
            AllReduceStrategy::Centralized => {
                centralized_all_reduce_sum(
                    node,
                    nodes,
                    &self.data_service,
                    self.sync_service.clone(),
                    tensor,
                )
                .await?
            }
            AllReduceStrategy::Tree(arity) => {
                tree_all_reduce_sum(
                    node,
                    nodes,
                    self.data_service.clone(),
                    self.sync_service.clone(),
                    tensor,
                    arity,
                )
                .await?
            }
            AllReduceStrategy::Ring => {
                ring_all_reduce_sum(
                    node,
                    nodes,
                    self.data_service.clone(),
                    self.sync_service.clone(),
                    tensor,
                )
                .await?
            }
        };

        if op == ReduceOperation::Mean {
            result = B::float_div_scalar(result, (state.num_global_devices as f32).into());
        }

        Ok(result)
    }

    /// tune's patch: all-gather of one 1-D piece per node (see `gather_scatter.rs`). Returns
    /// every node's piece, ordered by the nodes' lowest PeerId.
    pub async fn all_gather(
        &self,
        piece: TensorData,
        dtype: DType,
    ) -> Result<Vec<TensorData>, GlobalCollectiveError> {
        let state = self.state.read().await;
        let Some(ref state) = *state else {
            return Err(GlobalCollectiveError::AllReduceBeforeRegister);
        };
        let ring = node_ring(&state.nodes, &state.node_peers)?;
        ring_all_gather(
            state.node_id,
            &ring,
            &state.nodes,
            &self.data_service,
            &self.sync_service,
            piece,
            dtype,
        )
        .await
    }

    /// tune's patch: reduce-scatter with several nodes. `peers` are this node's peers in
    /// PeerId order and `inputs` their tensors; `sizes` has one length per peer of all nodes,
    /// in PeerId order. The local tensors are summed in PeerId order on the first peer's
    /// device, the node sums are reduce-scattered around the ring of nodes (a node's slice is
    /// the union of its peers'), and the node's slice is split among its peers, each on its
    /// own device.
    pub async fn reduce_scatter(
        &self,
        peers: &[PeerId],
        inputs: Vec<B::FloatTensorPrimitive>,
        sizes: &[usize],
        op: ReduceOperation,
    ) -> Result<Vec<B::FloatTensorPrimitive>, CollectiveError> {
        let global = CollectiveError::Global;
        let state = self.state.read().await;
        let Some(ref state) = *state else {
            return Err(global(GlobalCollectiveError::AllReduceBeforeRegister));
        };
        let ring = node_ring(&state.nodes, &state.node_peers).map_err(global)?;
        let all_peers: Vec<PeerId> = ring.iter().flat_map(|(_, p)| p.iter().copied()).collect();
        if sizes.len() != all_peers.len() {
            return Err(CollectiveError::ReduceScatterInvalidSizes);
        }
        let peer_ranges = size_ranges(sizes);
        let position = |peer: &PeerId| all_peers.iter().position(|p| p == peer);
        let node_ranges: Vec<Range<usize>> = ring
            .iter()
            .map(|(_, p)| {
                let first = position(&p[0]).expect("the peer is in the ring");
                let last = position(p.last().unwrap()).expect("the peer is in the ring");
                peer_ranges[first].start..peer_ranges[last].end
            })
            .collect();
        let pos = ring
            .iter()
            .position(|(id, _)| *id == state.node_id)
            .ok_or(global(GlobalCollectiveError::WrongOrchestratorResponse))?;
        if ring[pos].1 != peers {
            return Err(global(GlobalCollectiveError::WrongOrchestratorResponse));
        }

        // this node's sum, in PeerId order, on the first peer's device
        let devices: Vec<_> = inputs.iter().map(B::float_device).collect();
        let mut sum = inputs[0].clone();
        for input in &inputs[1..] {
            sum = B::float_add(sum, B::float_to_device(input.clone(), &devices[0]));
        }

        let node_slice = ring_reduce_scatter(
            state.node_id,
            &ring,
            &state.nodes,
            &self.data_service,
            &self.sync_service,
            sum,
            &node_ranges,
        )
        .await
        .map_err(global)?;

        let node_start = node_ranges[pos].start;
        let count = all_peers.len();
        Ok(peers
            .iter()
            .zip(inputs)
            .zip(devices)
            .map(|((peer, input), device)| {
                let range = peer_ranges[position(peer).expect("the peer is in the ring")].clone();
                match &node_slice {
                    Some(slice) if !range.is_empty() => {
                        let local = range.start - node_start..range.end - node_start;
                        let mine = slice_1d::<B>(slice.clone(), local);
                        apply_mean::<B>(B::float_to_device(mine, &device), op, count)
                    }
                    _ => slice_1d::<B>(input, 0..0),
                }
            })
            .collect())
    }

    pub async fn reduce(
        &self,
        _tensor: B::FloatTensorPrimitive,
        _strategy: ReduceStrategy,
        _root: PeerId,
        _op: ReduceOperation,
    ) -> Result<Option<B::FloatTensorPrimitive>, GlobalCollectiveError> {
        unimplemented!("Global reduce unimplemented");
    }

    pub async fn broadcast(
        &self,
        _tensor: Option<B::FloatTensorPrimitive>,
        _strategy: BroadcastStrategy,
    ) -> Result<B::FloatTensorPrimitive, GlobalCollectiveError> {
        unimplemented!("Global broadcast unimplemented");
    }

    pub async fn finish(&mut self) {
        let res = self.worker.close_connection().await;
        if let Err(err) = res {
            log::error!("Global collective client error: {err:?}");
        }
        self.data_service.close().await;
    }
}
