use std::path::PathBuf;

/// Everything that can go wrong reading or writing checkpoints. Each variant names the file
/// and, where there is one, the tensor, so the message alone tells the user what to fix.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(
        "no checkpoint in {dir}: expected model.safetensors or model.safetensors.index.json{hint}"
    )]
    NoWeights { dir: PathBuf, hint: String },
    #[error(
        "{path}: not a valid safetensors file ({message}); the file may be truncated or corrupt: download it again"
    )]
    BadSafetensors { path: PathBuf, message: String },
    #[error(
        "{name} {shape:?}: {source}. torchtune's QLoRA refuses this model too: use the `lora_` model builder (without `quantize_base`), which keeps the base in `dtype`"
    )]
    Nf4 {
        name: String,
        shape: Vec<usize>,
        source: crate::modules::nf4::Nf4Error,
    },
    #[error("{path}: invalid index ({message})")]
    BadIndex { path: PathBuf, message: String },
    #[error("{index} lists shard {shard}, which does not exist; download the missing shard")]
    MissingShard { index: PathBuf, shard: String },
    #[error("tensor {name} is missing from the checkpoint in {dir} (expected shape {expected:?})")]
    MissingTensor {
        name: String,
        dir: PathBuf,
        expected: Vec<usize>,
    },
    #[error(
        "tensor {name} in {file} has shape {found:?}, but the model's config.json needs {expected:?}"
    )]
    ShapeMismatch {
        name: String,
        file: PathBuf,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    /// A PEFT adapter tensor whose shape is not what its adapter_config.json and the base model
    /// give: the rank (`r`) is adapter_config.json's, the other side is the base model's.
    #[error(
        "tensor {name} in {} has shape {found:?}, but {} needs {expected:?}: {}",
        dir.join("adapter_model.safetensors").display(),
        dir.join("adapter_config.json").display(),
        adapter_shape_hint(*rank, expected, found)
    )]
    AdapterShape {
        name: String,
        /// The adapter directory.
        dir: PathBuf,
        rank: usize,
        expected: Vec<usize>,
        found: Vec<usize>,
    },
    #[error("tensor {name} in {file} has dtype {dtype}; tune reads F32, BF16 and F16")]
    UnsupportedDtype {
        name: String,
        file: PathBuf,
        dtype: String,
    },
    #[error(
        "the checkpoint in {dir} has tensors the model does not use: {names}; is config.json from the same model?"
    )]
    UnexpectedTensors { dir: PathBuf, names: String },
    #[error("{path}: {message}")]
    Invalid { path: PathBuf, message: String },
    /// The pieces of a tensor in a PyTorch DCP sharded checkpoint leave a gap, overlap, or
    /// disagree (dtype, rank of the shape, output file).
    #[error(
        "tensor {name} in {dir}: {message}; the shard files are not one complete save: copy every shard-*.safetensors file that save wrote, and only those"
    )]
    DcpPieces {
        name: String,
        dir: PathBuf,
        message: String,
    },
    /// A DCP sharded checkpoint whose shard files skip a rank.
    #[error(
        "{dir}: no shard file of rank {missing} (files of ranks up to {highest} exist; ranks are numbered from 1): copy that rank's shard-{missing:05}-*.safetensors files from the save"
    )]
    DcpMissingRank {
        dir: PathBuf,
        missing: usize,
        highest: usize,
    },
}

impl CheckpointError {
    pub fn io(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { path, source }
    }
}

/// Which side of an adapter tensor's shape is wrong: its rank (then adapter_config.json's `r`
/// does not match the weights saved with it) or the base model's dimension (then the adapter
/// was trained on another model).
fn adapter_shape_hint(rank: usize, expected: &[usize], found: &[usize]) -> String {
    let rank_found = found
        .iter()
        .zip(expected)
        .find_map(|(&f, &e)| (e == rank && f != e).then_some(f));
    let model_differs = found.len() != expected.len()
        || found
            .iter()
            .zip(expected)
            .any(|(&f, &e)| e != rank && f != e);
    match rank_found {
        Some(r) if !model_differs => format!(
            "the weights have rank {r} but its `r` is {rank}; use the adapter_config.json saved with these weights (or set \"r\": {r})"
        ),
        _ => "the adapter was trained on a different base model than checkpointer.checkpoint_dir holds".to_string(),
    }
}
