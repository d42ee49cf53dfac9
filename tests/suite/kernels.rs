//! The fused CPU kernels against burn's own composed operations on the same backend: values
//! and gradients, with and without autodiff, including masked (-1e30) scores and a row whose
//! gradient is zero.

use burn::backend::Autodiff;
use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Int, Tensor, TensorData};
use burn_flex::Flex;
use tune::kernels;

type Ad = Autodiff<Flex>;

fn close<B: Backend, const D: usize>(what: &str, got: Tensor<B, D>, want: Tensor<B, D>, tol: f32) {
    let got = got.into_data().to_vec::<f32>().unwrap();
    let want = want.into_data().to_vec::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= tol, "{what}: max abs diff {worst} > {tol}");
}

thread_local! {
    /// Each test's own seeded stream (libtest runs each test on its own thread): the inputs are
    /// the same on every run, whatever runs beside, so a tolerance that holds once always
    /// holds. burn's generator is one per process and other tests draw from it meanwhile.
    static INPUTS: std::cell::RefCell<rand::rngs::StdRng> =
        std::cell::RefCell::new(rand::SeedableRng::seed_from_u64(17));
}

fn random<B: Backend, const D: usize>(shape: [usize; D], scale: f64) -> Tensor<B, D> {
    use rand_distr::Distribution as _;
    let normal = rand_distr::Normal::new(0.0, scale).expect("a finite scale");
    let count = shape.iter().product();
    let values: Vec<f32> = INPUTS.with(|rng| {
        let mut rng = rng.borrow_mut();
        (0..count)
            .map(|_| normal.sample(&mut *rng) as f32)
            .collect()
    });
    Tensor::from_data(TensorData::new(values, shape), &Default::default())
}

#[test]
fn softmax_matches_burn_with_gradients_and_masking() {
    let device = Default::default();
    // Scores with a causal -1e30 mask, as attention builds them.
    let mut mask = vec![0.0f32; 6 * 6];
    for i in 0..6 {
        for j in i + 1..6 {
            mask[i * 6 + j] = -1.0e30;
        }
    }
    let mask = Tensor::<Flex, 2>::from_data(TensorData::new(mask, [6, 6]), &device);
    let scores = random::<Flex, 4>([2, 3, 6, 6], 3.0) + mask.unsqueeze::<4>();
    let weights = random::<Flex, 4>([2, 3, 6, 6], 1.0);

    close(
        "softmax forward (Flex)",
        kernels::softmax(scores.clone()),
        activation::softmax(scores.clone(), 3),
        1e-6,
    );

    let run = |fused: bool| {
        let x = Tensor::<Ad, 4>::from_inner(scores.clone()).require_grad();
        let y = if fused {
            kernels::softmax(x.clone())
        } else {
            activation::softmax(x.clone(), 3)
        };
        let grads = (y.clone() * Tensor::from_inner(weights.clone()))
            .sum()
            .backward();
        (y.inner(), x.grad(&grads).unwrap())
    };
    let (y_fused, g_fused) = run(true);
    let (y_burn, g_burn) = run(false);
    close("softmax forward (autodiff)", y_fused, y_burn, 1e-6);
    close("softmax gradient", g_fused, g_burn, 1e-5);
}

#[test]
fn silu_matches_burn_with_gradients() {
    let x0 = random::<Flex, 2>([17, 129], 4.0);
    let w = random::<Flex, 2>([17, 129], 1.0);
    close(
        "silu forward (Flex)",
        kernels::silu(x0.clone()),
        activation::silu(x0.clone()),
        1e-5,
    );
    let run = |fused: bool| {
        let x = Tensor::<Ad, 2>::from_inner(x0.clone()).require_grad();
        let y = if fused {
            kernels::silu(x.clone())
        } else {
            activation::silu(x.clone())
        };
        let grads = (y.clone() * Tensor::from_inner(w.clone())).sum().backward();
        (y.inner(), x.grad(&grads).unwrap())
    };
    let (y_fused, g_fused) = run(true);
    let (y_burn, g_burn) = run(false);
    close("silu forward (autodiff)", y_fused, y_burn, 1e-5);
    close("silu gradient", g_fused, g_burn, 1e-5);
}

