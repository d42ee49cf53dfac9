//! The load-balancing loss of a mixture-of-experts model, as a training objective: whether a
//! pass adds it (the checkpoint's config.json has `output_router_logits: true`), with which
//! coefficient (`router_aux_loss_coef`), and an evaluation pass's value of it.
//!
//! Every training recipe adds it where its reference does: the SFT steps as transformers'
//! `*ForCausalLM` adds it to the cross-entropy, DPO and GRPO as TRL's trainers add
//! `router_aux_loss_coef * aux_loss` to each micro-batch's loss, KD and PPO to the trained
//! model's (the student's, the policy's) loss in the same way. What is never added: the term of
//! a frozen model (a reference, a teacher) and of PPO's value model (transformers'
//! `*ForSequenceClassification` returns no auxiliary loss). The training passes' term is
//! [`activation_checkpointing::loss_and_grads`](super::activation_checkpointing::loss_and_grads)'s
//! (and the SFT step's chunked form, [`sft::loss_with_aux`](super::sft::loss_with_aux)); the
//! statistics themselves are [`RouterLoad`](crate::models::moe::RouterLoad)'s.

use crate::training::metrics::MetricName;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

use crate::models::{CausalLm, TokenBatch};
use crate::modules::ForwardMode;

/// `router_aux_loss_coef` when the model's config.json asks for the load-balancing loss
/// (`output_router_logits: true` on a mixture-of-experts model).
pub fn aux_loss_coef<B: Backend>(model: &CausalLm<B>) -> Option<f64> {
    model.args.moe.as_ref().and_then(|moe| moe.aux_loss_coef)
}

/// The load-balancing term of an evaluation pass: its coefficient and the loss alone.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AuxTerm {
    pub coef: f64,
    pub aux_loss: f64,
}

impl AuxTerm {
    /// What the term adds to the pass's loss.
    pub fn weighted(self) -> f64 {
        self.coef * self.aux_loss
    }

    /// The term for the log, under transformers' and TRL's name.
    pub fn metric(self) -> (MetricName, f64) {
        ("aux_loss".into(), self.aux_loss)
    }
}

/// The model's hidden states for `input` (before the final norm, [`CausalLm::hidden`]) and,
/// when its config asks for the load-balancing loss, that loss of this pass's routing (over the
/// tokens `input.padding` leaves in).
pub fn hidden_with_aux<B: Backend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
) -> (Tensor<B, 3>, Option<AuxTerm>) {
    let Some(coef) = aux_loss_coef(model) else {
        return (model.hidden(input, mode, None), None);
    };
    let (hidden, load) = model.hidden_with_router_load(input, mode);
    let aux_loss = load.aux_loss().map_or(0.0, |aux| {
        use burn::tensor::ElementConversion;
        aux.into_scalar().elem::<f64>()
    });
    (hidden, Some(AuxTerm { coef, aux_loss }))
}

/// [`hidden_with_aux`] with the logits.
pub fn forward_with_aux<B: Backend>(
    model: &CausalLm<B>,
    input: TokenBatch<'_>,
    mode: ForwardMode,
) -> (Tensor<B, 3>, Option<AuxTerm>) {
    let (hidden, aux) = hidden_with_aux(model, input, mode);
    (model.logits(hidden, mode), aux)
}

/// The loss of an evaluation pass with its load-balancing term, and the metrics with
/// `aux_loss` added.
pub fn with_aux(
    loss: f64,
    mut metrics: Vec<(MetricName, f64)>,
    aux: Option<AuxTerm>,
) -> (f64, Vec<(MetricName, f64)>) {
    let Some(aux) = aux else {
        return (loss, metrics);
    };
    metrics.push(aux.metric());
    (loss + aux.weighted(), metrics)
}
