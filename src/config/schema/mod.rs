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
mod sampling;
mod tokenizer;
mod train;

pub use checkpointer::{
    CheckpointFiles, CheckpointFilesFormat, CheckpointModelType, CheckpointerConfig, StrOrInt,
};
pub use dataset::{DatasetConfig, Datasets};
pub use generate::{GenerateConfig, Prompt, PromptTurns};
pub use grpo::{
    CommandRewardKeys, FormattingRewardKeys, GrpoKeys, Gsm8kRewardKeys, LengthRewardKeys,
    PlainRewardKeys, RewardCommon, RewardConfig, RewardSettings,
};
pub use logging::{
    DiskLoggerKeys, MetricLoggerConfig, MetricLoggerSettings, ProfilerConfig, StdoutLoggerKeys,
    TensorBoardLoggerKeys,
};
pub use loss::{
    ChunkedKeys, CrossEntropyLoss, CrossEntropySettings, DpoKeys, DpoLoss, DpoSettings, GrpoLoss,
    GrpoSettings, KdLoss, KdSettings, PpoLoss, PpoLossKeys, PpoSettings, SymmetricKlKeys,
    TorchtuneGrpoKeys, TrlGrpoKeys, WholeCrossEntropyLoss, WholeCrossEntropySettings,
    WholeOutputKeys,
};
pub use model::{
    ArchKeys, FullModelKeys, LoraKeys, LoraModelKeys, LoraModule, ModelConfig, ModelSettings,
    refuse_router_training,
};
pub use optimizer::{
    AdamKeys, AdamMoments, AdamWKeys, CosineKeys, LrSchedulerConfig, OptimizerCommon,
    OptimizerConfig, OptimizerSettings, SchedulerSettings, SgdKeys, Warmup, WarmupKeys,
};
pub use ppo::PpoKeys;
pub use quantizer::QuantizerConfig;
pub use sampling::{Rollout, Sampling};
pub use tokenizer::{TemplateChoice, TokenizerConfig, TruncationType};
pub use train::{
    Attention, Device, FsdpBlock, PushToHub, QatKeys, SftKeys, TrainConfig, grpo_train_rules,
};

use crate::config::keys::{Fingerprint, FingerprintEntries};
use crate::config::recipes::{OwnKeys, RecipeSpec};

/// A validated config for one recipe: the recipe, the keys every training recipe reads
/// (`None` for one that does not train), and the recipe's own, typed as it declared them.
#[derive(Debug, Clone)]
pub struct RecipeConfig {
    pub recipe: &'static RecipeSpec,
    pub train: Option<Box<TrainConfig>>,
    pub own: Box<dyn OwnKeys>,
}

impl PartialEq for RecipeConfig {
    fn eq(&self, other: &Self) -> bool {
        self.recipe == other.recipe && self.train == other.train && self.own.eq_box(&*other.own)
    }
}

impl RecipeConfig {
    pub fn as_train(&self) -> Option<&TrainConfig> {
        self.train.as_deref()
    }

    /// The recipe's own keys as the type it declared them (`None` for another type).
    pub fn own<K: 'static>(&self) -> Option<&K> {
        self.own.get::<K>()
    }

    pub fn as_generate(&self) -> Option<&GenerateConfig> {
        self.own::<GenerateConfig>()
    }

    /// The `device` the run asks for (null: the build's default).
    pub fn device(&self) -> Option<Device> {
        match (&self.train, self.as_generate()) {
            (Some(train), _) => train.device,
            (None, Some(generate)) => generate.device,
            (None, None) => None,
        }
    }

    /// A training run's fingerprint entries, as its keys declare them (see
    /// `keys::Fingerprint`); empty for a recipe that does not train.
    pub fn fingerprint_entries(&self) -> FingerprintEntries {
        let mut out = FingerprintEntries::default();
        if let Some(train) = &self.train {
            train.fingerprint_keys("", Fingerprint::Inherit, &mut out);
            self.own.fingerprint_keys(&mut out);
        }
        out
    }
}
