//! Writes a Hugging Face checkpoint with random weights in one of `tune bench`'s shapes
//! (`tiny`, `smollm2-135m`, `llama3.2-1b`), for benchmarks of whole runs without a download:
//! `benches/distributed.sh` trains it with the shipped tiny tokenizer and data.
//!
//!     cargo run --release --example random_checkpoint -- smollm2-135m /tmp/smollm2-135m-random

use tune::checkpoint::StorageDtype;
use tune::model_io::hf::{DEFAULT_MAX_SHARD_BYTES, save_model};
use tune::models::{ModelArgs, RandomInit, build};

type B = burn::backend::Flex;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(shape), Some(out)) = (args.next(), args.next()) else {
        anyhow::bail!("usage: random_checkpoint <shape: tiny|smollm2-135m|llama3.2-1b> <out_dir>");
    };
    let config = tune::bench::shapes::config(&shape)
        .ok_or_else(|| anyhow::anyhow!("unknown shape {shape}"))?;
    let args = ModelArgs::from_json(config).map_err(anyhow::Error::msg)?;
    let model = build::<B>(&args, &mut RandomInit::new(0, &args), &Default::default())?;
    let files = save_model(
        &model,
        std::path::Path::new(&out),
        None,
        StorageDtype::F32,
        DEFAULT_MAX_SHARD_BYTES,
    )?;
    println!(
        "{out}: {} parameters in {}",
        args.num_params(),
        files.join(", ")
    );
    Ok(())
}
