//! The one decoder-only transformer every supported family runs through. Field names follow
//! Hugging Face's module names, so a parameter's module path *is* its checkpoint name
//! (`model.layers.0.self_attn.q_proj.weight`).

use burn::module::{Module, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::args::ModelArgs;
use super::cache::{KvCache, LayerCache};
use super::mask;
pub use super::mlp::Mlp;
use super::moe::{RouterLoad, SparseMoe};
use super::multimodal::{ImageInput, place_image_tokens};
use super::qwen2_vl_vision::Qwen2VlVision;
use super::rope::{self, RopeTables};
use super::shards::LayerShards;
use crate::kernels::{attention_by_position, permute, softcap};
use crate::modules::frozen_nf4::Nf4Rows;
use crate::modules::{ForwardMode, Linear, RmsNorm};

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    pub q_proj: Linear<B>,
    pub k_proj: Linear<B>,
    pub v_proj: Linear<B>,
    pub o_proj: Linear<B>,
    pub q_norm: Option<RmsNorm<B>>,
    pub k_norm: Option<RmsNorm<B>>,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// The scores' scale (`head_dim ** -0.5`, or Gemma's `query_pre_attn_scalar ** -0.5`).
    pub scale: f64,
    /// Gemma 2: scores become `tanh(s / cap) * cap` before the mask.
    pub softcap: Option<f64>,
    /// Attends through the pass's sliding-window mask (and Gemma 3's local RoPE).
    pub sliding: bool,
    /// Rotates q and k by position (SmolLM3's NoPE layers do not).
    pub rope: bool,
    /// gpt-oss: each query head's sink logit (`self_attn.sinks`, `[heads]`), an extra term of
    /// the softmax's denominator that attends to nothing.
    pub sinks: Option<Param<Tensor<B, 1>>>,
}

/// What every layer of one forward pass shares: RoPE tables, the attention masks, switches.
pub struct PassContext<B: Backend> {
    pub rope_q: RopeTables<B>,
    pub rope_k: RopeTables<B>,
    pub mask: mask::AttentionMask<B>,
    /// The sliding layers' mask, when the model has any.
    pub mask_sliding: Option<mask::AttentionMask<B>>,
    /// Gemma 3's sliding layers' RoPE tables (their own base).
    pub rope_local: Option<(RopeTables<B>, RopeTables<B>)>,
    pub mode: ForwardMode,
    /// Where sparse layers add up their routing, when the load-balancing loss asks for it.
    pub router_load: Option<std::cell::RefCell<RouterLoad<B>>>,
}

impl<B: Backend> Attention<B> {
    /// Layout: projections stay `[batch, seq, heads, head_dim]` (contiguous) through RoPE;
    /// queries are then laid out as `[batch, kv_heads, n_rep * seq, head_dim]` so grouped-query
    /// attention is one batched matmul against keys `[batch, kv_heads, head_dim, k_len]`: no
    /// key/value repetition.
    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        ctx: &PassContext<B>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let [batch, seq, hidden] = x.dims();
        let rows = x.reshape([batch * seq, hidden]);
        let (h, kvh, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let n_rep = h / kvh;
        let mode = ctx.mode;
        let mut q = self
            .q_proj
            .forward(rows.clone(), mode)
            .reshape([batch, seq, h, d]);
        let mut k = self
            .k_proj
            .forward(rows.clone(), mode)
            .reshape([batch, seq, kvh, d]);
        let v = self
            .v_proj
            .forward(rows, mode)
            .reshape([batch, seq, kvh, d]);
        if let Some(norm) = &self.q_norm {
            q = norm.forward(q);
        }
        if let Some(norm) = &self.k_norm {
            k = norm.forward(k);
        }
        let (rope_q, rope_k) = match (&ctx.rope_local, self.sliding) {
            (Some((q, k)), true) => (q, k),
            _ => (&ctx.rope_q, &ctx.rope_k),
        };
        let (q, k) = if self.rope {
            (rope::apply(q, rope_q) * self.scale, rope::apply(k, rope_k))
        } else {
            (q * self.scale, k)
        };
        // Keys and values as `[batch, kv_heads, k_len, head_dim]`, the cache's layout.
        let (mut k, mut v) = (permute(k, [0, 2, 1, 3]), permute(v, [0, 2, 1, 3]));
        if let Some(cache) = cache {
            (k, v) = cache.append(k, v);
        }
        // Each kv head's query groups stacked as one `[n_rep * seq, d]` block, so the scores
        // are one plain batched matmul per (batch, kv head) with no broadcast operand: 1.5x
        // faster on Flex than broadcasting keys over a separate `n_rep` dimension.
        let q = permute(q.reshape([batch, seq, kvh, n_rep, d]), [0, 2, 3, 1, 4]).reshape([
            batch,
            kvh,
            n_rep * seq,
            d,
        ]);
        let mask = match (&ctx.mask_sliding, self.sliding) {
            (Some(m), true) => m,
            _ => &ctx.mask,
        };
        let sinks = self.sinks.as_ref().map(Param::val);
        let out =
            attention_by_position(q, k, v, mask, self.softcap, sinks).reshape([batch * seq, h * d]);
        self.o_proj.forward(out, mode).reshape([batch, seq, hidden])
    }
}

