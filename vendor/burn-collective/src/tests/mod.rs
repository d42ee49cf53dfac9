mod all_reduce;
mod broadcast;
mod gather_scatter;
#[cfg(feature = "orchestrator")]
mod multi_node;
mod reduce;
