#!/usr/bin/env bash
# The distributed issue's GPU check, for a machine with an NVIDIA GPU (not run in CI; no GPU was
# lent while it was written, so BENCHMARKS.md has no rows from it yet). One script, about five
# minutes on an H200:
#   1. a single-device LoRA run and a 1-rank `lora_finetune_distributed` run on cuda in bf16 at
#      the SmolLM2-135M shape (random weights, the tiny tokenizer and data): tokens/s, peak
#      memory, and the two runs' losses, which must agree;
#   2. with 2+ GPUs, the same on `--nproc_per_node 2` (one worker per device).
#
#     benches/gpu_distributed.sh          # prints markdown rows
set -euo pipefail
cd "$(dirname "$0")/.."
# TUNE and RANDOM_CHECKPOINT: prebuilt binaries (a GPU machine without cargo).
if [ -z "${TUNE:-}" ]; then
  cargo build --release --quiet --features cuda --bin tune --example random_checkpoint
  TUNE=target/release/tune
  RANDOM_CHECKPOINT=target/release/examples/random_checkpoint
fi
OUT=${RUN_DIR:-/tmp/tune-gpu-bench}
rm -rf "$OUT" && mkdir -p "$OUT"
CKPT="$OUT/smollm2-135m-random"
"$RANDOM_CHECKPOINT" smollm2-135m "$CKPT" >/dev/null
common=(--config tiny/lora "checkpointer.checkpoint_dir=$CKPT" device=cuda dtype=bf16
  max_steps_per_epoch=20 save_adapter_weights_only=True)

summary() { python3 - "$1" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
tps = [r["tokens_per_second"] for r in rows[3:]] or [rows[-1]["tokens_per_second"]]
print(f"{sum(tps) / len(tps):.0f} | {max(r['peak_memory_bytes'] for r in rows) / 2**30:.2f} | "
      f"{rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
PY
}
echo "| run | tokens/s | peak GiB (process) | loss first -> last |"
echo "| --- | --- | --- | --- |"
"$TUNE" run lora_finetune_single_device "${common[@]}" output_dir="$OUT/single" batch_size=8 2>/dev/null
echo "| single device, batch 8 | $(summary "$OUT/single/logs/metrics.jsonl") |"
"$TUNE" run lora_finetune_distributed "${common[@]}" output_dir="$OUT/rank1" batch_size=8 2>/dev/null
echo "| lora_finetune_distributed, 1 rank, batch 8 | $(summary "$OUT/rank1/logs/metrics.jsonl") |"
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
  "$TUNE" run --nproc_per_node 2 lora_finetune_distributed "${common[@]}" output_dir="$OUT/rank2" \
    batch_size=4 2>/dev/null
  echo "| lora_finetune_distributed, 2 GPUs, batch 4 each | $(summary "$OUT/rank2/logs/metrics.jsonl") |"
fi