#[derive(Module, Debug)]
pub struct DecoderLayer<B: Backend> {
    pub input_layernorm: RmsNorm<B>,
    pub self_attn: Attention<B>,
    /// Before the MLP; Gemma 2/3 (with the feed-forward norms): on the attention output.
    pub post_attention_layernorm: RmsNorm<B>,
    /// Gemma 2/3: before the MLP.
    pub pre_feedforward_layernorm: Option<RmsNorm<B>>,
    /// Gemma 2/3: on the MLP output.
    pub post_feedforward_layernorm: Option<RmsNorm<B>>,
    /// A dense layer's MLP (`None` in a sparse layer).
    pub mlp: Option<Mlp<B>>,
    /// A sparse layer's experts (`None` in a dense layer).
    pub moe: Option<SparseMoe<B>>,
}

impl<B: Backend> DecoderLayer<B> {
    /// The layer's linear layers with their paths below the layer (`self_attn.q_proj`),
    /// attention's then the MLP's or the experts' (never a router).
    pub fn named_linears_mut(&mut self) -> Vec<(String, &mut Linear<B>)> {
        let a = &mut self.self_attn;
        let mut out: Vec<(String, &mut Linear<B>)> = vec![
            ("self_attn.q_proj".into(), &mut a.q_proj),
            ("self_attn.k_proj".into(), &mut a.k_proj),
            ("self_attn.v_proj".into(), &mut a.v_proj),
            ("self_attn.o_proj".into(), &mut a.o_proj),
        ];
        if let Some(m) = &mut self.mlp {
            out.push(("mlp.gate_proj".into(), &mut m.gate_proj));
            out.push(("mlp.up_proj".into(), &mut m.up_proj));
            out.push(("mlp.down_proj".into(), &mut m.down_proj));
        }
        if let Some(moe) = &mut self.moe {
            out.extend(
                moe.linears_mut()
                    .into_iter()
                    .map(|(path, l)| (format!("moe.{path}"), l)),
            );
        }
        out
    }

    /// [`Self::named_linears_mut`], shared.
    pub fn named_linears(&self) -> Vec<(String, &Linear<B>)> {
        let a = &self.self_attn;
        let mut out: Vec<(String, &Linear<B>)> = vec![
            ("self_attn.q_proj".into(), &a.q_proj),
            ("self_attn.k_proj".into(), &a.k_proj),
            ("self_attn.v_proj".into(), &a.v_proj),
            ("self_attn.o_proj".into(), &a.o_proj),
        ];
        if let Some(m) = &self.mlp {
            out.push(("mlp.gate_proj".into(), &m.gate_proj));
            out.push(("mlp.up_proj".into(), &m.up_proj));
            out.push(("mlp.down_proj".into(), &m.down_proj));
        }
        if let Some(moe) = &self.moe {
            out.extend(
                moe.linears()
                    .into_iter()
                    .map(|(path, l)| (format!("moe.{path}"), l)),
            );
        }
        out
    }

