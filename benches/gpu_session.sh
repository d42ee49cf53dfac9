#!/usr/bin/env bash
# One prepared GPU check for a borrowed NVIDIA machine that has PyTorch but no cargo and no
# network: prebuilt binaries and wheels travel in BIN (default .gpu/), results go to RESULTS.
#
#   Here:  cargo build --release --features cuda,autotune --bin tune   # part 7 only
#          cp target/release/tune .gpu/tune-autotune
#          cargo build --release --features cuda --bin tune --example random_checkpoint
#          cp target/release/tune target/release/examples/random_checkpoint .gpu/
#          (either may travel stripped and xz-compressed as .gpu/NAME.xz: tune is 70 MB
#          stripped, 18 MB compressed)
#          (optional) wheels for torchtune 0.6.1 and what it imports in .gpu/whl/
#   There: RESULTS=/some/dir benches/gpu_session.sh
#
# It runs, each under its own time limit so one slow part cannot eat the others:
#   1. a LoRA fine-tune of the tiny model on cuda in fp32 and bf16 (the loss must fall);
#   2. benches/compare.sh on cuda in bf16: tune against plain PyTorch (and torchtune's
#      builders when its wheels import) on the same shapes, same machine;
#   3. benches/gpu_distributed.sh: single device against a 1-rank lora_finetune_distributed;
#   4. FSDP's CPU offload (`fsdp_cpu_offload: True`) on one cuda rank against the run without
#      it: the same losses, the rows and AdamW state in host memory, tokens/s of each;
#   5. long sequences: SmolLM2-135M LoRA at 512-4096 tokens with burn's composed attention,
#      tune's fused cubecl attention, and fused + activation checkpointing + offloading:
#      tokens/s, peak device memory (cubecl's memory manager) and each run's losses, which must
#      agree between the attention paths (fp32, then bf16), the fused kernels' default block
#      against a block of 32 in bf16 at 1024 and 4096 tokens; and gpt-oss's layer pair with
#      attention sinks (shape gpt-oss-small-2l) at 1024 and 4096 tokens, composed against fused
#      (the fused kernels scale each row by its sink weight) in bf16;
#   6. the RL recipes on cuda: the tiny GRPO and PPO configs (the reward must be logged, the
#      run must finish);
#   7. burn's autotune, when BIN has a second binary built with it (`cargo build --release
#      --features cuda,autotune --bin tune`, carried as tune-autotune or tune-autotune.xz):
#      part 2's rows and part 5's bf16 4096-token rows again with that binary.
# Each part's time limit is its own (PARTS="1 5" runs some); the whole is about eight minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu}
RESULTS=${RESULTS:-/tmp/tune-gpu-results}
mkdir -p "$RESULTS"
export TUNE=$PWD/$BIN/tune RANDOM_CHECKPOINT=$PWD/$BIN/random_checkpoint
for exe in tune tune-autotune random_checkpoint; do
  if [ -f "$BIN/$exe.xz" ]; then
    mkdir -p /tmp/tune-bin
    python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
      "$BIN/$exe.xz" "/tmp/tune-bin/$exe" && chmod +x "/tmp/tune-bin/$exe"
  fi
done
[ -x /tmp/tune-bin/tune ] && export TUNE=/tmp/tune-bin/tune
[ -x /tmp/tune-bin/random_checkpoint ] && export RANDOM_CHECKPOINT=/tmp/tune-bin/random_checkpoint
TUNE_AUTOTUNE=$PWD/$BIN/tune-autotune
[ -x /tmp/tune-bin/tune-autotune ] && TUNE_AUTOTUNE=/tmp/tune-bin/tune-autotune
nvidia-smi -L | tee "$RESULTS/gpu.txt"
PARTS=${PARTS:-"1 5 6 2 7 3 4"}  # run in this file's order
part() { [[ " $PARTS " == *" $1 "* ]]; }
# cubecl loads the driver and NVRTC at run time: the toolkit's, or the one PyTorch's wheels carry.
for lib in /usr/local/cuda/lib64 $(python3 -c "import nvidia, os; print(' '.join(os.path.join(p, d, 'lib') for p in nvidia.__path__ for d in os.listdir(p)))" 2>/dev/null); do
  [ -d "$lib" ] && LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH
