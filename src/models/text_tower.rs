//! The language model inside a multimodal checkpoint (`Gemma3ForConditionalGeneration`,
//! `Mistral3ForConditionalGeneration`, trained text-only; `Qwen2VLForConditionalGeneration`,
//! trained with its vision tower).
//!
//! Invariants:
//! - The decoder is built from `text_config` as a text checkpoint of its family would be; the
//!   tensors it reads are named here as a text checkpoint names them (`model.layers.0...`,
//!   `lm_head.weight`), a vision tower tune reads as `visual.*`, and [`TextTower::model_name`] /
//!   [`TextTower::checkpoint_name`] translate both ways for whichever key layout the checkpoint
//!   uses.
//! - Every other tensor (a vision tower tune does not read, a projector) is the checkpoint's,
//!   never the model's: a save copies it through from the source files byte for byte, in its
//!   stored dtype, so transformers loads the saved directory into the same multimodal class.

use serde_json::Value;

/// How a multimodal checkpoint names its language model's tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TowerLayout {
    /// `language_model.model.*` and `language_model.lm_head.weight`: the Hub's Gemma 3 and
    /// Mistral 3 files, and what transformers 5 writes.
    Nested,
    /// `model.language_model.*` and `lm_head.weight`: transformers' module paths, which some
    /// tools save (and transformers 5 writes for Qwen2-VL, its tower as `model.visual.*`).
    Prefixed,
    /// `model.*` and `lm_head.weight` as a text checkpoint, the tower beside them as `visual.*`:
    /// the Hub's Qwen2-VL and Qwen2.5-VL files.
    Flat,
}

impl TowerLayout {
    /// The layout a checkpoint's tensor names use: `Prefixed` when any tensor is named
    /// `model.language_model.*`, `Nested` when any is `language_model.*`, else `Flat`.
    pub fn detect<'a>(names: impl Iterator<Item = &'a String>) -> Self {
        let mut nested = false;
        for name in names {
            if name.starts_with(PREFIXED) {
                return Self::Prefixed;
            }
            nested |= name.starts_with("language_model.");
        }
        if nested { Self::Nested } else { Self::Flat }
    }
}

const NESTED: &str = "language_model.model.";
const NESTED_HEAD: &str = "language_model.lm_head.weight";
const PREFIXED: &str = "model.language_model.";
const HEAD: &str = "lm_head.weight";
/// The vision tower's tensors as the model names them (and the Hub's flat files do).
const VISUAL: &str = "visual.";
/// ... and as transformers' module paths (`Prefixed`) name them.
const PREFIXED_VISUAL: &str = "model.visual.";

/// A multimodal checkpoint's text tower: which wrapper it came from and its key layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TextTower {
    /// The checkpoint's `model_type` (`gemma3`, `mistral3`, `qwen2_vl`).
    pub wrapper: &'static str,
    pub layout: TowerLayout,
}

/// Wrappers whose vision tower tune reads, trains and saves as the model's own.
const READS_VISION: &[&str] = &["qwen2_vl"];

impl TextTower {
    /// The text model's name for checkpoint tensor `name`, or `None` when it is not the language
    /// model's (a vision tower's, a projector's).
    pub fn text_name(&self, name: &str) -> Option<String> {
        let (prefix, head) = match self.layout {
            TowerLayout::Nested => (NESTED, NESTED_HEAD),
            TowerLayout::Prefixed | TowerLayout::Flat => (PREFIXED, HEAD),
        };
        if name == head {
            return Some(HEAD.to_string());
        }
        if self.layout == TowerLayout::Flat {
            return (name.starts_with("model.") && !name.starts_with(PREFIXED_VISUAL))
                .then(|| name.to_string());
        }
        name.strip_prefix(prefix)
            .map(|rest| format!("model.{rest}"))
    }

    /// Whether tune reads this checkpoint's vision tower as part of the model (Qwen2-VL's);
    /// otherwise the tower is copied through untouched.
    pub fn reads_vision(&self) -> bool {
        READS_VISION.contains(&self.wrapper)
    }

    /// The model's name for checkpoint tensor `name`: the language model's as
    /// [`Self::text_name`], the vision tower's as `visual.*` when tune reads it; `None` for a
    /// tensor the model does not hold (copied through by saves).
    pub fn model_name(&self, name: &str) -> Option<String> {
        if let Some(text) = self.text_name(name) {
            return Some(text);
        }
        if !self.reads_vision() {
            return None;
        }
        let rest = match self.layout {
            TowerLayout::Prefixed => name.strip_prefix(PREFIXED_VISUAL),
            _ => name.strip_prefix(VISUAL),
        };
        rest.map(|rest| format!("{VISUAL}{rest}"))
    }