    /// The layer's linear layers, in [`Self::named_linears_mut`]'s order.
    pub fn linears(&self) -> Vec<&Linear<B>> {
        self.named_linears().into_iter().map(|(_, l)| l).collect()
    }

    /// [`Self::linears`], mutable.
    pub fn linears_mut(&mut self) -> Vec<&mut Linear<B>> {
        self.named_linears_mut()
            .into_iter()
            .map(|(_, l)| l)
            .collect()
    }

    /// The MLP or the experts.
    fn feed_forward(&self, x: Tensor<B, 3>, ctx: &PassContext<B>) -> Tensor<B, 3> {
        let mode = ctx.mode;
        match (&self.mlp, &self.moe) {
            (_, Some(moe)) => moe.forward_recording(x, mode, ctx.router_load.as_ref()),
            (Some(mlp), None) => mlp.forward(x, mode),
            (None, None) => x.zeros_like(),
        }
    }

    /// FSDP: keeps this rank's rows of every NF4 base weight (`Linear::shard_nf4`).
    pub fn shard_nf4(mut self, shards: &LayerShards) -> Self {
        for linear in self.linears_mut() {
            let out = linear.out_features();
            linear.shard_nf4(shards.rows(out, shards.rank()));
        }
        self
    }

    /// The layer with every NF4 base weight whole, gathered from every rank's rows (one
    /// all-gather of their codes and scales); the gathered weights dequantize exactly as the
    /// whole weights would.
    pub fn gather_nf4(mut self, shards: &LayerShards) -> Self {
        let Some(device) = self.devices().into_iter().next() else {
            return self;
        };
        let pieces: Vec<Nf4Rows> = self
            .linears()
            .into_iter()
            .filter_map(|l| l.nf4_rows().cloned())
            .collect();
        if pieces.is_empty() {
            return self;
        }
        let world = shards.world();
        let len =
            |piece: &Nf4Rows, rank: usize| piece.values_len(&shards.rows(piece.full[0], rank));
        let total: usize = (0..world)
            .map(|r| pieces.iter().map(|p| len(p, r)).sum::<usize>())
            .sum();
        let local: Vec<f32> = pieces.iter().flat_map(Nf4Rows::to_values).collect();
        let whole = shards.gather_values::<B>(local, total, &device);
        // Rank-major: rank 0's values of every piece, then rank 1's, ...
        let mut parts: Vec<Vec<&[f32]>> = vec![Vec::with_capacity(world); pieces.len()];
        let mut offset = 0;
        for rank in 0..world {
            for (j, piece) in pieces.iter().enumerate() {
                let n = len(piece, rank);
                parts[j].push(&whole[offset..offset + n]);
                offset += n;
            }
        }
        let mut gathered = pieces.iter().zip(&parts).map(|(p, parts)| {
            let rows: Vec<_> = (0..world).map(|r| shards.rows(p.full[0], r)).collect();
            p.gather_parts(parts, &rows)
        });
        for linear in self.linears_mut() {
            if linear.nf4_rows().is_some()
                && let Some(whole) = gathered.next()
            {
                *linear = linear.with_gathered_nf4(whole);
            }
        }
        self
    }

    pub fn forward(
        &self,
        x: Tensor<B, 3>,
        ctx: &PassContext<B>,
        cache: Option<&mut LayerCache<B>>,
    ) -> Tensor<B, 3> {
        let attn = self
            .self_attn
            .forward(self.input_layernorm.forward(x.clone()), ctx, cache);
        if let (Some(pre), Some(post)) = (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            // Gemma 2/3: every sublayer's output is normalised before the residual add.
            let h = x + self.post_attention_layernorm.forward(attn);
            let mlp = self.feed_forward(pre.forward(h.clone()), ctx);
            return h + post.forward(mlp);
        }
        let h = x + attn;
        h.clone() + self.feed_forward(self.post_attention_layernorm.forward(h), ctx)
    }
}

