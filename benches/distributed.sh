#!/usr/bin/env bash
# Data-parallel figures for BENCHMARKS.md, measured on this machine (no PyTorch side: torchrun
# on a CPU-only box runs gloo, a different engine; see BENCHMARKS.md).
#
# 1. tiny shape, LoRA and full fine-tuning, the same global batch of 8: one worker (batch 8)
#    vs 2 workers as threads of one process (batch 4 each): tokens/s over all ranks, wall time.
# 2. SmolLM2-135M shape (random weights) full fine-tuning, global batch 4: one device vs 2 and 4
#    ranks, each a process joined over loopback (`--nnodes W`), FSDP (data_parallel_shard_dim
#    -1) and ZeRO-1 (1): peak RSS per rank (/usr/bin/time), the weights (`parameter_bytes`),
#    gradients (`gradient_bytes`) and optimizer state rank 0 holds, tokens/s, and how long
#    training waited for the final save on rank 0 (its "training waited ... s" line).
#
#     benches/distributed.sh            # prints markdown rows (3: a memory limit, `prlimit --as`)
set -euo pipefail
cd "$(dirname "$0")/.."
# PROFILE=dev: the dev profile's build (dependencies at opt-level 3, tune at 1), for a quick run.
PROFILE=${PROFILE:-release}
cargo build --profile "$PROFILE" --quiet --bin tune --example random_checkpoint
DIR=target/$([ "$PROFILE" = dev ] && echo debug || echo "$PROFILE")
TUNE=$DIR/tune
OUT=${OUT:-/tmp/tune-dp-bench}
rm -rf "$OUT" && mkdir -p "$OUT"

# mean of a metric over steps after the first two (warm-up); last value of another
metric() { python3 - "$1" "$2" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
vals = [r[sys.argv[2]] for r in rows[2:]] or [rows[-1][sys.argv[2]]]
print(f"{sum(vals) / len(vals):.0f}")
PY
}
peak_mb() { awk '/Maximum resident set size/ {printf "%.0f", $6 / 1024}' "$1"; }

echo "| shape | mode | workers | batch per worker | tokens/s (all ranks) | wall s |"
echo "| --- | --- | --- | --- | --- | --- |"
for mode in lora full; do
  for workers in 1 2; do
    dir="$OUT/tiny-$mode-$workers"
    batch=$((8 / workers))
    start=$(date +%s.%N)
    if [ "$workers" = 1 ]; then
      "$TUNE" run ${mode}_finetune_single_device --config tiny/$mode output_dir="$dir" \
        batch_size=$batch max_steps_per_epoch=12 save_adapter_weights_only=True 2>/dev/null
    else
      "$TUNE" run --nproc_per_node 2 ${mode}_finetune_distributed --config tiny/$mode output_dir="$dir" \
        batch_size=$batch max_steps_per_epoch=12 save_adapter_weights_only=True 2>/dev/null
    fi
    end=$(date +%s.%N)
    printf "| tiny | %s | %s | %s | %s | %.2f |\n" "$mode" "$workers" "$batch" \
      "$(metric "$dir/logs/metrics.jsonl" tokens_per_second)" "$(echo "$end - $start" | bc)"
  done
done

CKPT="$OUT/smollm2-135m-random"
$DIR/examples/random_checkpoint smollm2-135m "$CKPT" >/dev/null
# Global batch 4 on 1, 2 and 4 ranks; each rank is a process of its own (`--nnodes W`), so a
# process's peak RSS (/usr/bin/time -v) is one rank's.
common=(--config tiny/full "checkpointer.checkpoint_dir=$CKPT" max_steps_per_epoch=6 epochs=1)
mb() { echo "$(metric "$1" "$2") / 1048576" | bc -l; }
# rank 0's peak RSS at its last step, before the final save (`peak_memory_bytes`)
last_mb() { python3 -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])]; print(r[-1]['peak_memory_bytes']/1048576)" "$1"; }
echo
# seconds training waited for the last save (rank 0's stderr)
blocked() { grep -o 'training waited [0-9.]* s' "$1" | tail -1 | awk '{print $3}'; }
echo "| shape | mode | ranks | batch per rank | peak RSS per rank: rank 0 / the others (MB) | rank 0 peak RSS before the final save (MB) | weights per rank (MB) | gradients per rank (MB) | optimizer state per rank (MB) | tokens/s (all ranks) | final save: training waited (s) |"
echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
dir="$OUT/135m-1"
/usr/bin/time -v -o "$OUT/time-1-0.txt" "$TUNE" run full_finetune_single_device "${common[@]}" \
  output_dir="$dir" batch_size=4 2>"$OUT/135m-1.log"
