#!/usr/bin/env python3
"""A mixture-of-experts model in tune and in transformers + peft, on this machine, one after the other:
a LoRA training step and greedy decoding, on the shapes `qwen3-30b-a3b-2l` (Qwen3-30B-A3B's layer:
128 experts, 8 per token, in 2 layers, vocabulary cut to 2048) and `qwen3-30b-a3b-2l-32e` (the same
with 32 experts: as many active parameters, a quarter of the experts) from benches/shapes.json, and
with `--shapes gpt-oss-20b-2l` gpt-oss-20b's layer (32 experts of 2880, 4 per token, sinks, sliding
and full attention) twice.

Training: `tune bench --mode lora` against `Qwen3MoeForCausalLM` with peft's LoRA (rank 8, alpha 16,
target_modules q/v/o/gate/up/down, which peft maps onto every routed expert on transformers 5; for
gpt-oss q/v/o and its fused experts through peft's `target_parameters` (gate_up_proj, down_proj), as
tune's bench and LoRA recipes adapt them; AdamW over the adapters), random tokens, 2 warm-up steps then --steps timed ones, in fp32. Decoding: the same
random weights saved by transformers, decoded greedily with the KV cache for --new-tokens tokens by
`tune run generate` and by `model.generate`, both after the same chat prompt; the rate counts the
tokens after the first.

Not run in CI. A venv with torch, transformers 5.24 and peft 0.21.2; from the repository root:

    cargo build --release
    <venv>/bin/python benches/moe_side_by_side.py [--tune target/release/tune] [--steps 3]

Prints one JSON line per measurement.
"""
import argparse
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

HERE = Path(__file__).resolve().parent
PROMPT = "Give three tips for staying healthy."


# model_type -> (config class, model class, peft target_modules, tune builder, peft target_parameters)
FAMILIES = {
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  ["q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                  "tune.models.qwen3_moe.qwen3_moe_30b_a3b", None),
    "gpt_oss": (GptOssConfig, GptOssForCausalLM, ["q_proj", "v_proj", "o_proj"], "tune.models.gpt_oss.gpt_oss_20b",
                ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def family(shape):
    return FAMILIES[json.load(open(HERE / "shapes.json"))[shape]["model_type"]]


def build(shape):
    cfg = dict(json.load(open(HERE / "shapes.json"))[shape])
    for k in ("model_type", "architectures", "torch_dtype"):
        cfg.pop(k)
    config_cls, model_cls = family(shape)[:2]
    config = config_cls(**cfg, bos_token_id=2000, eos_token_id=2004, pad_token_id=2005)
    return model_cls(config).float()


def transformers_lora_step(shape, batch, seq, steps):
    torch.manual_seed(0)
    model = build(shape)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=family(shape)[2],
                      target_parameters=family(shape)[4])
    model = get_peft_model(model, lora)
    adapted = sorted({n.split(".lora_")[0] for n, _ in model.named_parameters() if "lora_" in n})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5, weight_decay=0.01)
    g = torch.Generator().manual_seed(0)
    times = []
    for i in range(steps + 2):
        tokens = torch.randint(0, 2048, (batch, seq), generator=g)
        t = time.perf_counter()
        logits = model(input_ids=tokens).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i >= 2:
            times.append(time.perf_counter() - t)
    step = sum(times) / len(times)
    return {"impl": "transformers+peft", "shape": shape, "what": "lora step", "batch": batch, "seq": seq,
            "step_s": round(step, 3), "tokens_per_s": round(batch * seq / step, 1),
            "adapted_modules": len(adapted), "experts_adapted": any("experts" in n for n in adapted),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad)}


def tune_lora_step(tune, shape, batch, seq, steps):
    out = subprocess.run([tune, "bench", "--shape", shape, "--mode", "lora", "--batch-size", str(batch),
                          "--seq-len", str(seq), "--steps", str(steps), "--json"],
                         check=True, capture_output=True, text=True).stdout
    r = json.loads(out.strip().splitlines()[-1])
    step = r.get("step_seconds") or r.get("step_s")
    return {"impl": "tune", "shape": shape, "what": "lora step", "batch": batch, "seq": seq,
            "step_s": step, "tokens_per_s": r.get("tokens_per_second") or r.get("tokens_per_s"), "report": r}


def decode(tune, shape, new_tokens):
    torch.manual_seed(0)
    model = build(shape).eval()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        for f in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
            shutil.copy(HERE.parent / "assets/tiny-llama" / f, Path(d) / f)
        log = subprocess.run(
            [tune, "run", "generate", "--config", "tiny/generation", f"checkpointer.checkpoint_dir={d}",
             "checkpointer.checkpoint_files=[model.safetensors]",
             f"model={{_component_: {family(shape)[3]}}}", f"max_new_tokens={new_tokens}",
             "temperature=0", f"prompt.user={PROMPT}", "stop_at_eos=False"],
            check=True, capture_output=True, text=True).stderr
        m = re.search(r"Prefill: (\d+) tokens.*?([0-9.]+) tokens/s after the first", log)
        prompt_len, tune_rate = int(m.group(1)), float(m.group(2))
    ids = torch.randint(0, 2000, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    kw = dict(do_sample=False, use_cache=True, eos_token_id=None, pad_token_id=2005,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, **kw)  # warm-up
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, **kw)
        first = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, **kw)
        total = time.perf_counter() - t
    hf_rate = (new_tokens - 1) / (total - first)
    return [
        {"impl": "tune", "shape": shape, "what": "decode", "prompt": prompt_len, "new_tokens": new_tokens,
         "tokens_per_s": tune_rate},
        {"impl": "transformers", "shape": shape, "what": "decode", "prompt": prompt_len, "new_tokens": new_tokens,
         "tokens_per_s": round(hf_rate, 2)},
    ]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tune", default="target/release/tune")
    p.add_argument("--shapes", default="qwen3-30b-a3b-2l,qwen3-30b-a3b-2l-32e")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--no-decode", action="store_true", help="the LoRA steps only")
    a = p.parse_args()
    torch.set_num_threads(os.cpu_count())
    for shape in a.shapes.split(","):
        if not a.no_decode:
            for row in decode(a.tune, shape, a.new_tokens):
                print(json.dumps(row), flush=True)
        print(json.dumps(tune_lora_step(a.tune, shape, a.batch_size, a.seq_len, a.steps)), flush=True)
        print(json.dumps(transformers_lora_step(shape, a.batch_size, a.seq_len, a.steps)), flush=True)


if __name__ == "__main__":
    main()
