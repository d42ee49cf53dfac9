//! Data parallelism: several workers train one model on their shares of every global batch
//! and keep identical weights by summing their gradients (burn-collective's all-reduce).
//!
//! - [`World`]: who this worker is (rank, world size) and its collective calls; a world of one
//!   makes every call a no-op, so single-device runs take exactly the code path they always did.
//! - [`sync`]: the trainer's collective steps: gradients all-reduced in a few large flat
//!   buckets, per-step scalars (trained-token count, loss sum) summed in one call.
//! - [`launch`]: `tune run --nproc_per_node N [--nnodes M --node_rank R --rdzv_endpoint H:P]`:
//!   one process per node, one worker thread per device, the first failure ends the run; each
//!   worker's error says how it ended the run ([`WorkerError`], [`Ending`]).
//!
//! Which of burn 0.21's engines serves where: burn-collective's local server sums the tensors of
//! the workers of one process (on CPU they share the Flex backend; on CUDA each owns a device),
//! and its global orchestrator (WebSocket, hosted by node 0 at `--rdzv_endpoint`) joins the
//! nodes. burn's `distributed` feature (NCCL inside backward) is CUDA-only and needs a
//! `DistributedBackend` type threaded through every model type; it is not used yet.

mod ending;
pub mod launch;
mod launch_error;
mod liveness;
pub mod sync;
mod world;

pub use ending::{Ending, Ends, WorkerError};
pub use world::{DistributedError, World};
