#!/usr/bin/env bash
# One prepared GPU check for a borrowed NVIDIA machine that has PyTorch but no cargo and no
# network: prebuilt binaries and wheels travel in BIN (default .gpu/), results go to RESULTS.
#
#   Here:  cargo build --release --features cuda --bin tune --example random_checkpoint
#          cp target/release/tune target/release/examples/random_checkpoint .gpu/
#          (tune may travel xz-compressed as .gpu/tune.xz: 47 MB stripped, 9 MB compressed)
#          (optional) wheels for torchtune 0.6.1 and what it imports in .gpu/whl/
#   There: RESULTS=/some/dir benches/gpu_session.sh
#
# It runs, each under its own time limit so one slow part cannot eat the others:
#   1. a LoRA fine-tune of the tiny model on cuda in fp32 and bf16 (the loss must fall);
#   2. benches/compare.sh on cuda in bf16: tune against plain PyTorch (and torchtune's
#      builders when its wheels import) on the same shapes, same machine;
#   3. benches/gpu_distributed.sh: single device against a 1-rank lora_finetune_distributed;
#   4. FSDP's CPU offload (`fsdp_cpu_offload: True`) on one cuda rank against the run without
#      it: the same losses, the rows and AdamW state in host memory, tokens/s of each.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu}
RESULTS=${RESULTS:-/tmp/tune-gpu-results}
mkdir -p "$RESULTS"
export TUNE=$PWD/$BIN/tune RANDOM_CHECKPOINT=$PWD/$BIN/random_checkpoint
if [ -f "$BIN/tune.xz" ]; then
  mkdir -p /tmp/tune-bin
  python3 -c "import lzma,shutil,sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2],'wb'))" \
    "$BIN/tune.xz" /tmp/tune-bin/tune && chmod +x /tmp/tune-bin/tune
  export TUNE=/tmp/tune-bin/tune
fi
nvidia-smi -L | tee "$RESULTS/gpu.txt"
if ls "$BIN"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    "$BIN"/whl/*.whl && export PYTHONPATH=/tmp/site
fi
python3 -c "import torchtune.models.llama3; print('torchtune imports')" 2>&1 | tail -1

echo "== 1. tiny LoRA on cuda"
for dtype in fp32 bf16; do
  timeout 100 "$TUNE" run lora_finetune_single_device --config tiny/lora_single_device \
    device=cuda dtype=$dtype output_dir="/tmp/tiny-$dtype" epochs=1 2>&1 | tail -3
  python3 - "/tmp/tiny-$dtype/logs/metrics.jsonl" "$dtype" <<'PY' | tee -a "$RESULTS/tiny.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print(f"tiny lora cuda {sys.argv[2]}: {len(rows)} steps, loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}")
PY
done

echo "== 2. tune vs PyTorch on cuda, bf16"
RUNS=${RUNS:-"smollm2-135m:lora:8:512:10 smollm2-135m:full:8:512:10"} \
  DEVICE=cuda PYTHON=python3 OUT="$RESULTS/compare.jsonl" timeout 220 benches/compare.sh \
  2>"$RESULTS/compare.err" | tee "$RESULTS/compare.md"
tail -5 "$RESULTS/compare.err"

echo "== 3. data parallelism on cuda"
RUN_DIR=/tmp/tune-gpu-bench timeout 100 benches/gpu_distributed.sh 2>&1 | tee "$RESULTS/distributed.md"

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
