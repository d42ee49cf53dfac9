//! Command-line arguments (clap), mirroring torchtune's `tune` commands.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tune",
    version,
    about = "Fine-tune open LLMs (Llama, Qwen, Mistral, Gemma, Phi, SmolLM): full, LoRA, DPO, QAT, distillation",
    long_about = None,
    after_help = "Examples:\n  tune ls\n  tune run lora_finetune_single_device --config tiny/lora_single_device\n  tune cp llama3_2/1B_lora_single_device my_config.yaml\n  tune run lora_finetune_single_device --config my_config.yaml batch_size=8 model.lora_rank=16"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// List recipes and their built-in configs.
    #[command(after_help = "Example:\n  tune ls")]
    Ls,
    /// Copy a built-in config to a local file to edit it.
    #[command(
        after_help = "Examples:\n  tune cp llama3_2/1B_lora_single_device my_config.yaml\n  tune cp tiny/lora_single_device configs/ --make-parents"
    )]
    Cp {
        /// Built-in config name, as listed by `tune ls`.
        config: String,
        /// Destination file, or a directory to copy into.
        destination: PathBuf,
        /// Do not overwrite an existing destination.
        #[arg(short = 'n', long)]
        no_clobber: bool,
        /// Create missing parent directories of the destination.
        #[arg(long)]
        make_parents: bool,
    },
    /// Print a built-in config.
    #[command(after_help = "Example:\n  tune cat llama3_2/1B_lora_single_device")]
    Cat { config: String },
    /// Check a config completely: every key known, types right, referenced files present.
    #[command(
        after_help = "Examples:\n  tune validate tiny/lora_single_device\n  tune validate my_config.yaml --recipe lora_finetune_single_device model.lora_rank=16"
    )]
    Validate {
        /// Built-in config name or YAML file.
        #[arg(required_unless_present = "explain")]
        config: Option<String>,
        /// key=value overrides, as for `tune run`.
        overrides: Vec<String>,
        /// The recipe to validate for (default: from the config's header or built-in entry).
        #[arg(long)]
        recipe: Option<String>,
        /// Print a key's declaration instead (dotted, as a config writes it: `model.lora_rank`):
        /// its type, default, range, aliases and doc, for each recipe that reads it (with
        /// --recipe, that recipe's). No config needed.
        #[arg(long, value_name = "KEY")]
        explain: Option<String>,
    },
    /// Run a recipe with a config and optional key=value overrides; with --nproc_per_node or
    /// --nnodes, a `*_distributed` recipe on several data-parallel workers.
    #[command(
        after_help = "Examples:\n  tune run lora_finetune_single_device --config tiny/lora_single_device\n  tune run full_finetune_single_device --config my.yaml epochs=2 optimizer.lr=2e-5 ~lr_scheduler\n  tune run generate --config tiny/generation prompt.user=\"Tell me a joke\" max_new_tokens=32\n  tune run --nproc_per_node 2 lora_finetune_distributed --config tiny/lora\n\nSeveral machines (one `tune run` each, the same config and tune version everywhere):\n  node 0: tune run --nnodes 2 --node_rank 0 --rdzv_endpoint host0:29500 --nproc_per_node 8 lora_finetune_distributed --config llama3_1/8B_lora\n  node 1: tune run --nnodes 2 --node_rank 1 --rdzv_endpoint host0:29500 --nproc_per_node 8 lora_finetune_distributed --config llama3_1/8B_lora\n\nRanks are node_rank * nproc_per_node + local rank; every rank trains on its share of each global batch of nproc_per_node * nnodes * batch_size samples, and rank 0 logs and saves."
    )]
    Run {
        /// Workers on this machine: one per CUDA device (0..N-1), or N workers sharing the CPU.
        #[arg(long = "nproc_per_node", alias = "nproc-per-node", default_value_t = 1)]
        nproc_per_node: usize,
        /// Machines taking part, one `tune run` on each.
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        /// This machine's index, 0..nnodes-1; node 0 hosts the rendezvous.
        #[arg(long = "node_rank", alias = "node-rank", default_value_t = 0)]
        node_rank: usize,
        /// HOST:PORT of node 0's rendezvous (needed with --nnodes above 1).
        #[arg(long = "rdzv_endpoint", alias = "rdzv-endpoint")]
        rdzv_endpoint: Option<String>,
        /// Seconds the nodes wait for each other at the rendezvous.
        #[arg(long = "rdzv_timeout", alias = "rdzv-timeout", default_value_t = 300)]
        rdzv_timeout: u64,
        /// Recipe name (`tune ls` lists them; torchtune's names work).
        recipe: String,
        /// Built-in config name or YAML file.
        #[arg(long)]
        config: String,
        /// key=value overrides (`a.b=1`, `list=[x,y]`, `~key` deletes, `model=<component>`).
        overrides: Vec<String>,
    },
    /// Download a model or dataset from the Hugging Face Hub (into the shared HF cache).
    #[command(
        after_help = "Examples:\n  tune download meta-llama/Llama-3.2-1B-Instruct --output-dir /tmp/Llama-3.2-1B-Instruct --ignore-patterns \"original/*\"\n  tune download tatsu-lab/alpaca --repo-type dataset\n\nHonours HF_TOKEN, HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE as huggingface_hub does."
    )]
    Download {
        /// Repository id, e.g. `Qwen/Qwen2.5-0.5B-Instruct`.
        repo_id: String,
        /// Also place the files in this directory.
        #[arg(long)]
        output_dir: Option<PathBuf>,
        /// Skip files matching these globs (e.g. "*.pth" "original/*").
        #[arg(long, num_args = 1..)]
        ignore_patterns: Vec<String>,
        /// Branch, tag or commit.
        #[arg(long)]
        revision: Option<String>,
        /// Access token (default: HF_TOKEN or the token saved by `huggingface-cli login`).
        #[arg(long)]
        hf_token: Option<String>,
        #[arg(long, value_enum, default_value = "model")]
        repo_type: RepoTypeArg,
    },
    /// Upload a PEFT adapter or a full checkpoint directory to the Hub, with a model card.
    #[command(
        after_help = "Example:\n  tune push /tmp/tune/tiny/lora_finetune_single_device/epoch_0 my-user/tiny-llama-lora --private"
    )]
    Push {
        /// A checkpoint directory written by `tune run` (adapter or full model).
        dir: PathBuf,
        /// Target repository id, e.g. `my-user/my-adapter`.
        repo_id: String,
        /// Create the repository as private.
        #[arg(long)]
        private: bool,
        /// Branch to commit to.
        #[arg(long)]
        revision: Option<String>,
        #[arg(long)]
        commit_message: Option<String>,
        /// Open a pull request instead of committing.
        #[arg(long)]
        create_pr: bool,
        #[arg(long)]
        hf_token: Option<String>,
        /// Also upload the optimizer state and tune_checkpoint.json (only resuming needs them).
        #[arg(long)]
        include_training_state: bool,
        /// List the files that would be uploaded, then stop (no token or network needed).
        #[arg(long)]
        dry_run: bool,
    },
    /// Measure training/forward throughput, step-time split, memory, load time and checkpoint
    /// blocking on random weights of a known shape (nothing is downloaded).
    #[command(
        after_help = "Examples:\n  tune bench --shape smollm2-135m --mode lora --batch-size 4 --seq-len 256 --steps 5\n  tune bench --shape tiny --mode full"
    )]
    Bench {
        /// One of benches/shapes.json: tiny, smollm2-135m, llama3.2-1b, qwen3-30b-a3b-2l (a
        /// mixture-of-experts layer), qwen3-30b-a3b-2l-32e, qwen3-30b-a3b-narrow-48l (its depth
        /// and experts, narrow), gpt-oss-20b-2l, gpt-oss-small-2l.
        #[arg(long, default_value = "tiny")]
        shape: String,
        #[arg(long, value_enum, default_value = "lora")]
        mode: crate::bench::BenchMode,
        #[arg(long, default_value_t = 4)]
        batch_size: usize,
        #[arg(long, default_value_t = 256)]
        seq_len: usize,
        #[arg(long, default_value_t = 5)]
        steps: usize,
        #[arg(long, default_value_t = 8)]
        lora_rank: usize,
        /// Per-layer activation checkpointing, as `enable_activation_checkpointing: true`.
        #[arg(long)]
        activation_checkpointing: bool,
        /// With checkpointing, each layer's kept input in host memory, as
        /// `enable_activation_offloading: true` (cuda / wgpu).
        #[arg(long, requires = "activation_checkpointing")]
        activation_offloading: bool,
        /// Float dtype of weights, activations and optimizer state, as a config's `dtype`.
        #[arg(long, value_enum, default_value = "fp32")]
        dtype: crate::bench::BenchDtype,
        /// Row chunks of the output projection and loss, as `loss.num_output_chunks` (1: none).
        #[arg(long, default_value_t = 8)]
        output_chunks: usize,
        /// tune's fused attention (the default: the CPU's kernel, or the cubecl kernels on cuda
        /// and wgpu), or burn's composed ops, which keep every layer's `seq x seq`
        /// probabilities for the backward: to measure the difference.
        #[arg(long, value_enum, default_value = "fused")]
        attention: crate::bench::Attention,
        /// The largest block (query rows per cube and keys per tile: 8, 16, 32 or 64) tune's
        /// cubecl attention kernels may take on cuda / wgpu; by default the largest the device's
        /// shared memory holds. To time the blocks against each other; `--json` reports the
        /// block taken.
        #[arg(long, value_parser = clap::value_parser!(u16).range(8..=64))]
        attention_block: Option<u16>,
        /// Rows of real lengths instead of full rows: a JSON file `{"lengths": [...]}`
        /// (benches/alpaca_lengths.json). Each step takes the next `--batch-size` lengths (cut
        /// to `--seq-len`) and pads the rows to the longest, as torchtune's collate does;
        /// tokens/s counts the rows' tokens, not the padding.
        #[arg(long)]
        row_lengths: Option<PathBuf>,
        /// With `--row-lengths`: compute the padded batch as it is, as torchtune does, instead of
        /// the padding-free packs the recipes run (to measure the difference).
        #[arg(long)]
        keep_padding: bool,
        /// cpu, or cuda / wgpu in a build with the cuda / wgpu feature.
        #[arg(long, value_enum, default_value = "cpu")]
        device: crate::config::schema::Device,
        /// Print one JSON object (the keys benches/pytorch_reference.py prints) instead of markdown.
        #[arg(long)]
        json: bool,
    },
    /// Write the int4 export of a model (linear weights packed two per byte, per-group scales)
    /// to `<output_dir>/quantized/`, using a QAT config's `checkpointer` and `quantizer`.
    #[command(
        after_help = "Examples:\n  tune quantize --config tiny/qat_single_device\n  tune quantize --config tiny/qat_single_device checkpointer.checkpoint_dir=/tmp/tune/tiny/qat_single_device/epoch_0 output_dir=/tmp/q"
    )]
    Quantize {
        /// Built-in config name or YAML file (a QAT config).
        #[arg(long)]
        config: String,
        /// key=value overrides, as for `tune run`.
        overrides: Vec<String>,
        /// The recipe the config is for (default: from the config's header or built-in entry).
        #[arg(long)]
        recipe: Option<String>,
    },
    /// Draw the loss and learning-rate curves of a run's metrics.jsonl (PNG, or SVG by extension).
    #[command(
        after_help = "Example:\n  tune plot /tmp/tune/tiny/lora_finetune_single_device/logs/metrics.jsonl -o loss.png"
    )]
    Plot {
        /// A metrics file written by `tune run` (`<output_dir>/logs/metrics.jsonl`).
        metrics: PathBuf,
        /// Output image: .png or .svg.
        #[arg(short, long, default_value = "loss.png")]
        output: PathBuf,
        /// Pixels, 100 to 16384 (larger images exhaust memory in the renderer).
        #[arg(long, default_value_t = 1200, value_parser = clap::value_parser!(u32).range(100..=16384))]
        width: u32,
        /// Pixels, 100 to 16384.
        #[arg(long, default_value_t = 800, value_parser = clap::value_parser!(u32).range(100..=16384))]
        height: u32,
    },
    /// Node 0's rendezvous for a multi-node `tune run` (burn-collective's orchestrator), in a
    /// process of its own that ends with its parent; `tune run` starts it.
    #[command(hide = true)]
    Rendezvous {
        #[arg(long)]
        port: u16,
    },
    /// List the checkpoints in an output directory and verify their checksums, or (`consolidate`)
    /// turn PyTorch DCP per-rank shard files into an ordinary Hugging Face checkpoint.
    #[command(
        after_help = "Examples:\n  tune checkpoints /tmp/tune/tiny/lora_finetune_single_device\n  tune checkpoints consolidate /tmp/tune/tiny/epoch_0",
        subcommand_negates_reqs = true,
        args_conflicts_with_subcommands = true
    )]
    Checkpoints {
        #[command(subcommand)]
        action: Option<CheckpointsAction>,
        /// The run's output directory (its checkpoints are listed).
        #[arg(required = true)]
        output_dir: Option<PathBuf>,
        /// Skip checksum verification (only check that files are present).
        #[arg(long)]
        no_verify: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum CheckpointsAction {
    /// Consolidate DIR/sharded/ (torch.distributed.checkpoint's per-rank
    /// shard-0000r-model-0000k-of-0000N.safetensors files) into DIR: model-0000k-of-0000N.safetensors
    /// and model.safetensors.index.json, as torch's consolidate_safetensors_files writes them.
    /// Staged under hidden names and renamed into place at the end; refuses a DIR that already
    /// holds a consolidated checkpoint.
    #[command(after_help = "Example:\n  tune checkpoints consolidate /tmp/tune/tiny/epoch_0")]
    Consolidate {
        /// A checkpoint directory holding sharded/.
        dir: PathBuf,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum RepoTypeArg {
    Model,
    Dataset,
}
