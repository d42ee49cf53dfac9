//! Direct Preference Optimization (torchtune's `rlhf.loss.DPOLoss`, the sigmoid form, and the
//! DPO recipes' `concatenated_forward`).
//!
//! A preference batch holds the chosen rows first and the rejected rows after them
//! (`data::collate_preference`), so one forward pass scores both. Each row's score is the sum of
//! its response tokens' log-probabilities. The reference scores carry no gradient: for LoRA the
//! reference is the same model with its adapters switched off (no second copy of the weights);
//! for full DPO it is a frozen model on the non-autodiff backend.

use crate::training::metrics::MetricName;
use burn::tensor::Tensor;
use burn::tensor::activation::log_sigmoid;
use burn::tensor::backend::{AutodiffBackend, Backend};

use super::activation_checkpointing::{self, Checkpointing};
use super::error::TrainError;
use super::load_balancing;
use super::loss::sequence_log_probs;
use super::loss_step::{EvalOutput, LossStep, StepInfo, StepOutput};
use super::sft::token_batch;
use crate::data::Batch;
use crate::models::CausalLm;
use crate::modules::ForwardMode;

/// `DPOLoss(beta, label_smoothing)`; torchtune's defaults are 0.1 and 0.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DpoSettings {
    /// How far the policy may drift from the reference (the KL penalty's inverse temperature).
    pub beta: f64,
    /// Conservative DPO: the assumed probability that a pair's preference label is flipped.
    pub label_smoothing: f64,
}

/// Per-pair results of the DPO loss, each `[pairs]`.
pub struct DpoTerms<B: Backend> {
    pub losses: Tensor<B, 1>,
    /// `beta * (policy_chosen - reference_chosen)`, detached.
    pub chosen_rewards: Tensor<B, 1>,
    /// `beta * (policy_rejected - reference_rejected)`, detached.
    pub rejected_rewards: Tensor<B, 1>,
}

/// The DPO loss from sequence log-probabilities:
/// `-logsigmoid(beta * logits) * (1 - ls) - logsigmoid(-beta * logits) * ls` with
/// `logits = (policy_chosen - policy_rejected) - (reference_chosen - reference_rejected)`.
pub fn dpo_loss<B: Backend>(
    settings: DpoSettings,
    policy_chosen: Tensor<B, 1>,
    policy_rejected: Tensor<B, 1>,
    reference_chosen: Tensor<B, 1>,
    reference_rejected: Tensor<B, 1>,
) -> DpoTerms<B> {
    let DpoSettings {
        beta,
        label_smoothing,
    } = settings;
    let logits = (policy_chosen.clone() - policy_rejected.clone())
        - (reference_chosen.clone() - reference_rejected.clone());
    let mut losses = log_sigmoid(logits.clone() * beta).neg() * (1.0 - label_smoothing);
    // Skipping the smoothing term when it is zero keeps the graph (and the gradient) exactly
    // torchtune's for the default.
    if label_smoothing != 0.0 {
        losses = losses - log_sigmoid(logits.neg() * beta) * label_smoothing;
    }
    DpoTerms {
        losses,
        chosen_rewards: (policy_chosen - reference_chosen).detach() * beta,
        rejected_rewards: (policy_rejected - reference_rejected).detach() * beta,
    }
}

/// Sequence log-probabilities of a preference batch, split into its chosen and rejected halves.
pub struct PairLogProbs<B: Backend> {
    /// `[pairs]`
    pub chosen: Tensor<B, 1>,
    /// `[pairs]`
    pub rejected: Tensor<B, 1>,
}

/// Pairs in a preference batch: its rows are chosen then rejected, so there must be an even
/// number of them.
pub fn pairs_in(batch: &Batch) -> Result<usize, TrainError> {
    if batch.batch_size == 0 || !batch.batch_size.is_multiple_of(2) {
        return Err(TrainError::NotPreferencePairs {
            rows: batch.batch_size,
        });
    }
    Ok(batch.batch_size / 2)
}

/// One forward pass over chosen and rejected rows together; returns the per-row sequence
/// log-probabilities split in halves, and the full-vocabulary logits for metrics.
pub fn concatenated_forward<B: Backend>(
    model: &CausalLm<B>,
    batch: &Batch,
    mode: ForwardMode,
) -> Result<(PairLogProbs<B>, Tensor<B, 3>), TrainError> {
    let pairs = pairs_in(batch)?;
    let logits = model.forward(token_batch(batch), mode);
    Ok((pair_log_probs(logits.clone(), &batch.labels, pairs), logits))
}

