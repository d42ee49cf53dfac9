//! Key/value cache for generation: each layer keeps the keys and values of every position
//! seen so far, so each new token costs one position of attention, not the whole prefix.
//!
//! The cache is a buffer with room to spare, written in place: a decoding step writes its one
//! position and hands attention a view of the filled prefix, instead of concatenating (copying)
//! the whole cache per token. It grows by doubling, so a generation copies it O(log n) times.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Positions the first buffer holds (it doubles as needed).
const INITIAL_CAPACITY: usize = 256;

#[derive(Debug, Default)]
pub struct LayerCache<B: Backend> {
    /// `[batch, kv_heads, capacity, head_dim]`; positions `len..` are unused.
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
    len: usize,
}

impl<B: Backend> LayerCache<B> {
    /// Appends `[batch, kv_heads, new, head_dim]` and returns views of the whole cache.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let [batch, heads, new, dim] = k.dims();
        let end = self.len + new;
        let keys = write(self.keys.take(), self.len, k);
        let values = write(self.values.take(), self.len, v);
        self.len = end;
        let prefix = |t: &Tensor<B, 4>| t.clone().slice([0..batch, 0..heads, 0..end, 0..dim]);
        let out = (prefix(&keys), prefix(&values));
        self.keys = Some(keys);
        self.values = Some(values);
        out
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Each row repeated `times` times along the batch (row r becomes rows r*times..).
    fn repeat_rows(&mut self, times: usize, room: usize) {
        let len = self.len;
        let repeat = |t: Tensor<B, 4>| {
            let [batch, heads, _, dim] = t.dims();
            let filled = t
                .slice([0..batch, 0..heads, 0..len, 0..dim])
                .unsqueeze_dim::<5>(1)
                .repeat_dim(1, times)
                .reshape([batch * times, heads, len, dim]);
            crate::kernels::write_positions(zeroed_like(&filled, len + room), 0, filled)
        };
        self.keys = self.keys.take().map(repeat);
        self.values = self.values.take().map(repeat);
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

/// `buffer` with `new` written at positions `len..len + new` (in place: the buffer is not
/// shared between steps), grown by doubling when it is too small.
fn write<B: Backend>(buffer: Option<Tensor<B, 4>>, len: usize, new: Tensor<B, 4>) -> Tensor<B, 4> {
    let [batch, heads, count, dim] = new.dims();
    let end = len + count;
    let capacity = buffer.as_ref().map_or(0, |b| b.dims()[2]);
    let buffer = match buffer {
        Some(b) if capacity >= end => b,
        old => {
            let grown = end.max(2 * capacity).max(INITIAL_CAPACITY);
            let fresh = zeroed_like(&new, grown);
            match old {
                Some(old) if len > 0 => {
                    let filled = old.slice([0..batch, 0..heads, 0..len, 0..dim]);
                    crate::kernels::write_positions(fresh, 0, filled)
                }
                _ => fresh,
            }
        }
    };
    crate::kernels::write_positions(buffer, len, new)
}

/// A zeroed buffer of `positions` positions with `like`'s rows, heads, width and dtype.
fn zeroed_like<B: Backend>(like: &Tensor<B, 4>, positions: usize) -> Tensor<B, 4> {
    let [batch, heads, _, dim] = like.dims();
    crate::precision::to_dtype(
        Tensor::<B, 4>::zeros([batch, heads, positions, dim], &like.device()),
        like.dtype(),
    )
}

#[derive(Debug)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerCache<B>>,
}

impl<B: Backend> KvCache<B> {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers).map(|_| LayerCache::default()).collect(),
        }
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    /// Every row's cache repeated `times` times along the batch (row r becomes rows
    /// `r * times..(r + 1) * times`), with room for `room` more positions: a prompt
    /// prefilled once, then continued as `times` completions. Only the filled positions are
    /// copied. Why: repeating the whole first buffer (256 positions) made GRPO's 16 rows fault
    /// in and zero 190 MB of fresh pages per rollout on SmolLM2-135M, 6% of the rollout.
    pub fn repeat_rows(&mut self, times: usize, room: usize) {
        for layer in &mut self.layers {
            layer.repeat_rows(times, room);
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    fn block(start: usize, len: usize) -> Tensor<Flex, 4> {
        let (b, h, d) = (2, 3, 4);
        let values: Vec<f32> = (0..b * h * len * d)
            .map(|i| (start * 1000 + i) as f32)
            .collect();
        Tensor::from_data(TensorData::new(values, [b, h, len, d]), &Default::default())
    }

    fn buffer_address(cache: &LayerCache<Flex>) -> Option<usize> {
        let keys = cache.keys.as_ref()?.clone().into_primitive().tensor();
        Some(keys.bytes().as_ptr() as usize)
    }

    /// A decoding step writes its position into the buffer it has, never a copy of it
    /// (burn-flex's `slice_assign` copied every layer's whole cache per token).
    #[test]
    fn a_decoding_step_writes_its_position_in_place() {
        let mut cache = LayerCache::<Flex>::default();
        let _ = cache.append(block(0, 3), block(0, 3));
        let buffer = buffer_address(&cache);
        assert!(buffer.is_some());
        for pos in 3..40 {
            let (k, _) = cache.append(block(pos, 1), block(pos, 1));
            assert_eq!(k.dims()[2], pos + 1);
            assert_eq!(buffer_address(&cache), buffer, "position {pos}");
        }
    }

    /// bf16 caches (`dtype: bf16`) append as f32 ones do, across growth.
    #[test]
    fn bf16_appends_equal_concatenation() {
        let bf16 = |t: Tensor<Flex, 4>| t.cast(burn::tensor::DType::BF16);
        let mut cache = LayerCache::<Flex>::default();
        let mut expected = bf16(block(0, 5));
        let _ = cache.append(expected.clone(), expected.clone());
        for pos in 5..INITIAL_CAPACITY + 9 {
            let new = bf16(block(pos, 1));
            let (k, _) = cache.append(new.clone(), new.clone());
            expected = Tensor::cat(vec![expected, new], 2);
            assert_eq!(k.to_data(), expected.to_data(), "after {pos}");
        }
    }

    /// Appends across the first buffer's capacity (a prefill longer than it, then single
    /// positions past the next doubling) return what concatenation would.
    #[test]
    fn appends_equal_concatenation_across_growth() {
        let mut cache = LayerCache::<Flex>::default();
        let mut expected: Option<Tensor<Flex, 4>> = None;
        let mut pos = 0;
        for len in std::iter::once(INITIAL_CAPACITY + 3).chain(std::iter::repeat_n(1, 300)) {
            let new = block(pos, len);
            let (k, v) = cache.append(new.clone(), new.clone() * 2.0);
            let want = match expected.take() {
                Some(prev) => Tensor::cat(vec![prev, new], 2),
                None => new,
            };
            pos += len;
            assert_eq!(cache.len(), pos);
            assert_eq!(k.dims(), want.dims());
            assert_eq!(k.to_data(), want.to_data(), "keys after {pos}");
            assert_eq!(
                v.to_data(),
                (want.clone() * 2.0).to_data(),
                "values after {pos}"
            );
            expected = Some(want);
        }
    }

    /// Repeated rows hold each row's positions `times` times in a row, and the room asked
    /// for: the completions' positions are written in place, never a grown copy.
    #[test]
    fn repeated_rows_keep_their_positions_and_room_for_the_completions() {
        let mut cache = LayerCache::<Flex>::default();
        let prompt = block(0, 3);
        let _ = cache.append(prompt.clone(), prompt.clone() * 2.0);
        cache.repeat_rows(4, 5);
        let keys = cache.keys.as_ref().unwrap();
        assert_eq!(keys.dims(), [8, 3, 8, 4]);
        let buffer = buffer_address(&cache);
        let mut want = prompt
            .unsqueeze_dim::<5>(1)
            .repeat_dim(1, 4)
            .reshape([8, 3, 3, 4]);
        for pos in 3..8 {
            let new = block(pos, 1).repeat_dim(0, 4);
            let (k, v) = cache.append(new.clone(), new.clone() * 2.0);
            want = Tensor::cat(vec![want, new], 2);
            assert_eq!(k.to_data(), want.to_data(), "keys at {pos}");
            assert_eq!(
                v.to_data(),
                (want.clone() * 2.0).to_data(),
                "values at {pos}"
            );
            assert_eq!(buffer_address(&cache), buffer, "position {pos}");
        }
    }
}