#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

/// The output end of the model, whole: the final norm and the vocabulary projection (the
/// output layer, or the embedding matrix when tied). [`CausalLm::head`] makes it: one
/// all-gather when the model is sharded, so that a loss projecting in chunks gathers once.
#[derive(Module, Debug)]
pub struct OutputHead<B: Backend> {
    pub norm: RmsNorm<B>,
    pub lm_head: Option<Linear<B>>,
    /// Tied embeddings: the projection is the embedding matrix, transposed.
    pub tied: Option<Param<Tensor<B, 2>>>,
    pub vocab_size: usize,
    pub final_logit_softcap: Option<f64>,
}

impl<B: Backend> OutputHead<B> {
    /// The final norm.
    pub fn norm<const D: usize>(&self, hidden: Tensor<B, D>) -> Tensor<B, D> {
        self.norm.forward(hidden)
    }

    /// Vocabulary logits for hidden states `[rows, hidden]` (final norm applied) ->
    /// `[rows, vocab]`.
    pub fn project(&self, hidden: Tensor<B, 2>, mode: ForwardMode) -> Tensor<B, 2> {
        let logits = match (&self.lm_head, &self.tied) {
            (Some(head), _) => head.forward(hidden, mode),
            (None, Some(embeddings)) => {
                crate::kernels::matmul(hidden, embeddings.val().transpose())
            }
            (None, None) => unreachable!("invariant: CausalLm::head sets a projection"),
        };
        match self.final_logit_softcap {
            Some(cap) => softcap(logits, cap),
            None => logits,
        }
    }

    /// Full logits `[batch, seq, vocab]` of hidden states `[batch, seq, hidden]` (final norm
    /// applied).
    pub fn logits(&self, hidden: Tensor<B, 3>, mode: ForwardMode) -> Tensor<B, 3> {
        let [batch, seq, h] = hidden.dims();
        self.project(hidden.reshape([batch * seq, h]), mode)
            .reshape([batch, seq, self.vocab_size])
    }

    /// [`Self::logits`] at `at.rows` only -> `[at.rows.len() / at.width, at.width, vocab]`,
    /// the same values as the full logits there: TRL's `logits_to_keep`. Why: an RL update
    /// scores only the completion, and with a real vocabulary the projection is a large share
    /// of the model (SmolLM2-135M's 49 152 x 576 is a fifth of its weights).
    pub fn logits_at(
        &self,
        hidden: Tensor<B, 3>,
        at: LogitRows<'_>,
        mode: ForwardMode,
    ) -> Tensor<B, 3> {
        let [batch, seq, h] = hidden.dims();
        let width = at.width.max(1);
        let index = row_index(at.rows, &hidden.device());
        let kept = hidden.reshape([batch * seq, h]).select(0, index);
        self.project(kept, mode)
            .reshape([at.rows.len() / width, width, self.vocab_size])
    }
}

/// The positions to project onto the vocabulary, as sequences of `width`: `rows` indexes the
/// flattened `[batch * seq]` hidden states, `width` at a time per result sequence, in order.
/// A position may serve several result sequences (a packed prompt's last position predicts
/// the first token of each completion that continues it).
#[derive(Debug, Clone, Copy)]
pub struct LogitRows<'a> {
    pub rows: &'a [usize],
    pub width: usize,
}

/// `rows` as an index tensor for `select` and `select_assign` along the first dimension.
pub fn row_index<B: Backend>(rows: &[usize], device: &B::Device) -> Tensor<B, 1, Int> {
    let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
    let n = rows.len();
    Tensor::from_data(TensorData::new(rows, [n]), device)
}

/// Hugging Face's `model.*`: embeddings, layers, final norm.
#[derive(Module, Debug)]
pub struct DecoderBody<B: Backend> {
    pub embed_tokens: Embedding<B>,
    pub layers: Vec<DecoderLayer<B>>,
    pub norm: RmsNorm<B>,
}