/// The fused pair against the two ops the MLP composed before (the SiLU above, then burn's
/// product): bit for bit, values and gradients.
#[test]
fn swiglu_matches_silu_then_product_with_both_gradients() {
    let gate0 = random::<Flex, 2>([17, 129], 4.0);
    let up0 = random::<Flex, 2>([17, 129], 2.0);
    let w = random::<Flex, 2>([17, 129], 1.0);
    close(
        "swiglu forward (Flex)",
        kernels::swiglu(gate0.clone(), up0.clone()),
        kernels::silu(gate0.clone()) * up0.clone(),
        0.0,
    );
    // Each input alone and both together requiring a gradient.
    for (gate_tracked, up_tracked) in [(true, true), (true, false), (false, true)] {
        let run = |fused: bool| {
            let mut gate = Tensor::<Ad, 2>::from_inner(gate0.clone());
            let mut up = Tensor::<Ad, 2>::from_inner(up0.clone());
            if gate_tracked {
                gate = gate.require_grad();
            }
            if up_tracked {
                up = up.require_grad();
            }
            let y = if fused {
                kernels::swiglu(gate.clone(), up.clone())
            } else {
                kernels::silu(gate.clone()) * up.clone()
            };
            let grads = (y.clone() * Tensor::from_inner(w.clone())).sum().backward();
            (y.inner(), gate.grad(&grads), up.grad(&grads))
        };
        let (y_fused, dg_fused, du_fused) = run(true);
        let (y_burn, dg_burn, du_burn) = run(false);
        close("swiglu forward (autodiff)", y_fused, y_burn, 0.0);
        assert_eq!(dg_fused.is_some(), gate_tracked, "gate gradient present");
        assert_eq!(du_fused.is_some(), up_tracked, "up gradient present");
        if let (Some(a), Some(b)) = (dg_fused, dg_burn) {
            close("swiglu gate gradient", a, b, 0.0);
        }
        if let (Some(a), Some(b)) = (du_fused, du_burn) {
            close("swiglu up gradient", a, b, 0.0);
        }
    }
}

#[test]
fn target_log_probs_match_burn_with_gradients() {
    let device = Default::default();
    let (rows, vocab) = (9, 1000);
    let logits0 = random::<Flex, 2>([rows, vocab], 5.0);
    let targets: Vec<i32> = (0..rows as i32).map(|r| (r * 331) % vocab as i32).collect();
    // Row 4 is "ignored": its upstream gradient is zero.
    let row_weights: Vec<f32> = (0..rows)
        .map(|r| if r == 4 { 0.0 } else { 1.0 + r as f32 })
        .collect();
    let row_weights = Tensor::<Flex, 1>::from_data(TensorData::new(row_weights, [rows]), &device);

    let composed = |logits: Tensor<Ad, 2>| {
        let idx =
            Tensor::<Ad, 2, Int>::from_data(TensorData::new(targets.clone(), [rows, 1]), &device);
        activation::log_softmax(logits, 1)
            .gather(1, idx)
            .reshape([rows])
    };
    close(
        "target log-probs forward (Flex)",
        kernels::target_log_probs(logits0.clone(), &targets),
        composed(Tensor::from_inner(logits0.clone())).inner(),
        1e-5,
    );
    let run = |fused: bool| {
        let x = Tensor::<Ad, 2>::from_inner(logits0.clone()).require_grad();
        let y = if fused {
            kernels::target_log_probs(x.clone(), &targets)
        } else {
            composed(x.clone())
        };
        let grads = (y.clone() * Tensor::from_inner(row_weights.clone()))
            .sum()
            .backward();
        (y.inner(), x.grad(&grads).unwrap())
    };
    let (y_fused, g_fused) = run(true);
    let (y_burn, g_burn) = run(false);
    close("target log-probs (autodiff)", y_fused, y_burn, 1e-5);
    // The gradient is `w * (onehot - softmax)` with row weights up to 9: 1e-5 relative to
    // them (an absolute 1e-5 failed once in CI at 1.05e-5, a few float32 roundings of 9).
    close("target log-probs gradient", g_fused, g_burn, 9e-5);
}

/// The fused masked softmax against the generic path other backends take (forced here by
/// running it in f64, which the fused kernels leave to burn), with per-row packed documents.
#[test]
fn masked_softmax_matches_the_generic_broadcast_path() {
    use burn::tensor::DType;
    use tune::models::mask;
    let device = Default::default();
    let (batch, kv_heads, n_rep, seq) = (2, 2, 3, 7);
    let documents: Vec<u32> = vec![0, 0, 0, 1, 1, 2, 2, 0, 0, 0, 0, 0, 1, 1];
    let m = mask::causal::<Flex>(batch, seq, 0, Some(&documents), &device);
    assert_eq!(m.dims, [batch, seq, seq]);
    let scores = random::<Flex, 4>([batch, kv_heads, n_rep * seq, seq], 2.0);
    let fused = kernels::masked_softmax(scores.clone(), &m);
    let m64 = kernels::AttentionMask {
        tensor: m.tensor.clone().cast(DType::F64),
        ..m.clone()
    };
    let generic = kernels::masked_softmax(scores.cast(DType::F64), &m64).cast(DType::F32);
    close("masked softmax", fused.clone(), generic, 1e-6);
    // Query 3 of batch 0 starts document 1: it sees only itself.
    let row = fused
        .slice([0..1, 0..1, 3..4, 0..seq])
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert_eq!(row, vec![0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0]);
}

