pub(crate) mod node;
pub(crate) mod shared;

#[cfg(feature = "orchestrator")]
pub mod orchestrator;
#[cfg(feature = "orchestrator")]
pub use orchestrator::*;

mod base;
pub use base::*;
// tune's patch: callers can name the errors inside `CollectiveError::Global` (PeerLost, ...)
pub use shared::GlobalCollectiveError;