/// The inputs of one forward pass, flattened row-major (`[batch * seq]`).
#[derive(Debug, Clone, Copy)]
pub struct TokenBatch<'a> {
    pub tokens: &'a [u32],
    pub positions: &'a [u32],
    /// Packed samples: which document each position belongs to.
    pub document_ids: Option<&'a [u32]>,
    /// With `document_ids`: the document each position continues, whose positions it sees
    /// besides its own document's ([`mask::Separations::continued_documents`]).
    pub continued_documents: Option<&'a [u32]>,
    /// Rows of different lengths decoded together (left-padded prompts): per row, how many
    /// leading key positions (of the cache and this input together) are padding. No real
    /// query attends to them; a padding query attends only to padding (its output is unused).
    pub left_padding: Option<&'a [usize]>,
    /// Per position, whether it is padding (a right-padded row's tail, a pack's filler): the
    /// load-balancing loss leaves it out, as transformers' `attention_mask` does. `None`: none is.
    pub padding: Option<&'a [bool]>,
    /// A vision-language model's images for this pass (their placeholders among `tokens`) and
    /// its M-RoPE positions; `None` for text.
    pub images: Option<&'a ImageInput>,
    pub batch: usize,
}

impl<'a> TokenBatch<'a> {
    pub fn seq_len(&self) -> usize {
        self.tokens.len() / self.batch.max(1)
    }

    /// What keeps this batch's rows' positions from seeing each other, for the mask.
    pub fn separations(&self) -> mask::Separations<'a> {
        mask::Separations {
            document_ids: self.document_ids,
            continued_documents: self.continued_documents,
            left_padding: self.left_padding,
        }
    }
}

/// `*ForCausalLM`: the decoder plus its output projection (tied to the embeddings or not).
#[derive(Module, Debug)]
pub struct CausalLm<B: Backend> {
    pub model: DecoderBody<B>,
    pub lm_head: Option<Linear<B>>,
    pub args: ModelArgs,
    pub rope: rope::Rope,
    /// Gemma 3's sliding layers' RoPE.
    pub rope_local: Option<rope::Rope>,
    /// A vision-language model's vision tower (Qwen2-VL's), whose merged tokens take the image
    /// placeholders' places in the embedded sequence; held whole on every rank.
    pub visual: Option<Qwen2VlVision<B>>,
    /// FSDP: this rank keeps only its rows of every weight (decoder layers, embeddings, final
    /// norm, output), gathered per use ([`Self::layer`], [`Self::embedding`], [`Self::head`]);
    /// `None` holds every weight whole.
    #[module(skip)]
    pub shards: Option<std::sync::Arc<super::shards::LayerShards>>,
}

impl<B: Backend> CausalLm<B> {
    pub fn device(&self) -> B::Device {
        self.model.norm.weight.val().device()
    }

    /// Final hidden states `[batch, seq, hidden]` (after the last norm), so losses can project
    /// to the vocabulary in chunks.
    pub fn hidden(
        &self,
        input: TokenBatch<'_>,
        mode: ForwardMode,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let ctx = self.pass_context::<B>(
            input,
            cache.as_ref().map_or(0, |c| c.len()),
            mode,
            &self.device(),
        );
        self.hidden_in(input, &ctx, cache)
    }

    /// [`Self::hidden`] without a cache, with every sparse layer's routing added up for the
    /// load-balancing loss ([`RouterLoad::aux_loss`]).
    pub fn hidden_with_router_load(
        &self,
        input: TokenBatch<'_>,
        mode: ForwardMode,
    ) -> (Tensor<B, 3>, RouterLoad<B>) {
        let mut ctx = self.pass_context::<B>(input, 0, mode, &self.device());
        ctx.router_load = Some(std::cell::RefCell::new(RouterLoad::new(input.padding)));
        let hidden = self.hidden_in(input, &ctx, None);
        let load = ctx
            .router_load
            .map(|cell| cell.into_inner())
            .unwrap_or_default();
        (hidden, load)
    }

