"""Reads the JSON lines `benches/compare.sh` collected and prints the BENCHMARKS.md table:
for each shape and mode, tune against each PyTorch implementation measured in the same run."""

import json
import sys
from collections import OrderedDict


def main(path):
    runs = OrderedDict()
    for line in open(path):
        line = line.strip()
        if not line.startswith("{"):
            continue
        r = json.loads(line)
        key = (r["shape"], r["mode"], r["batch_size"], r["seq_len"])
        impl = r["impl"]
        if impl == "tune" and r.get("attention") == "composed":
            impl = "tune-composed"
        runs.setdefault(key, {})[impl] = r
    print("| shape | mode | batch x seq | tune tokens/s | PyTorch tokens/s | tokens/s ratio | tune step s (fwd/bwd/opt) | PyTorch step s (fwd/bwd/opt) | tune peak RSS | PyTorch peak RSS | memory ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    gb = lambda b: f"{b / 1e9:.2f} GB"
    split = lambda r: f"{r['step_seconds']:.3f} ({r['forward_seconds']:.3f}/{r['backward_seconds']:.3f}/{r['optimizer_seconds']:.3f})"
    for (shape, mode, b, s), impls in runs.items():
        for variant, suffix in (("tune", ""), ("tune-composed", ", composed attention")):
            tune = impls.get(variant)
            if not tune:
                continue
            for name, ref in impls.items():
                if name.startswith("tune"):
                    continue
                label = "PyTorch" if name == "pytorch-plain" else "torchtune"
                print(
                    f"| {shape} | {mode}{suffix} | {b}x{s} | {tune['tokens_per_second']:.0f} | {ref['tokens_per_second']:.0f} ({label}) "
                    f"| {tune['tokens_per_second'] / ref['tokens_per_second']:.2f}x | {split(tune)} | {split(ref)} "
                    f"| {gb(tune['peak_memory_bytes'])} | {gb(ref['peak_memory_bytes'])} "
                    f"| {tune['peak_memory_bytes'] / ref['peak_memory_bytes']:.2f}x |"
                )

if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "target/bench-compare.jsonl")
