//! QAT's `quantizer`.

use crate::config::components::Quantizer;
use crate::config::keys::{default, keys};

keys! {
    /// The fake quantization QAT trains under (torchao's QAT quantizers), and the int4 export.
    pub struct QuantizerConfig {
        section: "quantizer",
        component: Quantizer,
    }
    /// Weights per int4 scale group.
    groupsize: usize = default(|| 256).range(|v| v >= 2.0, "at least 2 (e.g. 32)"),
}
