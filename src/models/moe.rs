//! A sparse mixture-of-experts block (Qwen2-MoE, Qwen3-MoE, Mixtral), computed as transformers
//! computes it: a router scores every expert per token, the top-k probabilities of a float32
//! softmax pick the experts (renormalised when the config says so), and each token's output is
//! the probability-weighted sum of its chosen experts' SwiGLU MLPs.
//!
//! Routed, never dense: the choice is read on the host (one transfer of `[tokens, experts]`
//! probabilities per layer, as transformers' `torch.where` over the expert mask syncs too),
//! and each expert that got tokens runs once over exactly those rows, gathered and added back
//! with `kernels::gather_rows` / `add_rows` (burn's `select` / `select_assign`, touching only
//! the expert's rows on the CPU). Its backward is autodiff's of the same ops, so an
//! expert without tokens costs nothing either way, and step time follows the active
//! parameters. The router's gradient comes through the chosen probabilities (`gather`), as in
//! transformers; the choice itself has none.

use burn::module::Module;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};

use super::mlp::Mlp;
use crate::kernels::{add_rows, cast, gather_rows, softmax};
use crate::modules::{ForwardMode, Linear};

#[derive(Module, Debug)]
pub struct SparseMoe<B: Backend> {
    /// The router: one logit per expert (`gate.weight`, `[experts, hidden]`). It is not among
    /// the layer's linears, so LoRA and NF4 leave it alone: it trains in full fine-tuning and
    /// stays frozen under LoRA.
    pub gate: Linear<B>,
    pub experts: Vec<Mlp<B>>,
    /// Qwen2-MoE: an expert every token goes through ...
    pub shared_expert: Option<Mlp<B>>,
    /// ... scaled by `sigmoid(shared_expert_gate(x))` (`[1, hidden]`).
    pub shared_expert_gate: Option<Linear<B>>,
    pub top_k: usize,
    pub norm_topk_prob: bool,
}

/// Which experts each token goes to: for every expert, the rows it gets and, for each, the
/// position of that choice in the flattened `[tokens, k]` routing weights.
#[derive(Debug, PartialEq)]
pub struct Routes {
    /// `[tokens * k]`: token `t`'s `j`-th choice at `t * k + j`, best first.
    pub chosen: Vec<i64>,
    /// Per expert: (token rows, their slots in `chosen`).
    pub by_expert: Vec<(Vec<i64>, Vec<i64>)>,
}

impl Routes {
    /// The `k` most probable experts of each row of `probs` (`[tokens, experts]`, row-major),
    /// best first; ties go to the lower expert index.
    pub fn top_k(probs: &[f32], experts: usize, k: usize) -> Self {
        let tokens = probs.len() / experts.max(1);
        let mut chosen = Vec::with_capacity(tokens * k);
        let mut by_expert = vec![(Vec::new(), Vec::new()); experts];
        let mut order: Vec<usize> = (0..experts).collect();
        for (t, row) in probs.chunks_exact(experts).enumerate() {
            order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
            for (j, &e) in order[..k].iter().enumerate() {
                chosen.push(e as i64);
                by_expert[e].0.push(t as i64);
                by_expert[e].1.push((t * k + j) as i64);
            }
        }
        Self { chosen, by_expert }
    }
}

/// The routing of a forward pass's sparse layers, added up for the load-balancing loss
/// (Switch Transformer's, as transformers' `load_balancing_loss_func` computes it over every
/// layer's router logits at once).
#[derive(Debug)]
pub struct RouterLoad<B: Backend> {
    /// Per expert: how many (token, layer) choices picked it, over all layers. A count, so no
    /// gradient flows through it, as none flows through transformers' histogram.
    pub counts: Vec<f32>,
    /// Per expert: its float32 routing probability summed over tokens and layers.
    pub probs: Option<Tensor<B, 1>>,
    /// Tokens times sparse layers (padding left out).
    pub rows: usize,
    /// Per token of the pass, whether it is padding ([`crate::models::TokenBatch::padding`]).
    padding: Option<Vec<bool>>,
}

impl<B: Backend> Default for RouterLoad<B> {
    fn default() -> Self {
        Self::new(None)
    }
}

impl<B: Backend> RouterLoad<B> {
    /// Nothing added yet, for a pass whose tokens `padding` flags (`None`: every token counts),
    /// as transformers' `load_balancing_loss_func` leaves out what `attention_mask` masks.
    pub fn new(padding: Option<&[bool]>) -> Self {
        Self {
            counts: Vec::new(),
            probs: None,
            rows: 0,
            padding: padding
                .filter(|p| p.iter().any(|&x| x))
                .map(<[bool]>::to_vec),
        }
    }

    /// The probabilities added so far, leaving none (a layer's share, taken after its
    /// recomputation); the padding stays, for the next layer.
    pub fn take_probs(&mut self) -> Option<Tensor<B, 1>> {
        self.probs.take()
    }

    fn add(&mut self, probs: Tensor<B, 2>, routes: &Routes) {
        let [rows, experts] = probs.dims();
        self.counts.resize(experts, 0.0);
        // `chosen` holds each token's top-k experts, token by token.
        let top_k = (routes.chosen.len() / rows.max(1)).max(1);
        for (t, choices) in routes.chosen.chunks(top_k).enumerate() {
            if self.padding.as_ref().is_some_and(|p| p[t]) {
                continue;
            }
            for &e in choices {
                self.counts[e as usize] += 1.0;
            }
        }
        let (probs, real) = match &self.padding {
            Some(padding) => {
                let keep: Vec<f32> = padding.iter().map(|&p| if p { 0.0 } else { 1.0 }).collect();
                let real = padding.iter().filter(|&&p| !p).count();
                let keep =
                    Tensor::<B, 2>::from_data(TensorData::new(keep, [rows, 1]), &probs.device());
                (probs * keep, real)
            }
            None => (probs, rows),
        };
        let summed = probs.sum_dim(0).reshape([experts]);
        self.probs = Some(match self.probs.take() {
            Some(p) => p + summed,
            None => summed,
        });
        self.rows += real;
    }

