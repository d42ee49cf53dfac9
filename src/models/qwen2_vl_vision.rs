//! Qwen2-VL's vision tower (transformers' `Qwen2VisionTransformerPretrainedModel`): each
//! patch row (`3 * temporal_patch * patch^2` pixels) projected to `embed_dim` (the Conv3d whose
//! kernel is its stride, a linear map), then pre-norm ViT blocks with 2D rotary positions
//! (the patch's row on the first half of each head's frequencies, its column on the second) and
//! attention within each image, then the patch merger: LayerNorm, each 2x2 block's four patches
//! side by side, an MLP to the language model's width.
//!
//! Parameters keep transformers' names under the prefix `load` is given (`model.visual` as
//! transformers 5 saves the model; the Hub's older checkpoints write `visual`).

use burn::module::{Module, Param};
use burn::tensor::activation::{gelu, sigmoid};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde_json::Value;

use crate::checkpoint::{CheckpointError, HostTensor};
use crate::kernels::{attention_by_position, permute};
use crate::models::mask::{self, AttentionMask};
use crate::models::param_source::ParamSource;
use crate::models::rope::{self, RopeTables};
use crate::modules::linear::{ForwardMode, Linear};

/// The tower's shape, from config.json's `vision_config`.
#[derive(Debug, Clone, PartialEq)]
pub struct Qwen2VlVisionArgs {
    pub depth: usize,
    pub embed_dim: usize,
    /// The language model's width: the merger's output.
    pub hidden_size: usize,
    pub num_heads: usize,
    pub mlp_hidden: usize,
    pub in_channels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub spatial_merge_size: usize,
    pub rope_theta: f64,
    pub act: VisionAct,
}

/// The blocks' MLP activation (`hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VisionAct {
    /// `x * sigmoid(1.702 x)` (Qwen2-VL's).
    QuickGelu,
    /// The exact, erf-based GELU.
    Gelu,
}

/// `vision_config` is not one tune reads.
#[derive(Debug, thiserror::Error)]
#[error("vision_config.{key}: {problem}")]
pub struct VisionConfigError {
    pub key: &'static str,
    pub problem: String,
}

impl Qwen2VlVisionArgs {
    pub fn from_config(vision: &Value) -> Result<Self, VisionConfigError> {
        let int = |key: &'static str, default: usize| -> Result<usize, VisionConfigError> {
            match vision.get(key) {
                None | Some(Value::Null) => Ok(default),
                Some(v) => {
                    v.as_u64()
                        .filter(|&n| n > 0)
                        .map(|n| n as usize)
                        .ok_or(VisionConfigError {
                            key,
                            problem: format!("{v} is not a positive integer"),
                        })
                }
            }
        };
        let embed_dim = int("embed_dim", 1280)?;
        let mlp_ratio = match vision.get("mlp_ratio") {
            None | Some(Value::Null) => 4.0,
            Some(v) => v.as_f64().ok_or(VisionConfigError {
                key: "mlp_ratio",
                problem: format!("{v} is not a number"),
            })?,
        };
        let act = match vision.get("hidden_act").and_then(Value::as_str) {
            None | Some("quick_gelu") => VisionAct::QuickGelu,
            Some("gelu") => VisionAct::Gelu,
            Some(other) => {
                return Err(VisionConfigError {
                    key: "hidden_act",
                    problem: format!("`{other}` is not supported (quick_gelu or gelu)"),
                });
            }
        };
        let rope_theta = vision
            .get("rope_parameters")
            .and_then(|r| r.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0);
        let args = Self {
            depth: int("depth", 32)?,
            embed_dim,
            hidden_size: int("hidden_size", 3584)?,
            num_heads: int("num_heads", 16)?,
            // transformers' `int(embed_dim * mlp_ratio)`.
            mlp_hidden: (embed_dim as f64 * mlp_ratio) as usize,
            in_channels: int("in_channels", 3)?,
            patch_size: int("patch_size", 14)?,
            temporal_patch_size: int("temporal_patch_size", 2)?,
            spatial_merge_size: int("spatial_merge_size", 2)?,
            rope_theta,
            act,
        };
        if !embed_dim.is_multiple_of(args.num_heads)
            || !(embed_dim / args.num_heads).is_multiple_of(4)
        {
            return Err(VisionConfigError {
                key: "num_heads",
                problem: format!(
                    "embed_dim {embed_dim} over {} heads must give a head size divisible by 4 (two axes of rotary pairs)",
                    args.num_heads
                ),
            });
        }
        Ok(args)
    }

    fn head_dim(&self) -> usize {
        self.embed_dim / self.num_heads
    }

    /// Values per patch row of `pixel_values`.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

