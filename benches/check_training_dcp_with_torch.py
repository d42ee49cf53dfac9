"""Checks the sharded checkpoints tune's FSDP training writes against torch and transformers (not run
in CI; check_dcp_with_torch.py checks the shard-file writer alone).

1. Runs `tune run --nproc_per_node 2 full_finetune_distributed --config tiny/full` for 4 steps with
   a checkpoint every 2 steps: step_2/ holds every rank's `sharded/` and
   `optimizer_sharded/` files, epoch_0/ the consolidated model.
2. torch's `HuggingFaceStorageReader` (`dcp.load`, one process) reads step_2/sharded/ and
   step_2/optimizer_sharded/ into full tensors: the weights equal those tune consolidates from the
   same shards (`tune checkpoints consolidate`), and every AdamW moment has its parameter's size.
3. torch's `consolidate_safetensors_files` on step_2/sharded/ writes the same tensors, index and file
   split as `tune checkpoints consolidate`.
4. transformers' `AutoModelForCausalLM.from_pretrained` loads epoch_0/ (consolidated on both ranks):
   its state dict equals the files tune wrote, and a forward pass gives finite logits.

Run from the repository root with torch (2.8+), safetensors and transformers installed, after
`cargo build` (or with TUNE pointing at a tune binary):

    TUNE=target/debug/tune /path/to/venv/bin/python benches/check_training_dcp_with_torch.py [WORK]
"""

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from check_dcp_with_torch import load_dir, torch_consolidate  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TUNE = os.environ.get("TUNE", str(ROOT / "target/debug/tune"))


def full_shapes(sharded: Path) -> dict:
    """name -> full shape, from the shard files' metadata (tune records them as TUNE_FULL_SHAPES;
    torch's reader only needs the state dict's tensors to be the full size)."""
    shapes = {}
    for p in sorted(sharded.glob("*.safetensors")):
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            info = json.loads(meta.get("DCP_SHARDING_INFO", "{}"))
            full = json.loads(meta.get("TUNE_FULL_SHAPES", "{}"))
            for name in f.keys():
                shape = list(f.get_slice(name).get_shape())
                offsets = info.get(name, {}).get("saved_offsets", [0] * len(shape))
                end = [o + s for o, s in zip(offsets, shape)]
                if name in full:
                    end = full[name]
                prev = shapes.get(name, [0] * len(end))
                shapes[name] = [max(a, b) for a, b in zip(prev, end)]
    return shapes


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tune-train-dcp-"))
    run = work / "run"
    subprocess.run(
        [TUNE, "run", "--nproc_per_node", "2", "full_finetune_distributed", "--config", "tiny/full",
         f"output_dir={run}", "batch_size=2", "max_steps_per_epoch=4", "save_every_n_steps=2",
         "optimizer.lr=1e-4"],
        cwd=ROOT, check=True,
    )
    step = run / "step_2"
    sharded, optimizer = step / "sharded", step / "optimizer_sharded"
    print("tune wrote:", *sorted(p.relative_to(run).as_posix() for p in run.rglob("*.safetensors")), sep="\n  ")

    # tune's own consolidation of the step checkpoint, for comparison.
    tune_copy = work / "tune-consolidated"
    subprocess.run(["cp", "-r", str(step), str(tune_copy)], check=True)
    subprocess.run([TUNE, "checkpoints", "consolidate", str(tune_copy)], cwd=ROOT, check=True)
    ours, our_index = load_dir(tune_copy)

    # 2. torch's reader.
    state = {name: torch.zeros(shape, dtype=ours[name].dtype) for name, shape in full_shapes(sharded).items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(sharded)))
    assert state.keys() == ours.keys(), state.keys() ^ ours.keys()
    for name, t in state.items():
        assert torch.equal(t, ours[name]), name
    print(f"torch HuggingFaceStorageReader on step_2/sharded == tune consolidate: {len(state)} tensors")
    moments = {name: torch.zeros(shape, dtype=torch.float32) for name, shape in full_shapes(optimizer).items()}
    dcp.load(moments, storage_reader=HuggingFaceStorageReader(str(optimizer)))
    for name, t in moments.items():
        kind, param = name.split(".", 1)
        assert kind in ("exp_avg", "exp_avg_sq"), name
        assert t.numel() == ours[param].numel(), (name, t.shape, ours[param].shape)
        assert torch.isfinite(t).all() and t.abs().sum() > 0, name
    print(f"torch HuggingFaceStorageReader on step_2/optimizer_sharded: {len(moments)} moments, each its parameter's size, finite, non-zero")

    # 3. torch's consolidation.
    torch_out = torch_consolidate(sharded, work / "torch-consolidated")
    theirs, their_index = load_dir(torch_out)
    assert theirs.keys() == ours.keys()
    for name in theirs:
        a, b = theirs[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    assert their_index["weight_map"] == our_index["weight_map"]
    assert their_index["metadata"]["total_size"] == our_index["metadata"]["total_size"]
    print(f"torch consolidate_safetensors_files on step_2/sharded == tune consolidate: {len(theirs)} tensors, "
          f"total_size {our_index['metadata']['total_size']}")

    # 4. transformers loads the epoch checkpoint.
    from transformers import AutoModelForCausalLM

    epoch = run / "epoch_0"
    model = AutoModelForCausalLM.from_pretrained(str(epoch), torch_dtype=torch.float32)
    written, _ = load_dir(epoch)
    loaded = model.state_dict()
    for name, t in written.items():
        assert torch.equal(loaded[name], t.to(torch.float32)), name
    logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert torch.isfinite(logits).all()
    print(f"transformers AutoModelForCausalLM loads epoch_0 ({type(model).__name__}): {len(written)} tensors equal, logits {tuple(logits.shape)} finite")
    print("ok; work dir:", work)


if __name__ == "__main__":
    main()
