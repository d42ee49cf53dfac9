//! What a `model` section asks that the checkpoint or device cannot honour.

/// A `model` section this checkpoint or device cannot honour.
#[derive(Debug, thiserror::Error)]
pub enum ModelConfigError {
    /// The checkpointer's `model_type` is not the checkpoint's family.
    #[error(
        "{key}.model_type: is {named}, but checkpoint_dir holds a {found} model (config.json's model_type); point checkpoint_dir at the model the config is for, or set model_type to match (tune reads the architecture from config.json)"
    )]
    ModelType {
        key: &'static str,
        named: String,
        found: String,
    },
    /// A LoRA recipe given a full builder (validation refuses it first).
    #[error(
        "model._component_: `{builder}` is a full model builder, and this recipe trains LoRA adapters"
    )]
    NotLora { builder: String },
    #[error(
        "dtype: QLoRA's NF4 base weights are quantized in bf16 or fp32 (as torchtune's QLoRA configs run); set `dtype: bf16` or `dtype: fp32`"
    )]
    Nf4InFp16,
    #[error(
        "model.apply_lora_to_output: this model ties its output projection to the embeddings (tie_word_embeddings): set apply_lora_to_output: False"
    )]
    TiedOutput,
    #[error("model.lora_attn_modules: none of {targets:?} is a linear layer of this model")]
    NoTargets { targets: Vec<String> },
    #[error(
        "model.use_dora: DoRA on a mixture-of-experts model's experts (apply_lora_to_mlp: True) is not supported: peft cannot load DoRA magnitudes onto transformers' fused experts; set apply_lora_to_mlp: False or use_dora: False"
    )]
    DoraOnExperts,
    #[error(
        "model.train_router: a \"{model_type}\" model is dense, it has no router to train; remove `train_router` (it is for mixture-of-experts models: Qwen3-MoE, Qwen2-MoE, Mixtral, gpt-oss)"
    )]
    RouterOfDenseModel { model_type: &'static str },
    /// `checkpointer.adapter_checkpoint` continues an adapter: whether it trained the routers
    /// (its `modules_to_save`) is part of it.
    #[error(
        "model.train_router: the adapter in checkpointer.adapter_checkpoint {}, so set `train_router: {}` to continue it",
        if *adapter { "trained the routers (modules_to_save)" } else { "left the routers frozen" },
        if *adapter { "True" } else { "False" }
    )]
    RouterTrainingDiffers { adapter: bool },
    /// gpt-oss's experts are fused 3-D parameters, which peft adapts through
    /// `target_parameters` (its `ParamWrapper`), and that refuses dropout: its input cannot be
    /// factored out of the fused product.
    #[error(
        "model.lora_dropout: LoRA on a \"{model_type}\" model's fused experts (apply_lora_to_mlp: True) takes no dropout, as peft's target_parameters adapters do not; set lora_dropout: 0.0, or apply_lora_to_mlp: False"
    )]
    DropoutOnFusedExperts { model_type: &'static str },
    /// QAT's int4 export of a multimodal checkpoint's language model: the export holds one text
    /// decoder, and the vision tower has no int4 form.
    #[error(
        "quantizer: the int4 export of a \"{wrapper}\" checkpoint (its language model, with the vision tower beside it) is not supported; fine-tune it with QAT and no export by using the qat_* recipes on a text-only checkpoint, or train the multimodal checkpoint with full or LoRA fine-tuning"
    )]
    QuantizedExportOfTower { wrapper: &'static str },
    /// QAT's int4 export quantizes linear weights by name; gpt-oss's experts are saved fused
    /// 3-D tensors, which it would write in float, unlike the fake-quantized experts that trained.
    #[error(
        "quantizer: the int4 export of a \"{model_type}\" model is not supported: its experts are saved as fused 3-D tensors, which the export would leave in float while QAT trained them fake-quantized; fine-tune it with the full or LoRA recipes, or use QAT without an export on a model whose experts are stored per expert"
    )]
    QuantizedExportOfFusedExperts { model_type: &'static str },
    /// A generic builder's architecture argument that is not the checkpoint's.
    #[error(
        "{section}.{key}: is {ours}, but the checkpoint's config.json has {hf} = {theirs}; tune builds the model from config.json, so remove `{section}.{key}` or point the checkpointer at the model this config describes"
    )]
    Architecture {
        section: String,
        key: &'static str,
        ours: String,
        theirs: String,
        hf: &'static str,
    },
    /// A classifier builder (a reward or value model) on a checkpoint with a language-model
    /// head, or the other way round.
    #[error(
        "{section}._component_: `{builder}` {wants}, but the checkpoint holds a {holds} ({architecture}); {fix}"
    )]
    Head {
        section: String,
        builder: String,
        wants: &'static str,
        holds: &'static str,
        architecture: String,
        fix: &'static str,
    },
}