/// Sequence log-probabilities of `[chosen; rejected]` rows, split in halves.
fn pair_log_probs<B: Backend>(
    logits: Tensor<B, 3>,
    labels: &[i64],
    pairs: usize,
) -> PairLogProbs<B> {
    let all = sequence_log_probs(logits, labels);
    PairLogProbs {
        chosen: all.clone().narrow(0, 0, pairs),
        rejected: all.narrow(0, pairs, pairs),
    }
}

/// What the reference scores come from.
pub enum DpoReference<B: AutodiffBackend> {
    /// LoRA DPO: the policy itself with its adapters disabled.
    AdaptersDisabled,
    /// Full DPO: a frozen model, kept off the autodiff graph.
    Frozen(Box<CausalLm<B::InnerBackend>>),
}

/// Everything one DPO step computes, for the loss step and for tests.
pub struct DpoForward<B: AutodiffBackend> {
    pub policy: PairLogProbs<B>,
    /// Detached.
    pub reference: PairLogProbs<B>,
    pub terms: DpoTerms<B>,
    /// Means of the policy's logits over the chosen and the rejected rows (torchtune's
    /// `logits/chosen`, `logits/rejected`), detached, `[1]` each.
    pub logits_mean: (Tensor<B, 1>, Tensor<B, 1>),
}

/// The DPO loss step shared by the LoRA and full DPO recipes.
pub struct DpoLoss<B: AutodiffBackend> {
    pub settings: DpoSettings,
    pub reference: DpoReference<B>,
    /// `enable_activation_checkpointing`: recompute each policy layer in the backward pass.
    pub activation_checkpointing: Checkpointing,
}

impl<B: AutodiffBackend> DpoLoss<B> {
    pub fn new(settings: DpoSettings, reference: DpoReference<B>) -> Self {
        Self {
            settings,
            reference,
            activation_checkpointing: Checkpointing::Off,
        }
    }

    fn reference_log_probs(
        &self,
        model: &CausalLm<B>,
        batch: &Batch,
    ) -> Result<PairLogProbs<B>, TrainError> {
        let mode = ForwardMode {
            adapters: false,
            fake_quant: true,
            train: false,
        };
        Ok(match &self.reference {
            DpoReference::AdaptersDisabled => {
                let (lp, _) = concatenated_forward(model, batch, mode)?;
                PairLogProbs {
                    chosen: lp.chosen.detach(),
                    rejected: lp.rejected.detach(),
                }
            }
            DpoReference::Frozen(reference) => {
                let (lp, _) = concatenated_forward(reference, batch, mode)?;
                super::parallel::fsdp::check(reference)?;
                PairLogProbs {
                    chosen: Tensor::from_inner(lp.chosen),
                    rejected: Tensor::from_inner(lp.rejected),
                }
            }
        })
    }

    /// Policy and reference scores and the loss terms for one preference batch.
    pub fn forward(&self, model: &CausalLm<B>, batch: &Batch) -> Result<DpoForward<B>, TrainError> {
        let pairs = pairs_in(batch)?;
        let reference = self.reference_log_probs(model, batch)?;
        let logits = model.forward(token_batch(batch), POLICY_MODE);
        Ok(self.score(logits, reference, pairs, &batch.labels))
    }

    /// The loss terms from the policy's logits over the concatenated `[chosen; rejected]` rows.
    fn score(
        &self,
        logits: Tensor<B, 3>,
        reference: PairLogProbs<B>,
        pairs: usize,
        labels: &[i64],
    ) -> DpoForward<B> {
        let policy = pair_log_probs(logits.clone(), labels, pairs);
        let logits_mean = logits_means(logits, pairs);
        let terms = dpo_loss(
            self.settings,
            policy.chosen.clone(),
            policy.rejected.clone(),
            reference.chosen.clone(),
            reference.rejected.clone(),
        );
        DpoForward {
            policy,
            reference,
            terms,
            logits_mean,
        }
    }
}

/// Means of the logits over the chosen rows and over the rejected rows, in fp32, detached.
fn logits_means<B: Backend>(logits: Tensor<B, 3>, pairs: usize) -> (Tensor<B, 1>, Tensor<B, 1>) {
    let mean = |t: Tensor<B, 3>| crate::precision::to_f32(t.detach()).mean();
    (
        mean(logits.clone().narrow(0, 0, pairs)),
        mean(logits.narrow(0, pairs, pairs)),
    )
}

/// The policy's forward mode: adapters and fake quantization on, dropout on.
const POLICY_MODE: ForwardMode = ForwardMode {
    adapters: true,
    fake_quant: true,
    train: true,
};

