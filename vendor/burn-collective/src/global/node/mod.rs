pub mod base;
pub mod centralized;
pub mod gather_scatter;
pub mod ring;
pub mod sync;
pub mod tree;
pub mod worker;