    fn hidden_in(
        &self,
        input: TokenBatch<'_>,
        ctx: &PassContext<B>,
        cache: Option<&mut KvCache<B>>,
    ) -> Tensor<B, 3> {
        let mut x = self.embed(input);
        match cache {
            Some(cache) => {
                for (i, layer_cache) in cache.layers.iter_mut().enumerate() {
                    x = self.layer(i).forward(x, ctx, Some(layer_cache));
                }
            }
            None => {
                for i in 0..self.model.layers.len() {
                    x = self.layer(i).forward(x, ctx, None);
                }
            }
        }
        self.final_norm().forward(x)
    }

    /// The final norm, whole (gathered when sharded).
    fn final_norm(&self) -> std::borrow::Cow<'_, RmsNorm<B>> {
        match &self.shards {
            Some(shards) => std::borrow::Cow::Owned(shards.gather(&self.model.norm)),
            None => std::borrow::Cow::Borrowed(&self.model.norm),
        }
    }

    /// The token embeddings, whole: gathered from every rank's rows when the model is
    /// sharded (one collective call, the same on every rank). A gathered weight is a leaf of
    /// its own: FSDP's passes reduce-scatter its gradient (`LayerShards::scatter_grads`).
    pub fn embedding(&self) -> Embedding<B> {
        match &self.shards {
            Some(shards) => shards.gather(&self.model.embed_tokens),
            None => self.model.embed_tokens.clone(),
        }
    }

    /// The output end, whole ([`OutputHead`]): gathered when sharded, as
    /// [`Self::embedding`]; otherwise the model's own parameters.
    pub fn head(&self) -> OutputHead<B> {
        let head = OutputHead {
            norm: self.model.norm.clone(),
            lm_head: self.lm_head.clone(),
            tied: match self.lm_head {
                Some(_) => None,
                None => Some(self.model.embed_tokens.weight.clone()),
            },
            vocab_size: self.args.output_size(),
            final_logit_softcap: self.args.final_logit_softcap,
        };
        match &self.shards {
            Some(shards) => shards.gather(&head),
            None => head,
        }
    }

    /// Decoder layer `i` with its whole weights: gathered from every rank's rows when the
    /// model is sharded (one collective call, the same on every rank), else the layer itself.
    pub fn layer(&self, i: usize) -> std::borrow::Cow<'_, DecoderLayer<B>> {
        match &self.shards {
            Some(shards) => {
                std::borrow::Cow::Owned(shards.gather(&self.model.layers[i]).gather_nf4(shards))
            }
            None => std::borrow::Cow::Borrowed(&self.model.layers[i]),
        }
    }

    /// Every weight whole (every rank takes part when sharded): what checkpoints and exports
    /// read. Holds the whole model, as one device does. [`Self::join_unsharding`] makes the
    /// same collective calls in the same order.
    pub fn unsharded(&self) -> Self {
        let Some(shards) = &self.shards else {
            return self.clone();
        };
        let mut whole = self.clone();
        whole.model.embed_tokens = shards.gather(&self.model.embed_tokens);
        whole.model.layers = self
            .model
            .layers
            .iter()
            .map(|layer| shards.gather(layer).gather_nf4(shards))
            .collect();
        whole.model.norm = shards.gather(&self.model.norm);
        whole.lm_head = self.lm_head.as_ref().map(|head| shards.gather(head));
        whole.shards = None;
        whole
    }

    /// Takes part in another rank's [`Self::unsharded`]: the same gathers in its order, each
    /// dropped at once (this rank never holds more than one whole unit).
    pub fn join_unsharding(&self) {
        let Some(shards) = &self.shards else {
            return;
        };
        drop(shards.gather(&self.model.embed_tokens));
        for layer in &self.model.layers {
            drop(shards.gather(layer).gather_nf4(shards));
        }
        drop(shards.gather(&self.model.norm));
        if let Some(head) = &self.lm_head {
            drop(shards.gather(head));
        }
    }

    /// Token embeddings `[batch, seq, hidden]` (scaled for Gemma).
    pub fn embed(&self, input: TokenBatch<'_>) -> Tensor<B, 3> {
        self.embed_with(&self.embedding(), input)
    }

    /// [`Self::embed`] with `embedding`, the whole embeddings ([`Self::embedding`]); a
    /// vision-language model's images go through its tower into their placeholders' rows.
    pub fn embed_with(&self, embedding: &Embedding<B>, input: TokenBatch<'_>) -> Tensor<B, 3> {
        let device = self.device();
        let (batch, seq) = (input.batch, input.seq_len());
        let ids: Vec<i32> = input.tokens.iter().map(|&t| t as i32).collect();
        let ids = Tensor::<B, 1, Int>::from_data(TensorData::new(ids, [batch * seq]), &device);
        let mut rows = embedding.weight.val().select(0, ids);
        if let (Some(images), Some(visual), Some(vision)) =
            (input.images, &self.visual, &self.args.vision)
            && !images.grids.is_empty()
        {
            let patch_dim = vision.encoder.patch_dim();
            let pixels = Tensor::<B, 2>::from_data(
                TensorData::new(images.pixels.clone(), [images.patches(), patch_dim]),
                &device,
            );
            let merged = visual.forward(pixels, &images.grids).merged;
            rows = place_image_tokens(rows, input.tokens, vision.image_token_id, merged);
        }
        let x = rows.reshape([batch, seq, self.args.hidden_size]);
        if self.args.scale_embeddings {
            // Gemma rounds the normaliser to the activation dtype; fp32 here.
            x * (self.args.hidden_size as f32).sqrt() as f64
        } else {
            x
        }
    }

    /// What every layer of a forward pass shares (RoPE tables, mask), on backend `B2`: the
    /// model's own, or its inner backend for a pass without autodiff (activation
    /// checkpointing).
    pub fn pass_context<B2: Backend>(
        &self,
        input: TokenBatch<'_>,
        offset: usize,
        mode: ForwardMode,
        device: &B2::Device,
    ) -> PassContext<B2> {
        let (batch, seq) = (input.batch, input.seq_len());
        let (heads, kv_heads) = (self.args.num_heads, self.args.num_kv_heads);
        // M-RoPE's three positions where the pass has images; a text pass's are all its one.
        let tables = |heads| match input.images.filter(|_| self.rope.is_3d()) {
            Some(images) => self
                .rope
                .tables_3d::<B2>(&images.positions, batch, heads, device),
            None => self
                .rope
                .tables::<B2>(input.positions, batch, heads, device),
        };
        PassContext {
            rope_q: tables(heads),
            rope_k: tables(kv_heads),
            mask: mask::causal_window::<B2>(batch, seq, offset, input.separations(), None, device),
            mask_sliding: self.args.sliding_window.map(|w| {
                mask::causal_window::<B2>(batch, seq, offset, input.separations(), Some(w), device)
            }),
            rope_local: self.rope_local.as_ref().map(|r| {
                (
                    r.tables::<B2>(input.positions, batch, heads, device),
                    r.tables::<B2>(input.positions, batch, kv_heads, device),
                )
            }),
            mode,
            router_load: None,
        }
    }

    /// Full logits `[batch, seq, vocab]`.
    pub fn forward(&self, input: TokenBatch<'_>, mode: ForwardMode) -> Tensor<B, 3> {
        let hidden = self.hidden(input, mode, None);
        self.logits(hidden, mode)
    }

    /// Logits of hidden states `[batch, seq, hidden]` (final norm applied); see
    /// [`OutputHead::logits`], and [`Self::head`] to project several times.
    pub fn logits(&self, hidden: Tensor<B, 3>, mode: ForwardMode) -> Tensor<B, 3> {
        self.head().logits(hidden, mode)
    }

    pub fn new_cache(&self) -> KvCache<B> {
        KvCache::new(self.args.num_layers)
    }
}