/// torchtune's DPO metrics, each a mean over the pairs of the batch, left on the device (the
/// trainer reads them with the loss, once per step).
pub fn metrics<B: AutodiffBackend>(
    out: &DpoForward<B>,
) -> Vec<(&'static str, Tensor<B::InnerBackend, 1>)> {
    pair_metrics(&out.terms, &out.policy, out.logits_mean.clone())
        .into_iter()
        .map(|(k, v)| (k, v.inner()))
        .collect()
}

/// The DPO metrics from the loss terms, the policy's scores and its logits' means: `[1]`
/// tensors in fp32, detached.
fn pair_metrics<B: Backend>(
    terms: &DpoTerms<B>,
    policy: &PairLogProbs<B>,
    logits_mean: (Tensor<B, 1>, Tensor<B, 1>),
) -> Vec<(&'static str, Tensor<B, 1>)> {
    let f32 = |t: &Tensor<B, 1>| crate::precision::to_f32(t.clone().detach());
    let (chosen, rejected) = (f32(&terms.chosen_rewards), f32(&terms.rejected_rewards));
    let wins = chosen.clone().greater(rejected.clone()).float();
    let margins = chosen.clone() - rejected.clone();
    vec![
        ("rewards/chosen", chosen.mean()),
        ("rewards/rejected", rejected.mean()),
        ("rewards/accuracies", crate::precision::to_f32(wins).mean()),
        ("rewards/margins", margins.mean()),
        ("log_probs/chosen", f32(&policy.chosen).mean()),
        ("log_probs/rejected", f32(&policy.rejected).mean()),
        ("logits/chosen", logits_mean.0),
        ("logits/rejected", logits_mean.1),
    ]
}

impl<B: AutodiffBackend> LossStep<B> for DpoLoss<B> {
    fn step(
        &mut self,
        model: &CausalLm<B>,
        batch: &Batch,
        info: StepInfo,
    ) -> Result<StepOutput<B>, TrainError> {
        let pairs = pairs_in(batch)?;
        let reference = self.reference_log_probs(model, batch)?;
        let mut scored = None;
        // TRL's DPO adds the policy's load-balancing loss over the whole batch (its
        // `attention_mask`: every real token of both halves); the reference's is never computed.
        let pass = activation_checkpointing::loss_and_grads(
            model,
            token_batch(batch),
            POLICY_MODE,
            (self.activation_checkpointing, info.seed),
            pairs as f64,
            load_balancing::aux_loss_coef(model),
            |logits| {
                let out = self.score(logits, reference, pairs, &batch.labels);
                let loss = out.terms.losses.clone().mean();
                scored = Some(out);
                loss
            },
        );
        let out = scored.expect("loss_and_grads calls the loss closure once");
        let mut metrics = metrics(&out);
        metrics.extend(pass.aux_metric());
        Ok(StepOutput {
            loss: pass.loss,
            weight: pairs,
            tokens: batch.tokens.len(),
            metrics,
            grads: pass.grads,
        })
    }

    /// The DPO loss and metrics of validation pairs: the policy without dropout, the reference
    /// as in training.
    fn evaluate(
        &mut self,
        model: &CausalLm<B::InnerBackend>,
        batch: &Batch,
        _info: StepInfo,
    ) -> Result<EvalOutput, TrainError> {
        let pairs = pairs_in(batch)?;
        let policy_mode = ForwardMode {
            train: false,
            ..POLICY_MODE
        };
        let (logits, aux) =
            load_balancing::forward_with_aux(model, token_batch(batch), policy_mode);
        let policy = pair_log_probs(logits.clone(), &batch.labels, pairs);
        let reference_mode = ForwardMode {
            adapters: false,
            fake_quant: true,
            train: false,
        };
        let reference = match &self.reference {
            DpoReference::AdaptersDisabled => concatenated_forward(model, batch, reference_mode)?.0,
            DpoReference::Frozen(frozen) => concatenated_forward(frozen, batch, reference_mode)?.0,
        };
        let terms = dpo_loss(
            self.settings,
            policy.chosen.clone(),
            policy.rejected.clone(),
            reference.chosen,
            reference.rejected,
        );
        // One read for the loss and the metrics.
        let metrics = pair_metrics(&terms, &policy, logits_means(logits, pairs));
        let mut values = vec![crate::precision::to_f32(terms.losses.mean())];
        values.extend(metrics.iter().map(|(_, v)| v.clone()));
        let values: Vec<f64> = Tensor::cat(values, 0).into_data().iter::<f64>().collect();
        let metrics = metrics
            .iter()
            .map(|(k, _)| MetricName::Borrowed(*k))
            .zip(values[1..].iter().copied())
            .collect();
        let (loss, metrics) = load_balancing::with_aux(values[0], metrics, aux);
        Ok(EvalOutput {
            loss,
            weight: pairs,
            metrics,
        })
    }
}