printf "| smollm2-135m | one device | 1 | 4 | %s | %.0f | %.0f | %.0f | %.0f | %s | %s |\n" "$(peak_mb "$OUT/time-1-0.txt")" \
  "$(last_mb "$dir/logs/metrics.jsonl")" \
  "$(mb "$dir/logs/metrics.jsonl" parameter_bytes)" \
  "$(mb "$dir/logs/metrics.jsonl" gradient_bytes)" \
  "$(mb "$dir/logs/metrics.jsonl" optimizer_state_bytes)" \
  "$(metric "$dir/logs/metrics.jsonl" tokens_per_second)" "$(blocked "$OUT/135m-1.log")"
for ranks in 2 4; do
  for mode in fsdp zero1; do
    dir="$OUT/135m-$mode-$ranks"
    dim=-1; [ "$mode" = zero1 ] && dim=1
    port=$((20000 + RANDOM % 20000))
    for rank in $(seq 0 $((ranks - 1))); do
      /usr/bin/time -v -o "$OUT/time-$mode-$ranks-$rank.txt" "$TUNE" run --nnodes "$ranks" \
        --node_rank "$rank" --rdzv_endpoint 127.0.0.1:$port full_finetune_distributed "${common[@]}" \
        output_dir="$dir" batch_size=$((4 / ranks)) data_parallel_shard_dim=$dim >/dev/null \
        2>"$OUT/135m-$mode-$ranks-$rank.log" &
    done
    wait
    # rank 0's peak / the other ranks' (lowest-highest)
    others=$(for rank in $(seq 1 $((ranks - 1))); do peak_mb "$OUT/time-$mode-$ranks-$rank.txt"; echo; done | sort -n)
    low=$(echo "$others" | head -1); high=$(echo "$others" | tail -1)
    peak="$(peak_mb "$OUT/time-$mode-$ranks-0.txt") / $low$([ "$low" = "$high" ] || echo "-$high")"
    printf "| smollm2-135m | %s | %s (processes) | %s | %s | %.0f | %.0f | %.0f | %.0f | %s | %s |\n" "$mode" "$ranks" \
      $((4 / ranks)) "$peak" "$(last_mb "$dir/logs/metrics.jsonl")" \
      "$(mb "$dir/logs/metrics.jsonl" parameter_bytes)" \
      "$(mb "$dir/logs/metrics.jsonl" gradient_bytes)" \
      "$(mb "$dir/logs/metrics.jsonl" optimizer_state_bytes)" \
      "$(metric "$dir/logs/metrics.jsonl" tokens_per_second)" "$(blocked "$OUT/135m-$mode-$ranks-0.log")"
  done
done

# 3. Under a per-process address-space limit too small for the whole model (LIMIT_MB, default
# 3500: one device peaks at ~5 GB RSS), full fine-tuning on 1 rank fails and on 4 FSDP ranks
# (processes) completes, consolidated epoch checkpoint included.
LIMIT_MB=${LIMIT_MB:-3500}
limit=$((LIMIT_MB * 1024 * 1024))
echo
echo "| ranks | address-space limit per process (MB) | outcome |"
echo "| --- | --- | --- |"
dir="$OUT/limit-1"
if prlimit --as=$limit "$TUNE" run full_finetune_single_device "${common[@]}" output_dir="$dir" \
  batch_size=4 >"$OUT/limit-1.log" 2>&1; then outcome=completed; else
  outcome="failed: $(grep -m1 -E 'memory allocation|error' "$OUT/limit-1.log" | cut -c1-200 || true)"; fi
echo "| 1 | $LIMIT_MB | $outcome |"
dir="$OUT/limit-4"
port=$((20000 + RANDOM % 20000))
for rank in 0 1 2 3; do
  prlimit --as=$limit "$TUNE" run --nnodes 4 --node_rank "$rank" --rdzv_endpoint 127.0.0.1:$port \
    full_finetune_distributed "${common[@]}" output_dir="$dir" batch_size=1 >"$OUT/limit-4-$rank.log" 2>&1 &
done
if wait && [ -f "$dir/epoch_0/model.safetensors.index.json" ]; then outcome="completed, epoch_0 consolidated"
else outcome="failed: $(grep -h -m1 error "$OUT"/limit-4-*.log | head -1 || true)"; fi
echo "| 4 (FSDP) | $LIMIT_MB | $outcome |"
