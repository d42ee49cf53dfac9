//! Gradients by parameter name, read out of burn's autodiff gradients: what the golden
//! gradient checks compare.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

use tune::checkpoint::HostTensor;
use tune::models::CausalLm;

struct GradCollector<'a, B: AutodiffBackend> {
    grads: &'a B::Gradients,
    path: Vec<String>,
    out: Vec<(String, HostTensor)>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for GradCollector<'_, B> {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(grad) = param.val().grad(self.grads) {
            self.out
                .push((self.path.join("."), HostTensor::from_tensor(&grad)));
        }
    }
}

/// The gradient of every parameter that has one, by module path.
pub fn named_grads<B: AutodiffBackend>(
    model: &CausalLm<B>,
    grads: &B::Gradients,
) -> Vec<(String, HostTensor)> {
    let mut v = GradCollector {
        grads,
        path: Vec::new(),
        out: Vec::new(),
    };
    model.visit(&mut v);
    v.out
}
