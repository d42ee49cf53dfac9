//! Every config key tune reads, each declared once (`config::keys`), section by section, with
//! the rules that span keys beside the keys they read. What validation returns is these typed
//! structs: setup reads them and checks nothing again.

mod checkpointer;
mod dataset;
mod generate;
mod grpo;
mod logging;
mod loss;
mod model;
mod optimizer;
pub mod ppo;
mod quantizer;
mod tokenizer;
mod train;

pub use checkpointer::{CheckpointFiles, CheckpointFilesFormat, CheckpointerConfig, StrOrInt};
pub use dataset::{DatasetConfig, Datasets};
pub use generate::{GenerateConfig, Prompt, PromptTurns};
pub use grpo::{GrpoKeys, RewardConfig};
pub use logging::{MetricLoggerConfig, ProfilerConfig};
pub use loss::LossConfig;
pub use model::{LoraModule, ModelConfig};
pub use optimizer::{LrSchedulerConfig, OptimizerConfig};
pub use ppo::PpoKeys;
pub use quantizer::QuantizerConfig;
pub use tokenizer::{TemplateChoice, TokenizerConfig, TruncationType};
pub use train::{
    Attention, Device, FsdpBlock, FullDpoKeys, KdKeys, PushToHub, QatKeys, RecipeKeys, TrainConfig,
};

use crate::config::keys::{Fingerprint, FingerprintEntries};
use crate::config::recipes::Recipe;

/// A validated config for one recipe.
#[derive(Debug, Clone, PartialEq)]
pub enum RecipeConfig {
    /// A training recipe: the keys every one reads, and its own.
    Train(RecipeKeys, Box<TrainConfig>),
    Generate(Box<GenerateConfig>),
}

impl RecipeConfig {
    pub fn recipe(&self) -> Recipe {
        match self {
            Self::Train(keys, _) => keys.recipe(),
            Self::Generate(_) => Recipe::Generate,
        }
    }

    pub fn as_train(&self) -> Option<&TrainConfig> {
        match self {
            Self::Train(_, t) => Some(t),
            Self::Generate(_) => None,
        }
    }

    pub fn as_generate(&self) -> Option<&GenerateConfig> {
        match self {
            Self::Generate(g) => Some(g),
            Self::Train(..) => None,
        }
    }
}

/// A training run's fingerprint entries, as its keys declare them (see `keys::Fingerprint`).
pub fn fingerprint_entries(cfg: &TrainConfig, own: &RecipeKeys) -> FingerprintEntries {
    let mut out = FingerprintEntries::default();
    cfg.fingerprint_keys("", Fingerprint::Inherit, &mut out);
    own.fingerprint_keys(&mut out);
    out
}