#[test]
fn permute_matches_burn_with_gradients() {
    let x0 = random::<Flex, 5>([2, 5, 3, 2, 4], 1.0);
    let w = random::<Flex, 5>([2, 3, 2, 5, 4], 1.0);
    let axes = [0, 2, 3, 1, 4];
    close(
        "permute (Flex)",
        kernels::permute(x0.clone(), axes),
        x0.clone().permute(axes),
        0.0,
    );
    // A permute of a strided view (the input is itself a transposed view).
    let view = x0.clone().swap_dims(1, 2);
    close(
        "permute of a view",
        kernels::permute(view.clone(), [0, 1, 3, 2, 4]),
        view.permute([0, 1, 3, 2, 4]),
        0.0,
    );
    let run = |fused: bool| {
        let x = Tensor::<Ad, 5>::from_inner(x0.clone()).require_grad();
        let y = if fused {
            kernels::permute(x.clone(), axes)
        } else {
            x.clone().permute(axes)
        };
        let grads = (y.clone() * Tensor::from_inner(w.clone())).sum().backward();
        (y.inner(), x.grad(&grads).unwrap())
    };
    let (y_fused, g_fused) = run(true);
    let (y_burn, g_burn) = run(false);
    close("permute (autodiff)", y_fused, y_burn, 0.0);
    close("permute gradient", g_fused, g_burn, 0.0);
}

/// The fused Adam(W) update against the same formula composed from burn's ops.
#[test]
fn fused_adam_matches_the_composed_update() {
    use tune::kernels::optim::{AdamStep, adam};
    let n = 50_001;
    let p = random::<Flex, 1>([n], 1.0);
    let g = random::<Flex, 1>([n], 0.1);
    let m = random::<Flex, 1>([n], 0.01);
    let v = random::<Flex, 1>([n], 0.001).abs();
    for (decay, l2) in [(1.0 - 1e-3 * 0.01, 0.0), (1.0, 0.01)] {
        let (beta1, beta2, eps, lr, t, scale) = (0.9f64, 0.999f64, 1e-8, 1e-3, 3, 0.25);
        let bias1 = 1.0 - beta1.powi(t);
        let bias2_sqrt = (1.0 - beta2.powi(t)).sqrt();
        let step = AdamStep {
            grad_scale: scale as f32,
            decay: decay as f32,
            l2: l2 as f32,
            beta1: beta1 as f32,
            one_minus_beta1: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            one_minus_beta2: (1.0 - beta2) as f32,
            bias2_sqrt: bias2_sqrt as f32,
            eps: eps as f32,
            step_size: (lr / bias1) as f32,
        };
        let (p2, m2, v2) = adam(p.clone(), g.clone(), m.clone(), v.clone(), step).unwrap();
        let grad = g.clone() * scale + p.clone() * l2;
        let m_want = m.clone() * beta1 + grad.clone() * (1.0 - beta1);
        let v_want = v.clone() * beta2 + grad.clone() * grad * (1.0 - beta2);
        let denom = v_want.clone().sqrt() / bias2_sqrt + eps;
        let p_want = p.clone() * decay - m_want.clone() / denom * (lr / bias1);
        close("exp_avg", m2, m_want, 1e-7);
        close("exp_avg_sq", v2, v_want, 1e-9);
        close("param", p2, p_want, 1e-6);
    }
}

/// An AdamW step's constants (beta2 0.999, a gradient scale of 0.5) with weight decay `decay`.
fn adamw_step(decay: f32) -> tune::kernels::optim::AdamStep {
    tune::kernels::optim::AdamStep {
        grad_scale: 0.5,
        decay,
        l2: 0.0,
        beta1: 0.9,
        one_minus_beta1: 0.1,
        beta2: 0.999,
        one_minus_beta2: 1e-3,
        bias2_sqrt: 0.05,
        eps: 1e-8,
        step_size: 1e-3,
    }
}