/// LayerNorm over the last dimension, with weight and bias (eps 1e-6, as Qwen2-VL's).
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Param<Tensor<B, 1>>,
    #[module(skip)]
    eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    pub fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let mean = x.clone().mean_dim(1);
        let centered = x - mean;
        let var = centered.clone().powi_scalar(2).mean_dim(1);
        let normed = centered / (var + self.eps).sqrt();
        normed * self.weight.val().unsqueeze_dim(0) + self.bias.val().unsqueeze_dim(0)
    }
}

/// Module paths are the checkpoint's names (`blocks.0.attn.qkv.weight`) but for two, which
/// [`on_disk`] translates: the merger's MLP (`merger.fc1` is `merger.mlp.0`, `fc2` is
/// `mlp.2`), and the patch embedding's weight, a Conv3d kernel on disk.
#[derive(Module, Debug)]
pub struct VisionBlock<B: Backend> {
    pub norm1: LayerNorm<B>,
    pub attn: VisionAttention<B>,
    pub norm2: LayerNorm<B>,
    pub mlp: VisionMlp<B>,
}

#[derive(Module, Debug)]
pub struct VisionAttention<B: Backend> {
    pub qkv: Linear<B>,
    pub proj: Linear<B>,
}

#[derive(Module, Debug)]
pub struct VisionMlp<B: Backend> {
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
}

/// The Conv3d patch embedding as a linear map of each patch row (no bias).
#[derive(Module, Debug)]
pub struct PatchEmbed<B: Backend> {
    pub proj: Linear<B>,
}

/// LayerNorm, each 2x2 block's four patches side by side, an MLP to the language model's width.
#[derive(Module, Debug)]
pub struct PatchMerger<B: Backend> {
    pub ln_q: LayerNorm<B>,
    pub fc1: Linear<B>,
    pub fc2: Linear<B>,
}

#[derive(Module, Debug)]
pub struct Qwen2VlVision<B: Backend> {
    pub patch_embed: PatchEmbed<B>,
    pub blocks: Vec<VisionBlock<B>>,
    pub merger: PatchMerger<B>,
    #[module(skip)]
    pub args: Qwen2VlVisionArgs,
}

/// The checkpoint's name and shape for the tower's tensor at module path `path` (relative to
/// the tower): the merger's MLP is `mlp.0`/`mlp.2` there, and the patch embedding's weight the
/// Conv3d kernel `[embed_dim, channels, temporal_patch, patch, patch]` (the model holds it
/// flattened to `[embed_dim, patch_dim]`, the same values in the same order).
pub fn on_disk(path: &str, value: HostTensor, args: &Qwen2VlVisionArgs) -> (String, HostTensor) {
    if path == "patch_embed.proj.weight" {
        return (
            path.to_string(),
            value.reshaped(kernel_shape(args).to_vec()),
        );
    }
    for (module, disk) in [
        ("merger.fc1.", "merger.mlp.0."),
        ("merger.fc2.", "merger.mlp.2."),
    ] {
        if let Some(rest) = path.strip_prefix(module) {
            return (format!("{disk}{rest}"), value);
        }
    }
    (path.to_string(), value)
}

/// The patch embedding's Conv3d kernel shape, as stored.
fn kernel_shape(a: &Qwen2VlVisionArgs) -> [usize; 5] {
    [
        a.embed_dim,
        a.in_channels,
        a.temporal_patch_size,
        a.patch_size,
        a.patch_size,
    ]
}