    /// The checkpoint's name for the model's tensor `name` (the inverse of [`Self::model_name`]).
    pub fn checkpoint_name(&self, name: &str) -> String {
        if let Some(rest) = name.strip_prefix(VISUAL) {
            return match self.layout {
                TowerLayout::Prefixed => format!("{PREFIXED_VISUAL}{rest}"),
                _ => name.to_string(),
            };
        }
        let rest = name.strip_prefix("model.");
        match (self.layout, rest) {
            (TowerLayout::Nested, _) if name == HEAD => NESTED_HEAD.to_string(),
            (TowerLayout::Nested, Some(rest)) => format!("{NESTED}{rest}"),
            (TowerLayout::Prefixed, Some(rest)) => format!("{PREFIXED}{rest}"),
            _ => name.to_string(),
        }
    }

    /// The module path peft gives the text model's module `path` (`model.layers.0.self_attn.q_proj`):
    /// peft names modules as transformers' multimodal class nests them, whatever the files' layout.
    pub fn module_path(&self, path: &str) -> String {
        if let Some(rest) = path.strip_prefix(VISUAL) {
            return format!("{PREFIXED_VISUAL}{rest}");
        }
        match path.strip_prefix("model.") {
            Some(rest) => format!("{PREFIXED}{rest}"),
            None => path.to_string(),
        }
    }
}

/// Multimodal wrappers whose language model tune trains, with the `model_type` their
/// `text_config` defaults to and the defaults transformers 5.24's text config class fills in for
/// keys the Hub's files leave out (Gemma 3 4B's `text_config` names only what differs).
pub fn text_config(raw: &Value) -> Option<Result<(TextTower, Value), String>> {
    let wrapper = match raw.get("model_type").and_then(Value::as_str)? {
        "gemma3" => "gemma3",
        "mistral3" => "mistral3",
        "qwen2_vl" => "qwen2_vl",
        _ => return None,
    };
    Some(text_config_of(wrapper, raw).map(|text| {
        let tower = TextTower {
            wrapper,
            layout: if wrapper == "qwen2_vl" {
                TowerLayout::Flat
            } else {
                TowerLayout::Nested
            },
        };
        (tower, text)
    }))
}

fn text_config_of(wrapper: &'static str, raw: &Value) -> Result<Value, String> {
    let mut given = match raw.get("text_config") {
        Some(Value::Object(given)) => given.clone(),
        // The Hub's Qwen2-VL files are flat: the language model's keys at the top, as
        // transformers' `Qwen2VLConfig` reads them when there is no `text_config`.
        None | Some(Value::Null) if wrapper == "qwen2_vl" => flat_text_config(raw),
        None | Some(Value::Null) => serde_json::Map::new(),
        Some(_) => return Err("\"text_config\" must be an object".into()),
    };
    let (model_type, defaults) = match wrapper {
        "gemma3" => ("gemma3_text", gemma3_text_defaults()),
        "qwen2_vl" => ("qwen2", qwen2_vl_text_defaults()),
        _ => ("mistral", mistral_defaults()),
    };
    // transformers names Qwen2-VL's language model `qwen2_vl_text`: Qwen 2's decoder.
    if wrapper == "qwen2_vl"
        && given.get("model_type").and_then(Value::as_str) == Some("qwen2_vl_text")
    {
        given.insert("model_type".into(), model_type.into());
    }
    let given_keys: std::collections::HashSet<String> = given.keys().cloned().collect();
    let mut text = defaults;
    if let Some(obj) = text.as_object_mut() {
        obj.insert("model_type".into(), model_type.into());
        for (key, value) in given {
            obj.insert(key, value);
        }
    }
    // transformers 5 ties the output projection as the wrapper's `tie_word_embeddings` says
    // (true unless stated), not its text_config; a checkpoint that stores its own `lm_head`
    // anyway is read untied (`model_io::hf` sees the tensor), as transformers then leaves it.
    // Qwen2-VL's wrapper defaults to untied and ties when either says so (pre-v5 saves wrote
    // the flag inside text_config).
    let flag = |v: &Value| v.get("tie_word_embeddings").and_then(Value::as_bool);
    let tie = match wrapper {
        "qwen2_vl" => {
            flag(raw).unwrap_or(false) || raw.get("text_config").and_then(flag).unwrap_or(false)
        }
        _ => flag(raw).unwrap_or(true),
    };
    if let Some(obj) = text.as_object_mut() {
        obj.insert("tie_word_embeddings".into(), tie.into());
        // Qwen2VLTextConfig's RoPE base (1e6), where neither layout states one.
        let stated = |key: &str| obj.get(key).and_then(|r| r.get("rope_theta")).is_some();
        if wrapper == "qwen2_vl"
            && !obj.contains_key("rope_theta")
            && !stated("rope_parameters")
            && !stated("rope_scaling")
        {
            obj.insert("rope_theta".into(), 1_000_000.0.into());
        }
    }
    // Special token ids the wrapper states (Gemma 3 4B's `eos_token_id: [1, 106]`) and its
    // text_config leaves out are the model's.
    for key in ["bos_token_id", "eos_token_id", "pad_token_id"] {
        if !given_keys.contains(key)
            && let (Some(value), Some(obj)) = (raw.get(key), text.as_object_mut())
        {
            obj.insert(key.into(), value.clone());
        }
    }
    let declared = text.get("model_type").and_then(Value::as_str);
    if declared != Some(model_type) {
        return Err(format!(
            "text_config.model_type {declared:?}: a \"{wrapper}\" checkpoint's language model is \"{model_type}\""
        ));
    }
    Ok(text)
}

