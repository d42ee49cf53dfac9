use crate::hub::model_card::{LoraInfo, ModelCardInfo, render};

#[test]
fn adapter_card_has_front_matter_summary_and_loading_snippet() {
    let card = render(ModelCardInfo {
        repo_id: "me/llama-lora".into(),
        base_model: Some("meta-llama/Llama-3.2-1B".into()),
        adapter: true,
        recipe: Some("lora_finetune_single_device".into()),
        datasets: vec!["tatsu-lab/alpaca".into()],
        license: Some("llama3.2".into()),
        lora: Some(LoraInfo {
            r: Some(8),
            alpha: Some(16.0),
            dropout: Some(0.05),
            target_modules: vec!["q_proj".into(), "v_proj".into()],
        }),
        steps: Some(1000),
        epochs: Some(1),
        final_loss: Some(1.23456),
        metrics: vec![("Tokens/s".into(), "5120".into())],
        command: Some("tune run lora_finetune_single_device --config llama3_2/1B_lora".into()),
        tags: vec!["lora".into(), "alpaca".into()],
        quantized: false,
    });
    let expected_front = "---\nbase_model: meta-llama/Llama-3.2-1B\nlibrary_name: peft\nlicense: llama3.2\ndatasets:\n- tatsu-lab/alpaca\ntags:\n- tune\n- lora\n- peft\n- lora_finetune_single_device\n- alpaca\npipeline_tag: text-generation\n---\n";
    assert!(card.starts_with(expected_front), "{card}");
    for needle in [
        "# llama-lora",
        "| Recipe | `lora_finetune_single_device` |",
        "| LoRA rank (r) | 8 |",
        "| LoRA alpha | 16 |",
        "| LoRA target modules | q_proj, v_proj |",
        "| Steps | 1000 |",
        "| Final loss | 1.2346 |",
        "| Tokens/s | 5120 |",
        "tune run lora_finetune_single_device --config llama3_2/1B_lora",
        "model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(\"meta-llama/Llama-3.2-1B\"), \"me/llama-lora\")",
    ] {
        assert!(card.contains(needle), "missing {needle:?} in\n{card}");
    }
}

#[test]
fn full_checkpoint_card_uses_transformers_and_quotes_odd_values() {
    let card = render(ModelCardInfo {
        repo_id: "me/full".into(),
        license: Some("other: see LICENSE".into()),
        ..ModelCardInfo::default()
    });
    assert!(card.contains("library_name: transformers\n"));
    assert!(card.contains("license: \"other: see LICENSE\"\n"));
    assert!(card.contains("tags:\n- tune\n"));
    assert!(!card.contains("base_model"));
    assert!(card.contains("AutoModelForCausalLM.from_pretrained(\"me/full\")"));
}

/// A QAT checkpoint's card says what `quantized/` holds and how to load it, since
/// transformers cannot; other cards say nothing of it.
#[test]
fn a_quantized_export_gets_loader_notes() {
    let quantized = render(ModelCardInfo {
        repo_id: "me/qat".into(),
        quantized: true,
        ..ModelCardInfo::default()
    });
    assert!(
        quantized.contains("## The int4 export in `quantized/`")
            && quantized.contains("tune_int4_groupwise")
            && quantized.contains("tune download me/qat --output-dir model"),
        "{quantized}"
    );
    let plain = render(ModelCardInfo {
        repo_id: "me/full".into(),
        ..ModelCardInfo::default()
    });
    assert!(!plain.contains("quantized/"));
}