/// What the tower returns: every patch's last hidden state, and the merged tokens the
/// language model takes in place of its image placeholders.
pub struct VisionOutput<B: Backend> {
    /// `[patches, embed_dim]`.
    pub last_hidden_state: Tensor<B, 2>,
    /// `[patches / merge^2, hidden_size]`.
    pub merged: Tensor<B, 2>,
}

impl<B: Backend> Qwen2VlVision<B> {
    /// Reads the tower's parameters under `prefix` (`model.visual`).
    pub fn load(
        src: &mut dyn ParamSource,
        prefix: &str,
        args: Qwen2VlVisionArgs,
        device: &B::Device,
    ) -> Result<Self, CheckpointError> {
        let a = &args;
        let patch = format!("{prefix}.patch_embed.proj.weight");
        let kernel = kernel_shape(a);
        let patch_weight = src
            .take(&patch, &kernel)?
            .reshaped(vec![a.embed_dim, a.patch_dim()]);
        let patch_embed = PatchEmbed {
            proj: Linear::new(patch_weight.to_tensor(device), None),
        };
        let mut blocks = Vec::with_capacity(a.depth);
        for i in 0..a.depth {
            let p = format!("{prefix}.blocks.{i}");
            let (e, m) = (a.embed_dim, a.mlp_hidden);
            let qkv = linear(src, &format!("{p}.attn.qkv"), 3 * e, e, device)?;
            let proj = linear(src, &format!("{p}.attn.proj"), e, e, device)?;
            let fc1 = linear(src, &format!("{p}.mlp.fc1"), m, e, device)?;
            let fc2 = linear(src, &format!("{p}.mlp.fc2"), e, m, device)?;
            blocks.push(VisionBlock {
                norm1: layer_norm(src, &format!("{p}.norm1"), e, device)?,
                attn: VisionAttention { qkv, proj },
                norm2: layer_norm(src, &format!("{p}.norm2"), e, device)?,
                mlp: VisionMlp { fc1, fc2 },
            });
        }
        let merged = a.embed_dim * a.spatial_merge_size * a.spatial_merge_size;
        let ln_q = layer_norm(src, &format!("{prefix}.merger.ln_q"), a.embed_dim, device)?;
        let fc1 = linear(
            src,
            &format!("{prefix}.merger.mlp.0"),
            merged,
            merged,
            device,
        )?;
        let fc2 = linear(
            src,
            &format!("{prefix}.merger.mlp.2"),
            a.hidden_size,
            merged,
            device,
        )?;
        Ok(Self {
            patch_embed,
            blocks,
            merger: PatchMerger { ln_q, fc1, fc2 },
            args,
        })
    }

    /// The tower on `pixels` (`[patches, patch_dim]`, the processor's rows for `grids`, one
    /// `[t, h, w]` per image in order).
    pub fn forward(&self, pixels: Tensor<B, 2>, grids: &[[usize; 3]]) -> VisionOutput<B> {
        let mode = ForwardMode::default();
        let device = pixels.device();
        let rope = self.rotary(grids, &device);
        let lengths: Vec<usize> = grids.iter().map(|[t, h, w]| t * h * w).collect();
        let mask = mask::within_spans(&lengths, &device);
        let mut x = self.patch_embed.proj.forward(pixels, mode);
        for block in &self.blocks {
            let attn = self.attention(block, block.norm1.forward(x.clone()), &rope, &mask);
            x = x + block.attn.proj.forward(attn, mode);
            let h = block.mlp.fc1.forward(block.norm2.forward(x.clone()), mode);
            let h = match self.args.act {
                VisionAct::QuickGelu => h.clone() * sigmoid(h * 1.702),
                VisionAct::Gelu => gelu(h),
            };
            x = x + block.mlp.fc2.forward(h, mode);
        }
        let m2 = self.args.spatial_merge_size * self.args.spatial_merge_size;
        let [patches, embed] = x.dims();
        let merger = &self.merger;
        let grouped = merger
            .ln_q
            .forward(x.clone())
            .reshape([patches / m2, embed * m2]);
        let merged = merger
            .fc2
            .forward(gelu(merger.fc1.forward(grouped, mode)), mode);
        VisionOutput {
            last_hidden_state: x,
            merged,
        }
    }

