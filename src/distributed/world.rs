//! One worker's place in a data-parallel run and its collective calls.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};

/// A collective call failed, or the world could not be formed.
#[derive(Debug, thiserror::Error)]
pub enum DistributedError {
    #[error(
        "joining the collective failed ({detail}); every worker must use the same --nproc_per_node and --nnodes"
    )]
    Join { rank: usize, detail: String },
    #[error("the all-reduce of {what} failed ({detail})")]
    AllReduce {
        rank: usize,
        what: &'static str,
        detail: String,
    },
    #[error("the all-gather of {what} failed ({detail})")]
    AllGather {
        rank: usize,
        what: &'static str,
        detail: String,
    },
    #[error("the reduce-scatter of {what} failed ({detail})")]
    ReduceScatter {
        rank: usize,
        what: &'static str,
        detail: String,
    },
    #[error(
        "the workers of this run were started with a different {what}; start every node with the same tune binary and the same config and overrides"
    )]
    Mismatch { rank: usize, what: &'static str },
}

impl DistributedError {
    /// The collective call itself failed (not a refusal such as different configs).
    pub fn is_transport(&self) -> bool {
        matches!(
            self,
            Self::AllReduce { .. }
                | Self::AllGather { .. }
                | Self::ReduceScatter { .. }
                | Self::Join { .. }
        )
    }
}

/// Where the nodes of a multi-node run meet (burn-collective's global orchestrator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeLink {
    pub num_nodes: usize,
    /// `ws://host:port` of the orchestrator node 0 hosts.
    pub orchestrator: String,
    /// `ws://host:port` where this node serves its tensors to the others.
    pub node_address: String,
    pub data_port: u16,
}

/// This worker's rank among `size` workers (global), and how to reach the others.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    pub rank: usize,
    pub size: usize,
    /// Workers in this process (one node).
    pub local_size: usize,
    pub nodes: Option<NodeLink>,
}

impl Default for World {
    fn default() -> Self {
        Self::single()
    }
}

impl World {
    /// One device: every collective call is a no-op.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_size: 1,
            nodes: None,
        }
    }

    /// Rank 0 logs, reports, writes the model and pushes.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    pub fn is_distributed(&self) -> bool {
        self.size > 1
    }

    fn peer(&self) -> PeerId {
        PeerId(self.rank as u32)
    }

    fn config(&self) -> CollectiveConfig {
        let config = CollectiveConfig::default().with_num_devices(self.local_size);
        let Some(link) = &self.nodes else {
            return config;
        };
        let parse = |s: &str| s.parse().unwrap_or_else(|e: String| panic!("{e}"));
        config
            .with_num_nodes(link.num_nodes as u32)
            .with_global_address(parse(&link.orchestrator))
            .with_node_address(parse(&link.node_address))
            .with_data_service_port(link.data_port)
    }

    /// Registers this worker with burn-collective on backend `B` (the backend the gradients
    /// live on: the inner backend of an autodiff one). Returns once every worker of the world
    /// has joined.
    pub fn join<B: Backend>(&self, device: &B::Device) -> Result<(), DistributedError> {
        if !self.is_distributed() {
            return Ok(());
        }
        burn_collective::register::<B>(self.peer(), device.clone(), self.config()).map_err(|e| {
            DistributedError::Join {
                rank: self.rank,
                detail: format!("{e:?}"),
            }
        })
    }

    /// Leaves the collective at the end of a run.
    pub fn leave<B: Backend>(&self) {
        if self.is_distributed() {
            // A worker that leaves after a failure elsewhere has nothing to report.
            let _ = burn_collective::finish_collective::<B>(self.peer());
        }
    }

    /// The element-wise sum of `tensor` over every worker; every worker gets the same result.
    pub fn all_reduce_sum<B: Backend>(
        &self,
        tensor: Tensor<B, 1>,
        what: &'static str,
    ) -> Result<Tensor<B, 1>, DistributedError> {
        if !self.is_distributed() {
            return Ok(tensor);
        }
        // The global ring all-reduce splits a tensor into one slice per node and refuses one
        // with fewer elements than nodes: short tensors travel padded with zeros.
        let len = tensor.shape().num_elements();
        let tensor = if len < self.size {
            let pad = Tensor::<B, 1>::zeros([self.size - len], &tensor.device());
            let pad = crate::precision::to_dtype(pad, tensor.dtype());
            Tensor::cat(vec![tensor, pad], 0)
        } else {
            tensor
        };
        let summed = burn_collective::all_reduce::<B>(
            self.peer(),
            tensor.into_primitive().tensor(),
            ReduceOperation::Sum,
        )
        .map_err(|e| DistributedError::AllReduce {
            rank: self.rank,
            what,
            detail: format!("{e:?}"),
        })?;
        let summed = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(summed));
        Ok(if len < self.size {
            summed.slice(0..len)
        } else {
            summed
        })
    }

    /// Every rank's `piece` (lengths may differ, and may be 0), concatenated in rank order, on
    /// every rank.
    pub fn all_gather<B: Backend>(
        &self,
        piece: Tensor<B, 1>,
        what: &'static str,
    ) -> Result<Tensor<B, 1>, DistributedError> {
        if !self.is_distributed() {
            return Ok(piece);
        }
        let gathered =
            burn_collective::all_gather::<B>(self.peer(), piece.into_primitive().tensor())
                .map_err(|e| DistributedError::AllGather {
                    rank: self.rank,
                    what,
                    detail: format!("{e:?}"),
                })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(gathered)))
    }

    /// The element-wise sum of `tensor` over every rank, of which rank `k` gets elements
    /// `sizes[..k].sum()..sizes[..=k].sum()` (`sizes` has one length per rank, summing to the
    /// tensor's length, the same on every rank).
    pub fn reduce_scatter_sum<B: Backend>(
        &self,
        tensor: Tensor<B, 1>,
        sizes: &[usize],
        what: &'static str,
    ) -> Result<Tensor<B, 1>, DistributedError> {
        if !self.is_distributed() {
            return Ok(tensor);
        }
        let scattered = burn_collective::reduce_scatter::<B>(
            self.peer(),
            tensor.into_primitive().tensor(),
            ReduceOperation::Sum,
            sizes.to_vec(),
        )
        .map_err(|e| DistributedError::ReduceScatter {
            rank: self.rank,
            what,
            detail: format!("{e:?}"),
        })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(scattered)))
    }
}
