//! Model shapes benchmarks run on, as Hugging Face `config.json` objects (random weights, so
//! nothing is downloaded). They live in `benches/shapes.json` so the PyTorch reference
//! (`benches/pytorch_reference.py`) builds exactly the same models.

use serde_json::Value;

/// `tiny` is the shipped tiny llama's shape; `smollm2-135m` and `llama3.2-1b` are copies of
/// HuggingFaceTB/SmolLM2-135M's and meta-llama/Llama-3.2-1B's config.json.
/// `qwen3-30b-a3b-2l` is Qwen/Qwen3-30B-A3B's layer (128 experts, 8 per token, expert width
/// 768) in 2 layers with a 2048-token vocabulary, so that the layers, not the output
/// projection, take the step; `qwen3-30b-a3b-2l-32e` the same with 32 experts: as many active
/// parameters, a quarter of the experts' total. `qwen3-30b-a3b-narrow-48l` has Qwen3-30B-A3B's
/// depth and routing (48 layers of 128 experts, 8 per token) at hidden 256 and expert width 128:
/// the per-op cost of a deep graph of many small products (autodiff bookkeeping), not its
/// arithmetic. `gpt-oss-20b-2l` is openai/gpt-oss-20b's layer pair (a sliding-window and a full
/// layer, 32 experts of width 2880, 4 per token); `gpt-oss-small-2l` such a pair at hidden 512
/// (8 experts of width 512, 2 per token).
pub const SHAPES: &[&str] = &[
    "tiny",
    "smollm2-135m",
    "llama3.2-1b",
    "qwen3-30b-a3b-2l",
    "qwen3-30b-a3b-2l-32e",
    "qwen3-30b-a3b-narrow-48l",
    "gpt-oss-20b-2l",
    "gpt-oss-small-2l",
];

const SHAPES_JSON: &str = include_str!("../../benches/shapes.json");

pub fn config(shape: &str) -> Option<Value> {
    let all: Value = serde_json::from_str(SHAPES_JSON).ok()?;
    all.get(shape).cloned()
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_listed_shape_has_a_config() {
        for shape in super::SHAPES {
            let config = super::config(shape).expect(shape);
            crate::models::ModelArgs::from_json(config).expect(shape);
        }
    }
}