    /// Attention within each image (the mask), with the 2D rotary positions, through the
    /// decoder's rope and attention kernels.
    fn attention(
        &self,
        block: &VisionBlock<B>,
        x: Tensor<B, 2>,
        rope: &RopeTables<B>,
        mask: &AttentionMask<B>,
    ) -> Tensor<B, 2> {
        let (heads, hd) = (self.args.num_heads, self.args.head_dim());
        let n = x.dims()[0];
        let qkv = block
            .attn
            .qkv
            .forward(x, ForwardMode::default())
            .reshape([1, n, 3, heads, hd]);
        let part = |i: usize| qkv.clone().narrow(2, i, 1).reshape([1, n, heads, hd]);
        let scale = (hd as f64).powf(-0.5);
        let q = rope::apply(part(0), rope) * scale;
        let k = permute(rope::apply(part(1), rope), [0, 2, 1, 3]);
        let v = permute(part(2), [0, 2, 1, 3]);
        let q = permute(q, [0, 2, 1, 3]);
        attention_by_position(q, k, v, mask, None, None).reshape([n, heads * hd])
    }

    /// Each patch's rotary cos and sin (`[1, patches, heads, head_dim]`): its row and column, in the
    /// processor's 2x2-block order, times `head_dim / 4` frequencies each, the row's then the
    /// column's, repeated for both halves of the head (transformers' axial rope, in f32).
    fn rotary(&self, grids: &[[usize; 3]], device: &B::Device) -> RopeTables<B> {
        let hd = self.args.head_dim();
        let spatial = hd / 2;
        let inv_freq: Vec<f32> = (0..spatial)
            .step_by(2)
            .map(|i| 1.0 / (self.args.rope_theta as f32).powf(i as f32 / spatial as f32))
            .collect();
        let m = self.args.spatial_merge_size;
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &[t, h, w] in grids {
            for _ in 0..t {
                for bh in 0..h / m {
                    for bw in 0..w / m {
                        for mh in 0..m {
                            for mw in 0..m {
                                let (row, col) = ((bh * m + mh) as f32, (bw * m + mw) as f32);
                                let freqs: Vec<f32> = inv_freq
                                    .iter()
                                    .map(|f| row * f)
                                    .chain(inv_freq.iter().map(|f| col * f))
                                    .collect();
                                for _ in 0..self.args.num_heads * 2 {
                                    cos.extend(freqs.iter().map(|f| f.cos()));
                                    sin.extend(freqs.iter().map(|f| f.sin()));
                                }
                            }
                        }
                    }
                }
            }
        }
        let heads = self.args.num_heads;
        let n = cos.len() / (heads * hd);
        let tensor = |v: Vec<f32>| Tensor::from_data(TensorData::new(v, [1, n, heads, hd]), device);
        RopeTables::new(tensor(cos), tensor(sin), device)
    }
}

fn linear<B: Backend>(
    src: &mut dyn ParamSource,
    name: &str,
    out: usize,
    inp: usize,
    device: &B::Device,
) -> Result<Linear<B>, CheckpointError> {
    let w = src.take(&format!("{name}.weight"), &[out, inp])?;
    let b = src.take(&format!("{name}.bias"), &[out])?;
    Ok(Linear::new(w.to_tensor(device), Some(b.to_tensor(device))))
}

fn layer_norm<B: Backend>(
    src: &mut dyn ParamSource,
    prefix: &str,
    dim: usize,
    device: &B::Device,
) -> Result<LayerNorm<B>, CheckpointError> {
    Ok(LayerNorm {
        weight: Param::from_tensor(
            src.take(&format!("{prefix}.weight"), &[dim])?
                .to_tensor(device),
        ),
        bias: Param::from_tensor(
            src.take(&format!("{prefix}.bias"), &[dim])?
                .to_tensor(device),
        ),
        eps: 1e-6,
    })
}