    /// `experts * sum_e (counts_e / rows) * (probs_e / rows)`, a `[1]` float32 tensor: the
    /// auxiliary loss transformers adds as `router_aux_loss_coef * aux_loss`; `None` when no
    /// sparse layer ran.
    pub fn aux_loss(&self) -> Option<Tensor<B, 1>> {
        let probs = self.probs.clone()?;
        let experts = self.counts.len();
        let rows = self.rows.max(1) as f64;
        let counts = Tensor::<B, 1>::from_data(
            TensorData::new(self.counts.clone(), [experts]),
            &probs.device(),
        );
        Some((probs * counts).sum() * (experts as f64 / (rows * rows)))
    }
}

impl<B: Backend> SparseMoe<B> {
    pub fn forward(&self, x: Tensor<B, 3>, mode: ForwardMode) -> Tensor<B, 3> {
        self.forward_recording(x, mode, None)
    }

    /// [`Self::forward`], adding this layer's routing to `load` when given.
    pub fn forward_recording(
        &self,
        x: Tensor<B, 3>,
        mode: ForwardMode,
        load: Option<&std::cell::RefCell<RouterLoad<B>>>,
    ) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        let rows = x.reshape([batch * seq, hidden]);
        let dtype = rows.dtype();
        let device = rows.device();
        let experts = self.experts.len();
        let logits = self.gate.forward(rows.clone(), mode);
        let probs = softmax(cast(logits, DType::F32));
        let host: Vec<f32> = probs
            .clone()
            .into_data()
            .convert::<f32>()
            .to_vec()
            .unwrap_or_default();
        let routes = Routes::top_k(&host, experts, self.top_k);
        if let Some(load) = load {
            load.borrow_mut().add(probs.clone(), &routes);
        }
        let ints = |v: &[i64]| {
            Tensor::<B, 1, Int>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
        };
        let k = self.top_k;
        let chosen = ints(&routes.chosen).reshape([batch * seq, k]);
        let mut weights = probs.gather(1, chosen);
        if self.norm_topk_prob {
            weights = weights.clone() / weights.sum_dim(1);
        }
        let weights = cast(weights, dtype).reshape([batch * seq * k, 1]);
        let mut out = Tensor::<B, 2>::zeros([batch * seq, hidden], &device).cast(dtype);
        for (expert, (tokens, slots)) in self.experts.iter().zip(&routes.by_expert) {
            if tokens.is_empty() {
                continue;
            }
            let y = expert.forward_rows(gather_rows(rows.clone(), tokens), mode);
            let w = weights.clone().select(0, ints(slots));
            out = add_rows(out, tokens, y * w);
        }
        if let (Some(shared), Some(gate)) = (&self.shared_expert, &self.shared_expert_gate) {
            let scale = burn::tensor::activation::sigmoid(gate.forward(rows.clone(), mode));
            out = out + shared.forward_rows(rows, mode) * scale;
        }
        out.reshape([batch, seq, hidden])
    }

    /// The block's linear layers LoRA and NF4 may take, with their paths below the block
    /// (`experts.3.up_proj`): every expert's, then the shared expert's (never the routers).
    pub fn linears(&self) -> Vec<(String, &Linear<B>)> {
        let named = self
            .experts
            .iter()
            .enumerate()
            .map(|(e, m)| (format!("experts.{e}"), m))
            .chain(
                self.shared_expert
                    .iter()
                    .map(|m| ("shared_expert".into(), m)),
            );
        let mut out = Vec::new();
        for (prefix, m) in named {
            out.push((format!("{prefix}.gate_proj"), &m.gate_proj));
            out.push((format!("{prefix}.up_proj"), &m.up_proj));
            out.push((format!("{prefix}.down_proj"), &m.down_proj));
        }
        out
    }

    /// [`Self::linears`], mutable.
    pub fn linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let mut out = Vec::new();
        let named = self
            .experts
            .iter_mut()
            .enumerate()
            .map(|(e, m)| (format!("experts.{e}"), m))
            .chain(
                self.shared_expert
                    .iter_mut()
                    .map(|m| ("shared_expert".into(), m)),
            );
        for (prefix, m) in named {
            out.push((format!("{prefix}.gate_proj"), &mut m.gate_proj));
            out.push((format!("{prefix}.up_proj"), &mut m.up_proj));
            out.push((format!("{prefix}.down_proj"), &mut m.down_proj));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_pick_the_k_most_probable_experts_best_first() {
        let probs = [0.1, 0.5, 0.3, 0.1, /* token 1 */ 0.4, 0.1, 0.1, 0.4];
        let routes = Routes::top_k(&probs, 4, 2);
        // token 1 ties experts 0 and 3: the lower index goes first
        assert_eq!(routes.chosen, [1, 2, 0, 3]);
        assert_eq!(
            routes.by_expert,
            [
                (vec![1], vec![2]),
                (vec![0], vec![0]),
                (vec![0], vec![1]),
                (vec![1], vec![3]),
            ]
        );
    }
}