/// A weight gradient left as a transposed view (burn's matmul backward) is read in tiles by
/// the fused update, not copied first: bit for bit the update with the same gradient
/// contiguous, for row counts that do and do not fill the last tile.
#[test]
fn fused_adam_reads_a_transposed_gradient_as_the_contiguous_one() {
    use tune::kernels::optim::adam;
    let step = adamw_step(1.0 - 1e-5);
    // Whole tiles, a partial last one, a LoRA A (rank rows) and a LoRA B (rank columns).
    for (rows, cols) in [(1024, 64), (1000, 129), (8, 96), (5000, 8)] {
        let n = rows * cols;
        let p = random::<Flex, 1>([n], 1.0);
        let m = random::<Flex, 1>([n], 0.01);
        let v = random::<Flex, 1>([n], 0.001).abs();
        // `[rows, cols]` as a view of a contiguous `[cols, rows]` buffer.
        let transposed = random::<Flex, 2>([cols, rows], 0.1).transpose();
        let contiguous = Tensor::<Flex, 2>::from_data(transposed.to_data(), &Default::default());
        let bits = |t: Tensor<Flex, 1>| -> Vec<u32> {
            t.into_data()
                .to_vec::<f32>()
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        let (p1, m1, v1) = adam(p.clone(), transposed, m.clone(), v.clone(), step).unwrap();
        let (p2, m2, v2) = adam(p, contiguous, m, v, step).unwrap();
        assert_eq!(bits(p1), bits(p2), "param {rows}x{cols}");
        assert_eq!(bits(m1), bits(m2), "exp_avg {rows}x{cols}");
        assert_eq!(bits(v1), bits(v2), "exp_avg_sq {rows}x{cols}");
    }
}

/// One fused-attention case: `[batch, kv_heads, n_rep * q_len, dim]` queries against `k_len`
/// keys through `mask`, fused against composed, values and the gradients of q, k and v (and of
/// one sink logit per query head, with `sinks`).
fn check_attention<B: Backend>(
    what: &str,
    [batch, kv_heads, n_rep, dim]: [usize; 4],
    mask: &kernels::AttentionMask<B>,
    softcap: Option<f64>,
    sinks: bool,
) {
    let [_, q_len, k_len] = mask.dims;
    let rows = n_rep * q_len;
    let q = random::<B, 4>([batch, kv_heads, rows, dim], 1.0) * (dim as f64).powf(-0.5);
    let k = random::<B, 4>([batch, kv_heads, k_len, dim], 1.0);
    let v = random::<B, 4>([batch, kv_heads, k_len, dim], 1.0);
    let w = random::<B, 4>([batch, kv_heads, rows, dim], 1.0);
    let sinks = sinks.then(|| random::<B, 1>([kv_heads * n_rep], 1.0));
    let tol = 1e-5;
    let grouped = || {
        let (q, k, v) = (q.clone(), k.clone(), v.clone());
        kernels::attention(q, k, v, mask, softcap, sinks.clone())
    };
    close(
        &format!("{what}: output (no autodiff)"),
        grouped(),
        kernels::composed_attention(
            q.clone(),
            k.clone(),
            v.clone(),
            mask,
            softcap,
            sinks.clone(),
        ),
        tol,
    );
    type Ad<B> = Autodiff<B>;
    let ad_mask = kernels::AttentionMask::<Ad<B>> {
        host: mask.host.clone(),
        spans: mask.spans.clone(),
        dims: mask.dims,
        tensor: Tensor::from_inner(mask.tensor.clone()),
    };
    // The output of `attend` and the q, k, v (and sinks) gradients of `sum(output * weights)`.
    type Attend<'a, B> = &'a dyn Fn(
        Tensor<Ad<B>, 4>,
        Tensor<Ad<B>, 4>,
        Tensor<Ad<B>, 4>,
        Option<Tensor<Ad<B>, 1>>,
    ) -> Tensor<Ad<B>, 4>;
    let with_grads = |weights: &Tensor<B, 4>, attend: Attend<B>| {
        let [q, k, v] =
            [&q, &k, &v].map(|t| Tensor::<Ad<B>, 4>::from_inner(t.clone()).require_grad());
        let s = sinks
            .as_ref()
            .map(|s| Tensor::<Ad<B>, 1>::from_inner(s.clone()).require_grad());
        let out = attend(q.clone(), k.clone(), v.clone(), s.clone());
        let grads = (out.clone() * Tensor::from_inner(weights.clone()))
            .sum()
            .backward();
        let [dq, dk, dv] = [&q, &k, &v].map(|t| t.grad(&grads).unwrap());
        let ds = s.map(|s| s.grad(&grads).unwrap());
        (out.inner(), dq, dk, dv, ds)
    };
    let run = |fused: bool| {
        with_grads(&w, &|q, k, v, s| {
            if fused {
                kernels::attention(q, k, v, &ad_mask, softcap, s)
            } else {
                kernels::composed_attention(q, k, v, &ad_mask, softcap, s)
            }
        })
    };
    let (fused, composed) = (run(true), run(false));
    close(&format!("{what}: output"), fused.0, composed.0, tol);
    close(&format!("{what}: dq"), fused.1, composed.1, tol);
    close(&format!("{what}: dk"), fused.2, composed.2, tol);
    close(&format!("{what}: dv"), fused.3, composed.3, tol);
    if let (Some(fused), Some(composed)) = (fused.4, composed.4) {
        close(&format!("{what}: dsinks"), fused, composed, tol);
    }

    // The output laid out by position (the decoder's): the grouped output's rows moved, bit
    // for bit, with the same gradients.
    fn by_position<B: Backend>(x: Tensor<B, 4>, [n_rep, q_len]: [usize; 2]) -> Tensor<B, 4> {
        let [batch, kv_heads, _, dim] = x.dims();
        kernels::permute(
            x.reshape([batch, kv_heads, n_rep, q_len, dim]),
            [0, 3, 1, 2, 4],
        )
        .reshape([batch, q_len, kv_heads * n_rep, dim])
    }
    let sizes = [n_rep, q_len];
    close(
        &format!("{what}: by-position output (no autodiff)"),
        kernels::attention_by_position(
            q.clone(),
            k.clone(),
            v.clone(),
            mask,
            softcap,
            sinks.clone(),
        ),
        by_position(grouped(), sizes),
        0.0,
    );
    let w_by_position = by_position(w.clone(), sizes);
    let run_by_position = |direct: bool| {
        with_grads(&w_by_position, &|q, k, v, s| {
            if direct {
                kernels::attention_by_position(q, k, v, &ad_mask, softcap, s)
            } else {
                by_position(kernels::attention(q, k, v, &ad_mask, softcap, s), sizes)
            }
        })
    };
    let (direct, moved) = (run_by_position(true), run_by_position(false));
    close(
        &format!("{what}: by-position output"),
        direct.0,
        moved.0,
        0.0,
    );
    close(&format!("{what}: by-position dq"), direct.1, moved.1, 0.0);
    close(&format!("{what}: by-position dk"), direct.2, moved.2, 0.0);
    close(&format!("{what}: by-position dv"), direct.3, moved.3, 0.0);
}

#[test]
fn fused_attention_matches_the_composed_path_with_gradients() {
    fused_attention_cases::<Flex>(&Default::default());
}

/// The fused attention against the composed path on backend `B` (the CPU's kernel here, the
/// cubecl kernels in `gpu`): values and q, k, v gradients over grouped queries, packs, sliding
/// windows with soft-capping, cached keys, one position and a fully masked row.
pub(crate) fn fused_attention_cases<B: Backend>(device: &B::Device) {
    use tune::models::mask;
    // Causal, several query and key blocks with partial last ones, grouped queries.
    let causal = mask::causal::<B>(2, 130, 0, None, device);
    check_attention("causal", [2, 2, 3, 16], &causal, None, false);
    // A real model's head size (SmolLM2, Llama 3.2 1B): 64.
    let long_heads = mask::causal::<B>(1, 70, 0, None, device);
    check_attention("head dim 64", [1, 2, 2, 64], &long_heads, None, false);
    // A head size that is not a multiple of the cubecl kernels' 8 lanes.
    check_attention("head dim 12", [1, 2, 2, 12], &long_heads, None, false);
    // Packed documents: a mask per batch row, blocks on document edges.
    let docs: Vec<u32> = (0..2 * 90)
        .map(|i| ((i % 90) / 37 + i / 90) as u32)
        .collect();
    let packed = mask::causal::<B>(2, 90, 0, Some(&docs), device);
    assert_eq!(packed.dims[0], 2);
    check_attention("packed", [2, 1, 2, 8], &packed, None, false);
    // Gemma 2: a sliding window and soft-capped scores.
    let window = mask::causal_window::<B>(1, 150, 0, Default::default(), Some(40), device);
    check_attention(
        "sliding + softcap",
        [1, 2, 2, 16],
        &window,
        Some(5.0),
        false,
    );
    // Cached keys: a chunk of queries after 100 positions, and one decoding step.
    let chunk = mask::causal::<B>(1, 5, 100, None, device);
    check_attention("offset", [1, 3, 3, 16], &chunk, None, false);
    // One query position (a decoding step; on the CPU every query head of a group in one
    // task), soft-capped, and with left-padded rows (GRPO's prompts decoded together).
    let step = mask::causal::<B>(2, 1, 77, None, device);
    check_attention("one position", [2, 2, 4, 8], &step, None, false);
    check_attention(
        "one position + softcap",
        [2, 2, 4, 8],
        &step,
        Some(5.0),
        false,
    );
    let pads = [0usize, 9];
    let padded = mask::Separations {
        left_padding: Some(&pads),
        ..Default::default()
    };
    let padded_step = mask::causal_window::<B>(2, 1, 40, padded, None, device);
    assert_eq!(padded_step.dims[0], 2);
    check_attention(
        "one position, left-padded",
        [2, 1, 3, 64],
        &padded_step,
        None,
        false,
    );
    // A row that hides every key: uniform weights, as the composed softmax gives.
    let mut host = vec![0.0f32; 3 * 70];
    host[70..140].fill(-1.0e30);
    host[140 + 65..].fill(-1.0e30);
    let odd = kernels::AttentionMask::<B>::new(host, [1, 3, 70], device);
    check_attention("fully masked row", [1, 1, 1, 8], &odd, None, false);
    // gpt-oss's sinks: with grouped queries, a sliding window, packs, one position, and a row
    // that hides every key (its sink takes all the weight: the output is zero).
    check_attention("sinks", [2, 2, 3, 16], &causal, None, true);
    check_attention("sinks + sliding", [1, 2, 2, 16], &window, None, true);
    check_attention("sinks + packed", [2, 1, 2, 8], &packed, None, true);
    check_attention("sinks + one position", [2, 2, 4, 8], &step, None, true);
    check_attention("sinks + fully masked row", [1, 1, 1, 8], &odd, None, true);
}

#[test]
fn fused_attention_reads_cached_keys_in_place() {
    use tune::models::mask;
    let device = Default::default();
    // Keys and values as the generation cache hands them over: the filled prefix of a larger
    // buffer (rows `dim` apart, heads `capacity * dim` apart).
    let (batch, kv_heads, n_rep, dim, len, capacity) = (2, 2, 2, 8, 70, 128);
    let buffer = |_| random::<Flex, 4>([batch, kv_heads, capacity, dim], 1.0);
    let (kb, vb) = (buffer(0), buffer(1));
    let view = |b: &Tensor<Flex, 4>| b.clone().slice([0..batch, 0..kv_heads, 0..len, 0..dim]);
    let (k, v) = (view(&kb), view(&vb));
    assert!(!k.clone().into_primitive().tensor().is_contiguous());
    let m = mask::causal::<Flex>(batch, 3, len - 3, None, &device);
    let q = random::<Flex, 4>([batch, kv_heads, n_rep * 3, dim], 0.3);
    let contiguous = |t: Tensor<Flex, 4>| Tensor::<Flex, 4>::from_data(t.into_data(), &device);
    close(
        "cache view",
        kernels::attention(q.clone(), k.clone(), v.clone(), &m, None, None),
        kernels::attention(q, contiguous(k), contiguous(v), &m, None, None),
        0.0,
    );
}

/// Rounding to bf16 as tune's kernels and PyTorch round (to nearest, ties to even, from the
/// f32 value). burn-flex's own cast goes through `bf16::from_f64`, which rounds some values
/// differently.
trait RoundBf16 {
    fn round_bf16(self) -> Self;
}

impl<B: Backend, const D: usize> RoundBf16 for Tensor<B, D> {
    fn round_bf16(self) -> Self {
        kernels::cast(self, DType::BF16)
    }
}

/// bf16 inputs, bf16 values exactly (random normals rounded to bf16).
fn random_bf16<B: Backend, const D: usize>(shape: [usize; D]) -> Tensor<B, D> {
    random::<B, D>(shape, 1.0).round_bf16()
}

fn bits_equal<B: Backend, const D: usize>(what: &str, got: Tensor<B, D>, want: Tensor<B, D>) {
    assert_eq!(got.dtype(), DType::BF16, "{what}: dtype");
    close(what, got.cast(DType::F32), want.cast(DType::F32), 0.0);
}

/// `got` (bf16) is `want` (f32) rounded to bf16, or its other bf16 neighbour: a GEMM whose f32
/// sums run in another order may land on the other side of a rounding boundary.
fn rounded_from<B: Backend, const D: usize>(what: &str, got: Tensor<B, D>, want: Tensor<B, D>) {
    assert_eq!(got.dtype(), DType::BF16, "{what}: dtype");
    let got = got.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
    let want = want.into_data().to_vec::<f32>().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        // One bf16 step at `w`'s magnitude: 2^-7 of its power of two.
        let ulp = 2f32.powi(w.abs().max(1e-30).log2().floor() as i32 - 7);
        // Plus the f32 sums' own reordering error, for values near 0 after cancellation.
        assert!(
            (g - w).abs() <= ulp * 1.01 + 1e-5,
            "{what}[{i}]: {g} is not {w} rounded to bf16"
        );
    }
}

