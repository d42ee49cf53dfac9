"""Checks tune's DCP shard files and consolidation against torch's own code (not run in CI).

1. Has tune write tiny-llama's weights as 3 ranks' DCP shard files (half the tensors bf16, 3
   output files) and consolidate them (the `dcp_write_for_torch_check` test with
   TUNE_DCP_CHECK_DIR set): WORK/sharded/ and WORK/tune-consolidated/.
2. Runs torch's `consolidate_safetensors_files` on WORK/sharded/ (the file split read from the
   shard file names, as torch's writer would pass fqn_to_index_mapping) into
   WORK/torch-consolidated/, and `torch.distributed.checkpoint.load` with
   `HuggingFaceStorageReader` on WORK/sharded/ into full tensors (one process, no group).
3. Compares: torch's consolidated tensors == tune's (bytes, dtype, shape), the two indexes'
   weight_map and total_size, torch's reader's tensors == tune's, and all == tiny-llama's
   weights (rounded to bf16 where stored so).

Run from the repository root, with torch (2.8+) and safetensors installed:

    CARGO_TARGET_DIR=... /path/to/venv/bin/python benches/check_dcp_with_torch.py [WORK]
"""

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

ROOT = Path(__file__).resolve().parent.parent


def load_dir(d: Path) -> dict:
    index = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for f in sorted(set(index["weight_map"].values())):
        out.update(load_file(str(d / f)))
    return out, index


def torch_consolidate(sharded: Path, out: Path) -> Path:
    """torch's `consolidate_safetensors_files` of `sharded` into `out`, with the file split the
    shard file names carry (as torch's writer would pass fqn_to_index_mapping)."""
    fqn_to_index = {}
    for p in sharded.glob("*.safetensors"):
        k = int(re.fullmatch(r"shard-\d+-model-(\d+)-of-\d+\.safetensors", p.name).group(1))
        for name in load_file(str(p)).keys():
            assert fqn_to_index.setdefault(name, k) == k, name
    out.mkdir(exist_ok=True)
    consolidate_safetensors_files(str(sharded), str(out), fqn_to_index)
    return out


def main() -> None:
    work = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="tune-dcp-check-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TUNE_DCP_CHECK_DIR=str(work))
    subprocess.run(
        ["cargo", "test", "--test", "suite", "dcp_write_for_torch_check", "--", "--exact",
         "dcp::dcp_write_for_torch_check"],
        cwd=ROOT, env=env, check=True,
    )
    sharded = work / "sharded"
    shard_names = sorted(p.name for p in sharded.glob("*.safetensors"))
    print("tune wrote:", *shard_names, sep="\n  ")

    torch_out = torch_consolidate(sharded, work / "torch-consolidated")

    theirs, their_index = load_dir(torch_out)
    ours, our_index = load_dir(work / "tune-consolidated")
    assert theirs.keys() == ours.keys(), (theirs.keys() ^ ours.keys())
    for name in theirs:
        a, b = theirs[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a.view(torch.uint8) if a.numel() else a, b.view(torch.uint8) if b.numel() else b), name
    assert their_index["weight_map"] == our_index["weight_map"]
    assert their_index["metadata"]["total_size"] == our_index["metadata"]["total_size"]
    print(f"torch consolidate_safetensors_files == tune consolidate: {len(theirs)} tensors, "
          f"total_size {our_index['metadata']['total_size']}, files {sorted(set(our_index['weight_map'].values()))}")

    # torch's reader into full tensors.
    state = {name: torch.zeros_like(t) for name, t in ours.items()}
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(sharded)))
    for name, t in state.items():
        assert torch.equal(t, ours[name]), name
    print(f"torch HuggingFaceStorageReader == tune: {len(state)} tensors")

    original = load_file(str(ROOT / "tests/fixtures/tiny-llama/model.safetensors"))
    for name, t in ours.items():
        assert torch.equal(original[name].to(t.dtype), t), name
    print("all equal tiny-llama's weights (bf16 where stored so); work dir:", work)


if __name__ == "__main__":
    main()
