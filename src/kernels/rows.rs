//! Row-wise kernels over contiguous `f32` buffers `[rows, row_len]`: softmax, log-probability
//! of a target (cross-entropy) and SiLU, each forward and backward. Rows are split across
//! rayon's pool in chunks big enough to pay for the hand-off.

use rayon::prelude::*;

use super::simd::{self, multiversion};

/// Elements per parallel task: below this a second thread costs more than it saves.
const ELEMS_PER_TASK: usize = 1 << 15;

/// Rows per task for rows of `row_len` elements.
fn rows_per_task(row_len: usize) -> usize {
    (ELEMS_PER_TASK / row_len.max(1)).max(1)
}

/// Runs `f(first_row, rows_out)` over `out` in row chunks, in parallel when it is large.
fn for_row_chunks<F>(out: &mut [f32], row_len: usize, f: F)
where
    F: Fn(usize, &mut [f32]) + Sync,
{
    let per_task = rows_per_task(row_len);
    let chunk = per_task * row_len;
    if out.len() <= chunk {
        f(0, out);
    } else {
        out.par_chunks_mut(chunk)
            .enumerate()
            .for_each(|(i, rows)| f(i * per_task, rows));
    }
}

multiversion! {
    fn softmax_chunk(input: &[f32], out: &mut [f32], row_len: usize) {
        for (x, y) in input.chunks_exact(row_len).zip(out.chunks_exact_mut(row_len)) {
            let m = simd::max(x);
            let inv = 1.0 / simd::exp_shifted(x, m, Some(y));
            for v in y.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// Softmax of every row of `input` into `out`.
pub fn softmax(input: &[f32], out: &mut [f32], row_len: usize) {
    for_row_chunks(out, row_len, |row0, y| {
        softmax_chunk(&input[row0 * row_len..][..y.len()], y, row_len)
    });
}

/// Where each score row finds its mask row: scores are `[batch, rows_per_batch, k_len]` with
/// `rows_per_batch = heads * q_len` (query position fastest); the mask is
/// `[mask_batch, q_len, k_len]`, with `mask_batch` 1 (shared) or the batch size.
#[derive(Debug, Clone, Copy)]
pub struct MaskLayout {
    pub q_len: usize,
    pub rows_per_batch: usize,
    pub mask_batch: usize,
}

impl MaskLayout {
    fn mask_row(self, score_row: usize) -> usize {
        let batch = score_row / self.rows_per_batch;
        (batch % self.mask_batch) * self.q_len + score_row % self.q_len
    }
}

multiversion! {
    fn masked_softmax_chunk(
        input: &[f32],
        mask: &[f32],
        out: &mut [f32],
        row0: usize,
        row_len: usize,
        layout: MaskLayout,
    ) {
        for (i, (x, y)) in input.chunks_exact(row_len).zip(out.chunks_exact_mut(row_len)).enumerate() {
            let m = &mask[layout.mask_row(row0 + i) * row_len..][..row_len];
            for ((t, &a), &b) in y.iter_mut().zip(x).zip(m) {
                *t = a + b;
            }
            let max = simd::max(y);
            let inv = 1.0 / simd::exp_shifted_in_place(y, max);
            for v in y.iter_mut() {
                *v *= inv;
            }
        }
    }
}

/// `softmax(scores + mask)` per row, reading each row's mask row through `layout` (the mask
/// is never broadcast to the scores' shape).
pub fn masked_softmax(
    input: &[f32],
    mask: &[f32],
    out: &mut [f32],
    row_len: usize,
    layout: MaskLayout,
) {
    for_row_chunks(out, row_len, |row0, y| {
        masked_softmax_chunk(
            &input[row0 * row_len..][..y.len()],
            mask,
            y,
            row0,
            row_len,
            layout,
        )
    });
}

multiversion! {
    fn softmax_backward_chunk(y: &[f32], grad: &[f32], out: &mut [f32], row_len: usize) {
        for ((y, g), dx) in y
            .chunks_exact(row_len)
            .zip(grad.chunks_exact(row_len))
            .zip(out.chunks_exact_mut(row_len))
        {
            let dot = simd::dot(y, g);
            for ((d, &yv), &gv) in dx.iter_mut().zip(y).zip(g) {
                *d = yv * (gv - dot);
            }
        }
    }
}

/// Gradient of softmax: `dx = y * (g - sum(g * y))` per row, from the forward output `y`.
pub fn softmax_backward(y: &[f32], grad: &[f32], out: &mut [f32], row_len: usize) {
    for_row_chunks(out, row_len, |row0, dx| {
        let range = row0 * row_len..row0 * row_len + dx.len();
        softmax_backward_chunk(&y[range.clone()], &grad[range], dx, row_len)
    });
}

multiversion! {
    fn log_sum_exp_chunk(logits: &[f32], lse: &mut [f32], row_len: usize) {
        for (x, l) in logits.chunks_exact(row_len).zip(lse.iter_mut()) {
            let m = simd::max(x);
            *l = m + simd::exp_shifted(x, m, None).ln();
        }
    }
}

/// `log(sum(exp(row)))` of every row into `lse` (one value per row).
pub fn log_sum_exp(logits: &[f32], lse: &mut [f32], row_len: usize) {
    // Parallel over rows of the output; each output element reads a whole row.
    let per_task = rows_per_task(row_len);
    if lse.len() <= per_task {
        return log_sum_exp_chunk(logits, lse, row_len);
    }
    lse.par_chunks_mut(per_task).enumerate().for_each(|(i, l)| {
        let row0 = i * per_task;
        log_sum_exp_chunk(&logits[row0 * row_len..][..l.len() * row_len], l, row_len)
    });
}

multiversion! {
    fn target_log_probs_backward_chunk(
        logits: &[f32],
        lse: &[f32],
        targets: &[usize],
        grad: &[f32],
        out: &mut [f32],
        row_len: usize,
    ) {
        for (r, dx) in out.chunks_exact_mut(row_len).enumerate() {
            let g = grad[r];
            if g == 0.0 {
                // Ignored positions (label -100) arrive with a zero gradient.
                dx.fill(0.0);
                continue;
            }
            let x = &logits[r * row_len..][..row_len];
            let shift = lse[r];
            for (d, &v) in dx.iter_mut().zip(x) {
                *d = -g * simd::exp(v - shift);
            }
            dx[targets[r]] += g;
        }
    }
}

/// Gradient of `log_softmax(logits)[target]` per row with upstream `grad` (one per row):
/// `g * (onehot(target) - softmax(row))`.
pub fn target_log_probs_backward(
    logits: &[f32],
    lse: &[f32],
    targets: &[usize],
    grad: &[f32],
    out: &mut [f32],
    row_len: usize,
) {
    for_row_chunks(out, row_len, |row0, dx| {
        let rows = dx.len() / row_len;
        let span = row0..row0 + rows;
        target_log_probs_backward_chunk(
            &logits[row0 * row_len..][..dx.len()],
            &lse[span.clone()],
            &targets[span.clone()],
            &grad[span],
            dx,
            row_len,
        )
    });
}

multiversion! {
    fn silu_chunk(x: &[f32], out: &mut [f32]) {
        for (y, &v) in out.iter_mut().zip(x) {
            *y = v * simd::sigmoid(v);
        }
    }
}

/// `x * sigmoid(x)` elementwise.
pub fn silu(x: &[f32], out: &mut [f32]) {
    for_row_chunks(out, 1, |i, y| silu_chunk(&x[i..][..y.len()], y));
}

multiversion! {
    fn silu_backward_chunk(x: &[f32], grad: &[f32], out: &mut [f32]) {
        for ((d, &v), &g) in out.iter_mut().zip(x).zip(grad) {
            let s = simd::sigmoid(v);
            *d = g * s * (1.0 + v * (1.0 - s));
        }
    }
}

/// Gradient of SiLU from its input: `g * s * (1 + x (1 - s))` with `s = sigmoid(x)`.
pub fn silu_backward(x: &[f32], grad: &[f32], out: &mut [f32]) {
    for_row_chunks(out, 1, |i, d| {
        silu_backward_chunk(&x[i..][..d.len()], &grad[i..][..d.len()], d)
    });
}

multiversion! {
    fn swiglu_chunk(gate: &[f32], up: &[f32], out: &mut [f32]) {
        for ((y, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *y = g * simd::sigmoid(g) * u;
        }
    }
}

/// `silu(gate) * up` elementwise (the SwiGLU MLP's hidden activation), rounded as the two
/// separate ops round it: `(g * sigmoid(g)) * u`.
pub fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    for_row_chunks(out, 1, |i, y| {
        swiglu_chunk(&gate[i..][..y.len()], &up[i..][..y.len()], y)
    });
}

multiversion! {
    fn swiglu_backward_chunk(
        gate: &[f32],
        up: &[f32],
        grad: &[f32],
        d_gate: &mut [f32],
        d_up: &mut [f32],
    ) {
        for ((((dg, du), &g), &u), &dy) in d_gate
            .iter_mut()
            .zip(d_up.iter_mut())
            .zip(gate)
            .zip(up)
            .zip(grad)
        {
            let s = simd::sigmoid(g);
            *du = dy * (g * s);
            *dg = (dy * u) * s * (1.0 + g * (1.0 - s));
        }
    }
}

/// Both gradients of [`swiglu`] from its inputs, with the composed ops' expressions (the
/// product's gradients, then SiLU's): `d_up = dy * silu(g)`,
/// `d_gate = (dy * u) * s * (1 + g (1 - s))` with `s = sigmoid(g)`.
pub fn swiglu_backward(
    gate: &[f32],
    up: &[f32],
    grad: &[f32],
    d_gate: &mut [f32],
    d_up: &mut [f32],
) {
    let per_task = rows_per_task(1);
    if d_gate.len() <= per_task {
        swiglu_backward_chunk(gate, up, grad, d_gate, d_up);
        return;
    }
    d_gate
        .par_chunks_mut(per_task)
        .zip(d_up.par_chunks_mut(per_task))
        .enumerate()
        .for_each(|(c, (dg, du))| {
            let i = c * per_task;
            let n = dg.len();
            swiglu_backward_chunk(&gate[i..][..n], &up[i..][..n], &grad[i..][..n], dg, du)
        });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows long and many enough to take the parallel path and the lane tails.
    fn sample(rows: usize, row_len: usize) -> Vec<f32> {
        (0..rows * row_len)
            .map(|i| ((i * 7919) % 1000) as f32 / 50.0 - 10.0)
            .collect()
    }

    fn softmax_f64(row: &[f32]) -> Vec<f64> {
        let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        e.into_iter().map(|v| v / s).collect()
    }

    #[test]
    fn softmax_and_its_backward_match_f64_references() {
        let (rows, len) = (300, 131);
        let x = sample(rows, len);
        let g = sample(rows, len)
            .iter()
            .map(|v| v.cos())
            .collect::<Vec<_>>();
        let mut y = vec![0.0; x.len()];
        softmax(&x, &mut y, len);
        let mut dx = vec![0.0; x.len()];
        softmax_backward(&y, &g, &mut dx, len);
        for r in 0..rows {
            let want = softmax_f64(&x[r * len..][..len]);
            let gr = &g[r * len..][..len];
            let dot: f64 = want.iter().zip(gr).map(|(a, &b)| a * b as f64).sum();
            for j in 0..len {
                assert!((y[r * len + j] as f64 - want[j]).abs() < 1e-6);
                let want_dx = want[j] * (gr[j] as f64 - dot);
                assert!((dx[r * len + j] as f64 - want_dx).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn masked_softmax_reads_the_mask_row_of_each_batch_and_query() {
        // 2 batches x 3 heads x 4 queries, 5 keys; a per-batch mask.
        let (q_len, k_len, heads, batch) = (4, 5, 3, 2);
        let layout = MaskLayout {
            q_len,
            rows_per_batch: heads * q_len,
            mask_batch: batch,
        };
        let x = sample(batch * heads * q_len, k_len);
        let mask: Vec<f32> = (0..batch * q_len * k_len)
            .map(|i| {
                if (i * 31) % 7 < 3 {
                    -1.0e30
                } else {
                    (i % 5) as f32 * 0.1
                }
            })
            .collect();
        let mut got = vec![0.0; x.len()];
        masked_softmax(&x, &mask, &mut got, k_len, layout);
        for b in 0..batch {
            for h in 0..heads {
                for qi in 0..q_len {
                    let r = (b * heads + h) * q_len + qi;
                    let m = &mask[(b * q_len + qi) * k_len..][..k_len];
                    let row: Vec<f32> = x[r * k_len..][..k_len]
                        .iter()
                        .zip(m)
                        .map(|(a, b)| a + b)
                        .collect();
                    let want = softmax_f64(&row);
                    for j in 0..k_len {
                        assert!(
                            (got[r * k_len + j] as f64 - want[j]).abs() < 1e-6,
                            "row {r} col {j}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn masked_scores_get_exactly_zero_probability() {
        let x = [0.5, -1.0e30, 1.5, -1.0e30];
        let mut y = [0.0; 4];
        softmax(&x, &mut y, 4);
        assert_eq!((y[1], y[3]), (0.0, 0.0));
        assert!((y[0] + y[2] - 1.0).abs() < 1e-7);
    }

    #[test]
    fn log_sum_exp_and_target_gradient_match_f64_references() {
        let (rows, len) = (70, 1031);
        let x = sample(rows, len);
        let targets: Vec<usize> = (0..rows).map(|r| (r * 37) % len).collect();
        let grad: Vec<f32> = (0..rows)
            .map(|r| if r % 5 == 0 { 0.0 } else { 0.5 + r as f32 })
            .collect();
        let mut lse = vec![0.0; rows];
        log_sum_exp(&x, &mut lse, len);
        let mut dx = vec![1.0; x.len()];
        target_log_probs_backward(&x, &lse, &targets, &grad, &mut dx, len);
        for r in 0..rows {
            let row = &x[r * len..][..len];
            let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
            let want = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
            assert!((lse[r] as f64 - want).abs() < 1e-5, "row {r}");
            let p = softmax_f64(row);
            for j in 0..len {
                let onehot = if j == targets[r] { 1.0 } else { 0.0 };
                let want = grad[r] as f64 * (onehot - p[j]);
                assert!(
                    (dx[r * len + j] as f64 - want).abs() < 1e-5,
                    "row {r} col {j}"
                );
            }
        }
    }

    #[test]
    fn swiglu_is_silu_then_the_product_bit_for_bit() {
        let gate = sample(2, 70_001);
        let up: Vec<f32> = gate.iter().map(|v| (v * 1.7).cos()).collect();
        let dy: Vec<f32> = gate.iter().map(|v| v.sin()).collect();
        let mut fused = vec![0.0; gate.len()];
        swiglu(&gate, &up, &mut fused);
        let (mut d_gate, mut d_up) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
        swiglu_backward(&gate, &up, &dy, &mut d_gate, &mut d_up);

        let mut silu_out = vec![0.0; gate.len()];
        silu(&gate, &mut silu_out);
        let d_silu: Vec<f32> = dy.iter().zip(&up).map(|(d, u)| d * u).collect();
        let mut want_d_gate = vec![0.0; gate.len()];
        silu_backward(&gate, &d_silu, &mut want_d_gate);
        for i in 0..gate.len() {
            assert_eq!(
                fused[i].to_bits(),
                (silu_out[i] * up[i]).to_bits(),
                "value {i}"
            );
            assert_eq!(
                d_up[i].to_bits(),
                (dy[i] * silu_out[i]).to_bits(),
                "d_up {i}"
            );
            assert_eq!(d_gate[i].to_bits(), want_d_gate[i].to_bits(), "d_gate {i}");
        }
    }

    #[test]
    fn silu_and_its_backward_match_f64_references() {
        let x = sample(1, 100_003);
        let g: Vec<f32> = x.iter().map(|v| v.sin()).collect();
        let mut y = vec![0.0; x.len()];
        silu(&x, &mut y);
        let mut dx = vec![0.0; x.len()];
        silu_backward(&x, &g, &mut dx);
        for i in 0..x.len() {
            let v = x[i] as f64;
            let s = 1.0 / (1.0 + (-v).exp());
            assert!((y[i] as f64 - v * s).abs() < 1e-5);
            let want = g[i] as f64 * s * (1.0 + v * (1.0 - s));
            assert!((dx[i] as f64 - want).abs() < 1e-5);
        }
    }
}