/// `kernels::matmul` on f32 (its own Flex op, calling the gemm crate for single matrices)
/// against burn's matmul: bit for bit on plain matrices, forward and both gradients, for a
/// transposed weight view, a product big enough to run on every thread, one row (times a small
/// weight), one column; within rounding for 2-64 rows times a transposed weight, and one row
/// times one of 128 KB or more (`kernels/f32_skinny.rs`, which sums in another order), and for
/// batched and broadcast operands (burn-flex's batched path).
#[test]
fn f32_matmul_matches_burn_with_gradients() {
    // (what, lhs shape, rhs shape, rhs a transposed view, tolerance)
    type Case = (&'static str, [usize; 2], [usize; 2], bool, f32);
    let cases: Vec<Case> = vec![
        ("transposed weight", [77, 70], [50, 70], true, 0.0),
        (
            "a few rows, transposed weight",
            [37, 70],
            [50, 70],
            true,
            5e-5,
        ),
        (
            "parallel, transposed weight",
            [256, 96],
            [320, 96],
            true,
            0.0,
        ),
        ("one row", [1, 70], [70, 33], false, 0.0),
        (
            "one row, small transposed weight",
            [1, 70],
            [50, 70],
            true,
            0.0,
        ),
        (
            "one row, transposed weight of 128 KB",
            [1, 256],
            [160, 256],
            true,
            5e-5,
        ),
        ("one column", [77, 70], [70, 1], false, 0.0),
    ];
    let weight_view = |r: Tensor<Ad, 2>, transpose: bool| if transpose { r.transpose() } else { r };
    for (what, lhs_shape, rhs_shape, transpose_rhs, tolerance) in cases {
        let lhs = random::<Flex, 2>(lhs_shape, 1.0);
        let rhs = random::<Flex, 2>(rhs_shape, 1.0);
        let flex_rhs = if transpose_rhs {
            rhs.clone().transpose()
        } else {
            rhs.clone()
        };
        close(
            &format!("{what}: forward (Flex)"),
            kernels::matmul(lhs.clone(), flex_rhs.clone()),
            lhs.clone().matmul(flex_rhs),
            tolerance,
        );
        // The same upstream weights for both runs, drawn once: re-seeding burn's global
        // generator between them raced with the other tests drawing from it in parallel.
        let out_cols = if transpose_rhs {
            rhs_shape[0]
        } else {
            rhs_shape[1]
        };
        let upstream = random::<Flex, 2>([lhs_shape[0], out_cols], 1.0);
        let run = |fused: bool| {
            let l = Tensor::<Ad, 2>::from_inner(lhs.clone()).require_grad();
            let r = Tensor::<Ad, 2>::from_inner(rhs.clone()).require_grad();
            let r_view = weight_view(r.clone(), transpose_rhs);
            let y = if fused {
                kernels::matmul(l.clone(), r_view)
            } else {
                l.clone().matmul(r_view)
            };
            let grads = (y.clone() * Tensor::from_inner(upstream.clone()))
                .sum()
                .backward();
            (y.inner(), l.grad(&grads).unwrap(), r.grad(&grads).unwrap())
        };
        let got = run(true);
        let want = run(false);
        close(&format!("{what}: forward"), got.0, want.0, tolerance);
        close(&format!("{what}: lhs grad"), got.1, want.1, tolerance);
        close(&format!("{what}: rhs grad"), got.2, want.2, tolerance);
    }
    for (what, lhs_shape, rhs_shape) in [
        ("batched", [2, 3, 17, 9], [2, 3, 9, 11]),
        ("broadcast rhs", [2, 3, 17, 9], [1, 1, 9, 11]),
        ("leading ones", [1, 1, 17, 9], [1, 1, 9, 11]),
    ] {
        let lhs = random::<Flex, 4>(lhs_shape, 1.0);
        let rhs = random::<Flex, 4>(rhs_shape, 1.0);
        let run = |fused: bool| {
            let l = Tensor::<Ad, 4>::from_inner(lhs.clone()).require_grad();
            let r = Tensor::<Ad, 4>::from_inner(rhs.clone()).require_grad();
            let y = if fused {
                kernels::matmul(l.clone(), r.clone())
            } else {
                l.clone().matmul(r.clone())
            };
            let grads = y.clone().sum().backward();
            (y.inner(), l.grad(&grads).unwrap(), r.grad(&grads).unwrap())
        };
        let (got, want) = (run(true), run(false));
        close(&format!("{what}: forward"), got.0, want.0, 1e-5);
        close(&format!("{what}: lhs grad"), got.1, want.1, 1e-5);
        close(&format!("{what}: rhs grad"), got.2, want.2, 1e-4);
    }
}

/// `kernels::matmul` on bf16 (its own Flex op) is the f32 product of the same values rounded
/// once to bf16, forward and both gradients, for a transposed weight view, batched operands
/// and a broadcast right operand (whose gradient sums over the batch in f32 before rounding).
/// Shapes with at least 32 output columns take the native bf16 GEMM on CPUs with AVX512-BF16.
#[test]
fn bf16_matmul_is_the_rounded_f32_product_with_gradients() {
    let cases: Vec<(&str, Vec<usize>, Vec<usize>, bool)> = vec![
        ("2d, transposed weight", vec![37, 70], vec![50, 70], true),
        ("2d, narrow", vec![37, 70], vec![70, 8], false),
        ("batched", vec![2, 3, 17, 9], vec![2, 3, 9, 11], false),
        ("broadcast rhs", vec![2, 3, 17, 9], vec![1, 1, 9, 11], false),
    ];
    for (what, lhs_shape, rhs_shape, transpose_rhs) in cases {
        let lhs = random_bf16::<Flex, 4>(pad4(&lhs_shape));
        let rhs = random_bf16::<Flex, 4>(pad4(&rhs_shape));
        let out_shape = kernels::matmul(lhs.clone(), view(rhs.clone(), transpose_rhs)).dims();
        let w = random_bf16::<Flex, 4>(out_shape);
        let f32_of = |t: &Tensor<Flex, 4>| t.clone().cast(DType::F32);

        // Without autodiff.
        rounded_from(
            &format!("{what}: forward (Flex)"),
            kernels::matmul(lhs.clone(), view(rhs.clone(), transpose_rhs)),
            f32_of(&lhs).matmul(view(f32_of(&rhs), transpose_rhs)),
        );

        // With autodiff, against f32 autodiff of the same values.
        let run = |dtype: DType| {
            let l = Tensor::<Ad, 4>::from_inner(lhs.clone().cast(dtype)).require_grad();
            let r = Tensor::<Ad, 4>::from_inner(rhs.clone().cast(dtype)).require_grad();
            let y = kernels::matmul(l.clone(), view(r.clone(), transpose_rhs));
            let grads = (y.clone() * Tensor::from_inner(w.clone().cast(dtype)))
                .sum()
                .backward();
            let [dl, dr] = [&l, &r].map(|t| t.grad(&grads).unwrap());
            (y.inner(), dl, dr)
        };
        let (got, want) = (run(DType::BF16), run(DType::F32));
        rounded_from(&format!("{what}: forward"), got.0, want.0);
        rounded_from(&format!("{what}: lhs grad"), got.1, want.1);
        rounded_from(&format!("{what}: rhs grad"), got.2, want.2);
    }
}

/// `r` with its last two dimensions swapped (a view) when `transpose`.
fn view<B: Backend>(r: Tensor<B, 4>, transpose: bool) -> Tensor<B, 4> {
    if transpose { r.swap_dims(2, 3) } else { r }
}

/// A 2-d shape as `[1, 1, rows, cols]`, a 4-d one as it is.
fn pad4(shape: &[usize]) -> [usize; 4] {
    match *shape {
        [r, c] => [1, 1, r, c],
        [a, b, r, c] => [a, b, r, c],
        _ => unreachable!("test shapes are 2-d or 4-d"),
    }
}

/// bf16 parameters and moments (a full fine-tune with `dtype: bf16` on the CPU) take the fused
/// update through f32: bit for bit the f32 update of the widened values rounded once to bf16
/// (PyTorch's fused Adam), for a contiguous and a transposed gradient.
#[test]
fn fused_adam_updates_bf16_through_f32_rounding_once() {
    use tune::kernels::optim::adam;
    let step = adamw_step(1.0 - 1e-3);
    let (rows, cols) = (1000, 129);
    let n = rows * cols;
    let p = random_bf16::<Flex, 1>([n]);
    let m = (random::<Flex, 1>([n], 0.01)).round_bf16();
    let v = (random::<Flex, 1>([n], 0.001).abs()).round_bf16();
    let transposed = (random::<Flex, 2>([cols, rows], 0.1))
        .round_bf16()
        .transpose();
    let contiguous = transposed.clone().reshape([n]);
    let f32_of = |t: &Tensor<Flex, 1>| t.clone().cast(DType::F32);
    let (pw, mw, vw) = adam(
        f32_of(&p),
        f32_of(&contiguous),
        f32_of(&m),
        f32_of(&v),
        step,
    )
    .unwrap();
    for (what, grad) in [
        ("contiguous", contiguous.clone().reshape([rows, cols])),
        ("transposed", transposed),
    ] {
        let (p2, m2, v2) = adam(p.clone(), grad, m.clone(), v.clone(), step).unwrap();
        bits_equal(&format!("{what}: param"), p2, pw.clone().round_bf16());
        bits_equal(&format!("{what}: exp_avg"), m2, mw.clone().round_bf16());
        bits_equal(&format!("{what}: exp_avg_sq"), v2, vw.clone().round_bf16());
    }
}