/// `Gemma3TextConfig()`'s defaults in transformers 5.24 for the keys tune reads (its
/// `layer_types` derive from `sliding_window_pattern`, 6, and the layer count, as tune derives
/// them).
fn gemma3_text_defaults() -> Value {
    serde_json::json!({
        "vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "pad_token_id": 0,
        "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": true,
        "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
        "attention_bias": false, "query_pre_attn_scalar": 256, "sliding_window": 4096,
        "sliding_window_pattern": 6
    })
}

/// The top-level keys of a flat Qwen2-VL config.json that are its language model's (everything
/// but the wrapper's own).
fn flat_text_config(raw: &Value) -> serde_json::Map<String, Value> {
    const WRAPPER_KEYS: &[&str] = &[
        "model_type",
        "vision_config",
        "architectures",
        "image_token_id",
        "video_token_id",
        "vision_start_token_id",
        "vision_end_token_id",
        "vision_token_id",
        "transformers_version",
    ];
    raw.as_object()
        .map(|obj| {
            obj.iter()
                .filter(|(k, _)| !WRAPPER_KEYS.contains(&k.as_str()))
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// `Qwen2VLTextConfig()`'s defaults in transformers 5.25 for the keys tune reads.
fn qwen2_vl_text_defaults() -> Value {
    serde_json::json!({
        "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
        "use_sliding_window": false, "sliding_window": 4096,
        "bos_token_id": 151643, "eos_token_id": 151645
    })
}

/// `MistralConfig()`'s defaults in transformers 5.24 for the keys tune reads.
fn mistral_defaults() -> Value {
    serde_json::json!({
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2,
        "tie_word_embeddings": false, "rope_theta": 10_000.0, "sliding_window": 4096
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tower(layout: TowerLayout) -> TextTower {
        TextTower {
            wrapper: "gemma3",
            layout,
        }
    }

    #[test]
    fn names_translate_both_ways_in_each_layout() {
        for (layout, layer, head) in [
            (
                TowerLayout::Nested,
                "language_model.model.layers.0.self_attn.q_proj.weight",
                "language_model.lm_head.weight",
            ),
            (
                TowerLayout::Prefixed,
                "model.language_model.layers.0.self_attn.q_proj.weight",
                "lm_head.weight",
            ),
        ] {
            let t = tower(layout);
            let text = "model.layers.0.self_attn.q_proj.weight";
            assert_eq!(t.text_name(layer).as_deref(), Some(text));
            assert_eq!(t.checkpoint_name(text), layer);
            assert_eq!(t.text_name(head).as_deref(), Some("lm_head.weight"));
            assert_eq!(t.checkpoint_name("lm_head.weight"), head);
            assert_eq!(
                t.text_name("vision_tower.encoder.layers.0.mlp.fc1.weight"),
                None
            );
            assert_eq!(t.text_name("model.vision_tower.patch_conv.weight"), None);
            assert_eq!(t.text_name("multi_modal_projector.linear_1.weight"), None);
        }
    }

    #[test]
    fn the_layout_is_read_from_the_tensor_names() {
        let nested = ["language_model.model.norm.weight".to_string()];
        let prefixed = ["model.language_model.norm.weight".to_string()];
        let flat = [
            "model.norm.weight".to_string(),
            "visual.merger.ln_q.weight".to_string(),
        ];
        assert_eq!(TowerLayout::detect(nested.iter()), TowerLayout::Nested);
        assert_eq!(TowerLayout::detect(prefixed.iter()), TowerLayout::Prefixed);
        assert_eq!(TowerLayout::detect(flat.iter()), TowerLayout::Flat);
    }

    /// Qwen2-VL's tower is the model's (`visual.*`) in both of its layouts, and names go back
    /// as they came.
    #[test]
    fn qwen2_vl_reads_its_vision_tower_in_either_layout() {
        for (layout, layer, visual) in [
            (
                TowerLayout::Flat,
                "model.layers.0.mlp.up_proj.weight",
                "visual.blocks.0.attn.qkv.weight",
            ),
            (
                TowerLayout::Prefixed,
                "model.language_model.layers.0.mlp.up_proj.weight",
                "model.visual.blocks.0.attn.qkv.weight",
            ),
        ] {
            let t = TextTower {
                wrapper: "qwen2_vl",
                layout,
            };
            let text = "model.layers.0.mlp.up_proj.weight";
            assert_eq!(t.model_name(layer).as_deref(), Some(text));
            assert_eq!(t.checkpoint_name(text), layer);
            let own = "visual.blocks.0.attn.qkv.weight";
            assert_eq!(t.model_name(visual).as_deref(), Some(own));
            assert_eq!(t.checkpoint_name(own), visual);
            assert_eq!(
                t.model_name("lm_head.weight").as_deref(),
                Some("lm_head.weight")
            );
            assert_eq!(
                t.module_path("visual.blocks.0.attn.qkv"),
                "model.visual.blocks.0.attn.qkv"
            );
        }
        // Gemma 3's tower is copied through, not read.
        assert_eq!(
            tower(TowerLayout::Nested).model_name("vision_tower.x.weight"),
            None
        );
    }

    /// The Hub's flat Qwen2-VL config.json: the language model's keys at the top level,
    /// `rope_scaling` of type `mrope`, tied as the top level says; Qwen2VLTextConfig's RoPE
    /// base where none is stated.
    #[test]
    fn a_flat_qwen2_vl_config_is_its_language_model() {
        let raw = serde_json::json!({"model_type": "qwen2_vl", "hidden_size": 1536,
            "num_hidden_layers": 28, "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": true, "vision_config": {"depth": 32}, "image_token_id": 151655});
        let (tower, text) = text_config(&raw).unwrap().unwrap();
        assert_eq!(tower.wrapper, "qwen2_vl");
        assert_eq!(text["model_type"], "qwen2");
        assert_eq!(text["hidden_size"], 1536);
        assert_eq!(text["tie_word_embeddings"], true);
        assert_eq!(text["rope_theta"], 1_000_000.0);
        assert!(text.get("vision_config").is_none() && text.get("image_token_id").is_none());
        let nested = serde_json::json!({"model_type": "qwen2_vl",
            "text_config": {"model_type": "qwen2_vl_text", "rope_parameters": {"rope_theta": 10000.0}}});
        let text = text_config(&nested).unwrap().unwrap().1;
        assert_eq!(text["model_type"], "qwen2");
        assert_eq!(text["tie_word_embeddings"], false);
        assert!(text.get("rope_theta").is_none(), "the stated base stays");
    }

    #[test]
    fn a_sparse_text_config_takes_transformers_defaults() {
        let raw = serde_json::json!({"model_type": "gemma3",
            "text_config": {"hidden_size": 2560, "num_hidden_layers": 34}});
        let (tower, text) = text_config(&raw).unwrap().unwrap();
        assert_eq!(tower.wrapper, "gemma3");
        assert_eq!(text["model_type"], "gemma3_text");
        assert_eq!(text["hidden_size"], 2560);
        assert_eq!(text["head_dim"], 256);
        assert_eq!(text["hidden_activation"], "gelu_pytorch_tanh");
        let wrong =
            serde_json::json!({"model_type": "mistral3", "text_config": {"model_type": "llama"}});
        assert!(
            text_config(&wrong)
                .unwrap()
                .unwrap_err()
                .contains("\"mistral\"")
        );
        assert!(text_config(&serde_json::json!({"model_type": "llama"})).is_none());
    }

    /// transformers 5 ties as the wrapper says (true by default), whatever `text_config` says.
    #[test]
    fn the_wrappers_tie_flag_decides() {
        let tied = serde_json::json!({"model_type": "mistral3",
            "text_config": {"tie_word_embeddings": false}});
        assert_eq!(
            text_config(&tied).unwrap().unwrap().1["tie_word_embeddings"],
            true
        );
        let untied = serde_json::json!({"model_type": "mistral3", "tie_word_embeddings": false,
            "text_config": {"tie_word_embeddings": true}, "eos_token_id": [2, 7]});
        let text = text_config(&untied).unwrap().unwrap().1;
        assert_eq!(text["tie_word_embeddings"], false);
        assert_eq!(text["eos_token_id"], serde_json::json!([2, 7]));
    }
}
