//! Model shapes benchmarks run on, as Hugging Face `config.json` objects (random weights, so
//! nothing is downloaded). They live in `benches/shapes.json` so the PyTorch reference
//! (`benches/pytorch_reference.py`) builds exactly the same models.

use serde_json::Value;

/// `tiny` is the shipped tiny llama's shape; `smollm2-135m` and `llama3.2-1b` are copies of
/// HuggingFaceTB/SmolLM2-135M's and meta-llama/Llama-3.2-1B's config.json.
pub const SHAPES: &[&str] = &["tiny", "smollm2-135m", "llama3.2-1b"];

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
            assert_eq!(config["model_type"], "llama", "{shape}");
        }
    }
}
