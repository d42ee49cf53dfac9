"""Token lengths of real alpaca rows, for `tune bench --row-lengths` and
`benches/pytorch_reference.py --row-lengths`: batches padded as torchtune pads them.

Rows: assets/data/alpaca_tiny.json, the first 100 rows of tatsu-lab/alpaca. Each row is the
alpaca prompt (torchtune's AlpacaToMessages template, with or without input) followed by the
response, tokenized with the Llama 3 tokenizer in tests/fixtures (SmolLM2's is not shipped;
its vocabulary is 49152 tokens, so its rows run a little longer), plus BOS and EOS. The order is
shuffled with seed 0, as a sampler shuffles an epoch.

    benches/.venv/bin/python benches/alpaca_lengths.py > benches/alpaca_lengths.json
"""

import json
import random
import sys
from pathlib import Path

from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further "
    "context. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
NO_INPUT = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n"
)


def main():
    rows = json.loads((ROOT / "assets/data/alpaca_tiny.json").read_text())
    tok = Tokenizer.from_file(str(ROOT / "tests/fixtures/torchtune_tokens/llama3/tokenizer.json"))
    lengths = []
    for r in rows:
        template = WITH_INPUT if r["input"] else NO_INPUT
        prompt = template.format(instruction=r["instruction"], input=r["input"])
        text = prompt + r["output"]
        lengths.append(len(tok.encode(text, add_special_tokens=False).ids) + 2)
    random.Random(0).shuffle(lengths)
    json.dump({"source": "assets/data/alpaca_tiny.json, Llama 3 tokenizer, shuffled (seed 0)",
               "lengths": lengths}, sys.stdout)
    print()


if __name__ == "__main__":
    main()
