//! Key/value cache for generation: each layer keeps the keys and values of every position
//! seen so far, so each new token costs one position of attention, not the whole prefix.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

#[derive(Debug, Default)]
pub struct LayerCache<B: Backend> {
    keys: Option<Tensor<B, 4>>,
    values: Option<Tensor<B, 4>>,
}

impl<B: Backend> LayerCache<B> {
    /// Appends `[batch, kv_heads, new, head_dim]` and returns the whole cache.
    pub fn append(&mut self, k: Tensor<B, 4>, v: Tensor<B, 4>) -> (Tensor<B, 4>, Tensor<B, 4>) {
        let k = match self.keys.take() {
            Some(prev) => Tensor::cat(vec![prev, k], 2),
            None => k,
        };
        let v = match self.values.take() {
            Some(prev) => Tensor::cat(vec![prev, v], 2),
            None => v,
        };
        self.keys = Some(k.clone());
        self.values = Some(v.clone());
        (k, v)
    }

    pub fn len(&self) -> usize {
        self.keys.as_ref().map_or(0, |k| k.dims()[2])
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[derive(Debug)]
pub struct KvCache<B: Backend> {
    pub layers: Vec<LayerCache<B>>,
}

impl<B: Backend> KvCache<B> {
    pub fn new(num_layers: usize) -> Self {
        Self {
            layers: (0..num_layers)
                .map(|_| LayerCache {
                    keys: None,
                    values: None,
                })
                .collect(),
        }
    }

    /// Positions already cached.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerCache::len)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}