if ls "$BIN"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$BIN"/whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torchtune.models.llama3; print('torchtune imports')" 2>&1 | tail -1

if part 1; then
echo "== 1. tiny LoRA on cuda"
for dtype in fp32 bf16; do
  timeout 90 "$TUNE" run lora_finetune_single_device --config tiny/lora_single_device \
    device=cuda dtype=$dtype output_dir="/tmp/tiny-$dtype" epochs=1 2>&1 | tail -3
  python3 - "/tmp/tiny-$dtype/logs/metrics.jsonl" "$dtype" <<'PY' | tee -a "$RESULTS/tiny.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"tiny lora cuda {sys.argv[2]}: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
PY
done
fi

if part 5; then
echo "== 5. long sequences: composed vs fused attention, checkpointing and offloading"
for dtype in fp32 bf16; do
  for seq in 512 1024 2048 4096; do
    [ "$dtype" = fp32 ] && [ "$seq" != 1024 ] && continue
    for variant in composed fused fused-block32 offload; do
      # The blocked kernels take the largest block the device holds (64 at this head size on
      # an H100/H200); 32 is timed beside it in bf16 at 1024 and 4096 tokens.
      [ "$variant" = fused-block32 ] && { [ "$dtype" = fp32 ] || [ "$seq" = 512 ] || [ "$seq" = 2048 ]; } && continue
      extra=(--attention fused)
      [ "$variant" = composed ] && extra=(--attention composed)
      [ "$variant" = fused-block32 ] && extra=(--attention fused --attention-block 32)
      [ "$variant" = offload ] && extra=(--activation-checkpointing --activation-offloading)
      timeout 45 "$TUNE" bench --device cuda --dtype $dtype --shape smollm2-135m --mode lora \
        --batch-size 1 --seq-len $seq --steps 2 "${extra[@]}" --json 2>>"$RESULTS/long.err" |
        python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['variant']='$variant'; print(json.dumps(r))" \
        >> "$RESULTS/long.jsonl" || echo "$dtype $seq $variant: failed (exit $?)" | tee -a "$RESULTS/long.err"
    done
  done
done
for seq in 1024 4096; do
  for variant in composed fused; do
    timeout 60 "$TUNE" bench --device cuda --dtype bf16 --shape gpt-oss-small-2l --mode lora \
      --batch-size 1 --seq-len $seq --steps 2 --attention $variant --json 2>>"$RESULTS/long.err" |
      python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['variant']='$variant'; print(json.dumps(r))" \
      >> "$RESULTS/long.jsonl" || echo "gpt-oss bf16 $seq $variant: failed (exit $?)" | tee -a "$RESULTS/long.err"
  done
done
python3 - "$RESULTS/long.jsonl" <<'PY' | tee "$RESULTS/long.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print("| shape | dtype | seq | attention | block | tokens/s | peak device GiB in use | reserved | losses |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
gib = lambda b: f"{b / 2**30:.2f}" if b else "-"
for r in rows:
    print(f"| {r['shape']} | {r['dtype']} | {r['seq_len']} | {r['variant']} | {r.get('attention_block') or '-'} | {r['tokens_per_second']:.0f} | "
          f"{gib(r['peak_device_memory_active_bytes'])} | {gib(r['peak_device_memory_reserved_bytes'])} | "
          + " ".join(f"{l:.5f}" for l in r["losses"]) + " |")
by = {}
for r in rows:
    by.setdefault((r["shape"], r["dtype"], r["seq_len"]), {})[r["variant"]] = r["losses"]
for (shape, dtype, seq), v in by.items():
    if "composed" in v and "fused" in v:
        worst = max(abs(a - b) / abs(b) for a, b in zip(v["fused"], v["composed"]))
        print(f"{shape} {dtype} {seq}: largest relative loss difference fused vs composed {worst:.2e}")
PY
fi

