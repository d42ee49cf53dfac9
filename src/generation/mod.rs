//! Text generation: a decoding loop over the KV cache and the token sampler. Runs on any
//! backend; recipes use the non-autodiff one since nothing here needs gradients.

pub mod decode;
pub mod group;
pub mod sampling;

pub use decode::{Decoder, GenerateOptions, Generation, StopReason, generate};
pub use group::{GroupPrompt, GroupSampling, SampledGroup, sample_group, sample_groups};
pub use sampling::{Sampler, SamplingParams};

/// A prompt the model can take: at least one token, every id inside its `vocab`.
pub fn check_prompt(tokens: &[u32], vocab: usize) -> Result<(), GenerateError> {
    if tokens.is_empty() {
        return Err(GenerateError::EmptyPrompt);
    }
    match tokens.iter().find(|&&id| id as usize >= vocab) {
        Some(&id) => Err(GenerateError::TokenOutOfRange { id, vocab }),
        None => Ok(()),
    }
}

#[derive(Debug, thiserror::Error)]
pub enum GenerateError {
    #[error("the prompt is empty: give at least one token (e.g. a non-empty prompt.user)")]
    EmptyPrompt,
    #[error(
        "token id {id} is outside the model's vocabulary of {vocab}; is the tokenizer from the same model as the checkpoint?"
    )]
    TokenOutOfRange { id: u32, vocab: usize },
    #[error("{0}")]
    BadSampling(String),
    /// The tokens are not what the model computes (see `device::DeviceFault`).
    #[error("the generated tokens cannot be trusted: {0}")]
    Device(crate::device::DeviceFault),
}
