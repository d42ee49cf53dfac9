//! FSDP's CPU offload (`fsdp_cpu_offload: True`, torchtune's FSDP2 `CPUOffloadPolicy`): this
//! rank's rows of every sharded weight, and their gradients, kept in host memory. A unit's
//! rows go up to the device only to be all-gathered ([`super::shards::LayerShards::gather`]);
//! its gradient rows come down as soon as its reduce-scatter ends; the optimizer updates them
//! on the host (the trainer's `offload` module).
//!
//! Invariants:
//! - A parked parameter keeps its place, id, dtype and whether it trains in the module, with
//!   no rows (shape `[0, ...]`): nothing of it is on the device between gathers. Its rows live
//!   here, flat, in the model's dtype, on [`Host`] (burn's CPU backend, whose fused AdamW the
//!   optimizer step runs).
//! - A parked parameter's gradient never joins the trainer's `GradientsParams`: the rows of it
//!   each backward pass reduce-scatters are summed here, and the optimizer step takes them.
//!
//! Nothing here is a collective: every rank parks and moves only its own rows.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard};

use burn::module::ParamId;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorCreationOptions};

/// Host memory's backend.
pub type Host = burn::backend::Flex;

/// `t` copied to host memory, in its dtype.
pub fn to_host<X: Backend, const D: usize>(t: Tensor<X, D>) -> Tensor<Host, D> {
    let dtype = t.dtype();
    Tensor::from_data(
        t.into_data(),
        TensorCreationOptions::new(Default::default()).with_dtype(dtype),
    )
}

/// `t` copied from host memory to `device`, in its dtype.
pub fn to_device<X: Backend, const D: usize>(
    t: Tensor<Host, D>,
    device: &X::Device,
) -> Tensor<X, D> {
    let dtype = t.dtype();
    Tensor::from_data(
        t.into_data(),
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// The parked rows and gradient rows of one rank.
#[derive(Default)]
pub struct HostRows {
    values: Mutex<HashMap<ParamId, Tensor<Host, 1>>>,
    grads: Mutex<HashMap<ParamId, Tensor<Host, 1>>>,
}

/// The map, whatever a panicked holder left in it: every entry is a whole tensor (an insert
/// or a removal is one call), so there is nothing half-written to fear.
fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl HostRows {
    /// Keeps `rows` (flat) as parameter `id`'s value.
    pub fn park(&self, id: ParamId, rows: Tensor<Host, 1>) {
        locked(&self.values).insert(id, rows);
    }

    pub fn is_parked(&self, id: &ParamId) -> bool {
        locked(&self.values).contains_key(id)
    }

    /// Parameter `id`'s rows (flat), shared with the store.
    pub fn value(&self, id: &ParamId) -> Option<Tensor<Host, 1>> {
        locked(&self.values).get(id).cloned()
    }

    /// Takes parameter `id`'s rows out, so an update owns them alone and writes in place;
    /// [`Self::park`] puts the result back.
    pub fn take_value(&self, id: &ParamId) -> Option<Tensor<Host, 1>> {
        locked(&self.values).remove(id)
    }

    /// Adds `rows` to parameter `id`'s gradient of this step.
    pub fn add_grad(&self, id: ParamId, rows: Tensor<Host, 1>) {
        let mut grads = locked(&self.grads);
        let sum = match grads.remove(&id) {
            Some(prev) => prev + rows,
            None => rows,
        };
        grads.insert(id, sum);
    }

    /// Parameter `id`'s gradient rows of this step so far.
    pub fn grad(&self, id: &ParamId) -> Option<Tensor<Host, 1>> {
        locked(&self.grads).get(id).cloned()
    }

    /// The step's gradients, taken (the next step starts from none).
    pub fn take_grads(&self) -> HashMap<ParamId, Tensor<Host, 1>> {
        std::mem::take(&mut *locked(&self.grads))
    }

    /// Bytes of the parked rows.
    pub fn bytes(&self) -> usize {
        bytes_of(&locked(&self.values))
    }

    /// Bytes of the gradient rows of the step so far.
    pub fn grad_bytes(&self) -> usize {
        bytes_of(&locked(&self.grads))
    }
}

fn bytes_of(tensors: &HashMap<ParamId, Tensor<Host, 1>>) -> usize {
    tensors
        .values()
        .map(|t| t.shape().num_elements() * t.dtype().size())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{DType, TensorData};

    #[test]
    fn rows_keep_their_dtype_on_the_way_to_the_host_and_back() {
        let device = Default::default();
        let t = Tensor::<Host, 1>::from_data(TensorData::new(vec![1.5f32, -2.25], [2]), &device);
        let half = crate::precision::to_dtype(t, DType::BF16);
        let up = to_device::<Host, 1>(to_host(half.clone()), &device);
        assert_eq!(up.dtype(), DType::BF16);
        assert_eq!(
            up.into_data().convert::<f32>().to_vec::<f32>().unwrap(),
            [1.5, -2.25]
        );
    }

    #[test]
    fn gradients_of_a_step_sum_until_taken() {
        let rows = HostRows::default();
        let id = ParamId::new();
        let device = Default::default();
        let g = |v: f32| Tensor::<Host, 1>::from_data(TensorData::new(vec![v, v], [2]), &device);
        rows.add_grad(id, g(1.0));
        rows.add_grad(id, g(2.0));
        let taken = rows.take_grads();
        assert_eq!(
            taken[&id].clone().into_data().to_vec::<f32>().unwrap(),
            [3.0, 3.0]
        );
        assert!(
            rows.take_grads().is_empty(),
            "the next step starts from none"
        );
    }
}
