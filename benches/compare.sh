#!/usr/bin/env bash
# Side-by-side benchmark: `tune bench` and the PyTorch reference (benches/pytorch_reference.py)
# on the same shapes and settings, on this machine, one run after the other, then a markdown
# table of tune/PyTorch ratios. Not part of CI: it installs PyTorch from PyPI into
# benches/.venv on first use (a few GB with its CUDA libraries).
#
#   benches/compare.sh                 # CPU: tiny and SmolLM2-135M shapes, LoRA and full
#   DEVICE=cuda benches/compare.sh     # a build with --features cuda on an NVIDIA GPU, both in bf16
#   DTYPE=bf16 benches/compare.sh      # both sides in bf16 (default: bf16 on cuda, fp32 on cpu)
#   RUNS="smollm2-135m:lora:1:128:3" benches/compare.sh
#   RUNS="smollm2-135m:dora:4:256:2" benches/compare.sh   # DoRA against torchtune's DoRALinear
#   RUNS="llama3.2-1b:qlora:1:256:2" benches/compare.sh   # QLoRA (qdora: QDoRA) against torchtune's
#   COMPOSED=1 RUNS="smollm2-135m:lora:1:2048:1" benches/compare.sh   # tune also with burn's
#                                      # composed attention (--attention composed), as a row of its own
#   ROW_LENGTHS=benches/alpaca_lengths.json RUNS="smollm2-135m:lora:4:512:6" benches/compare.sh
#                                      # real alpaca row lengths, padded per batch as torchtune
#                                      # pads (seq is then the cut); tune runs them padding-free
#   TUNE=path/to/tune PYTHON=python3 benches/compare.sh   # a prebuilt tune and a Python that has
#                                      # torch (a GPU machine without cargo or network)
set -euo pipefail
cd "$(dirname "$0")/.."

DEVICE=${DEVICE:-cpu}
if [ "$DEVICE" = cuda ]; then DTYPE=${DTYPE:-bf16}; else DTYPE=${DTYPE:-fp32}; fi
# shape:mode:batch:seq:steps
RUNS=${RUNS:-"tiny:lora:4:128:10 tiny:full:4:128:10 smollm2-135m:lora:1:128:3 smollm2-135m:full:1:128:3 smollm2-135m:lora:4:256:2"}
VENV=benches/.venv
OUT=${OUT:-target/bench-compare.jsonl}
PYTHON=${PYTHON:-$VENV/bin/python}

if [ "$PYTHON" = "$VENV/bin/python" ] && [ ! -x "$PYTHON" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch numpy safetensors
  # torchtune's builders for --impl torchtune; torchtune 0.6 needs a torchao of its time.
  "$VENV/bin/pip" install -q torchtune "torchao==0.11.0" || true
fi

if [ -z "${TUNE:-}" ]; then
  FEATURES=()
  [ "$DEVICE" = cuda ] && FEATURES=(--features cuda)
  cargo build --release "${FEATURES[@]}" >&2
  TUNE=target/release/tune
fi

: > "$OUT"
for run in $RUNS; do
  IFS=: read -r shape mode batch seq steps <<< "$run"
  args=(--shape "$shape" --mode "$mode" --batch-size "$batch" --seq-len "$seq" --steps "$steps" --device "$DEVICE" --dtype "$DTYPE")
  [ -n "${ROW_LENGTHS:-}" ] && args+=(--row-lengths "$ROW_LENGTHS")
  echo "== $run" >&2
  "$TUNE" bench "${args[@]}" --json >> "$OUT"
  if [ "${COMPOSED:-0}" = 1 ]; then "$TUNE" bench "${args[@]}" --attention composed --json >> "$OUT" || true; fi
  # DoRA and NF4 bases have no plain-PyTorch model here: torchtune's modules are the reference.
  # A reference that runs out of memory (killed) is reported, and the other rows still run.
  case "$mode" in dora|qlora|qdora) ;; *) "$PYTHON" benches/pytorch_reference.py "${args[@]}" >> "$OUT" || echo "== $run: PyTorch failed (exit $?)" >&2 ;; esac
  if "$PYTHON" -c "import torchtune.models.llama3" 2>/dev/null; then
    "$PYTHON" benches/pytorch_reference.py "${args[@]}" --impl torchtune >> "$OUT" || true
  fi
done
"$PYTHON" benches/compare.py "$OUT"
