mod all_gather;
mod all_reduce;
mod broadcast;
mod reduce;
mod reduce_scatter;

pub(crate) mod tensor_map;

pub(crate) use all_gather::*;
pub(crate) use all_reduce::*;
pub(crate) use broadcast::*;
pub(crate) use reduce::*;
pub(crate) use reduce_scatter::*;

pub(crate) mod client;
pub(crate) mod server;