if part 6; then
echo "== 6. GRPO and PPO on cuda (tiny configs)"
for recipe in grpo_full_finetune_single_device:grpo_full_single_device ppo_full_finetune_single_device:ppo_full_single_device; do
  IFS=: read -r name config <<< "$recipe"
  timeout 60 "$TUNE" run "$name" --config "tiny/$config" device=cuda output_dir="/tmp/tiny-$config" \
    2>&1 | tail -2
  python3 - "/tmp/tiny-$config/logs/metrics.jsonl" "$name" <<'PY' | tee -a "$RESULTS/rl.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
keys = [k for k in rows[-1] if "reward" in k or k in ("loss", "kl", "tokens_per_second")]
print(f"{sys.argv[2]} on cuda: {len(rows)} steps; first " + ", ".join(f"{k} {rows[0].get(k, float('nan')):.4g}" for k in keys)
      + "; last " + ", ".join(f"{k} {rows[-1].get(k, float('nan')):.4g}" for k in keys))
PY
done
fi

if part 2; then
echo "== 2. tune vs PyTorch on cuda, bf16"
RUNS=${RUNS:-"smollm2-135m:lora:8:512:10 smollm2-135m:full:8:512:10"} \
  DEVICE=cuda PYTHON=python3 OUT="$RESULTS/compare.jsonl" timeout 150 benches/compare.sh \
  2>"$RESULTS/compare.err" | tee "$RESULTS/compare.md"
tail -5 "$RESULTS/compare.err"
fi

if part 7 && [ -x "$TUNE_AUTOTUNE" ]; then
echo "== 7. burn's autotune: part 2's rows and the 4096-token rows with the autotune build"
RUNS=${RUNS:-"smollm2-135m:lora:8:512:10 smollm2-135m:full:8:512:10"} TUNE="$TUNE_AUTOTUNE" \
  DEVICE=cuda PYTHON=python3 OUT="$RESULTS/compare-autotune.jsonl" timeout 150 benches/compare.sh \
  2>"$RESULTS/compare-autotune.err" | tee "$RESULTS/compare-autotune.md"
tail -5 "$RESULTS/compare-autotune.err"
for variant in composed fused; do
  timeout 60 "$TUNE_AUTOTUNE" bench --device cuda --dtype bf16 --shape smollm2-135m --mode lora \
    --batch-size 1 --seq-len 4096 --steps 2 --attention $variant --json 2>>"$RESULTS/long.err" |
    python3 -c "import json,sys; r=json.loads(sys.stdin.read()); r['variant']='$variant+autotune'; print(json.dumps(r))" \
    | tee -a "$RESULTS/long-autotune.jsonl" || echo "autotune 4096 $variant: failed (exit $?)" | tee -a "$RESULTS/long.err"
done
fi

if part 3; then
echo "== 3. data parallelism on cuda"
RUN_DIR=/tmp/tune-gpu-bench timeout 100 benches/gpu_distributed.sh 2>&1 | tee "$RESULTS/distributed.md"
fi

if part 4; then
echo "== 4. FSDP CPU offload on cuda (one rank)"
for off in False True; do
  timeout 60 "$TUNE" run full_finetune_distributed --config tiny/full device=cuda \
    fsdp_cpu_offload=$off output_dir="/tmp/tiny-offload-$off" max_steps_per_epoch=8 \
    gradient_accumulation_steps=2 clip_grad_norm=0.5 2>&1 | tail -2
done
python3 - /tmp/tiny-offload-False /tmp/tiny-offload-True <<'PY' | tee "$RESULTS/offload.txt"
import json, sys
runs = [[json.loads(l) for l in open(d + "/logs/metrics.jsonl") if '"loss"' in l] for d in sys.argv[1:]]
worst = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(*runs))
for name, rows in zip(["on device", "offloaded"], runs):
    last = rows[-1]
    print(f"{name}: loss {rows[0]['loss']:.4f} -> {last['loss']:.4f}, tokens/s {last['tokens_per_second']:.0f}, "
          f"device weights {last['parameter_bytes']/1e6:.2f} MB, host weights {last.get('offloaded_parameter_bytes', 0)/1e6:.2f} MB, "
          f"host optimizer state {last.get('offloaded_optimizer_state_bytes', 0)/1e6:.2f} MB")
print(f"largest relative loss difference: {worst:.2e}")
PY
fi
