"""How far PyTorch's own bf16 run of tiny-llama drifts from the fp32 golden values.

There is no bf16 golden file in the fixtures, so tests/bf16 bounds tune's bf16 logits, loss and
gradients by twice the drift printed here. The model is the plain PyTorch decoder of
pytorch_reference.py, with transformers' bf16 conventions: RMSNorm normalises in fp32 and casts
back before the weight, attention is SDPA, the loss is computed on fp32 logits.

    benches/.venv/bin/python benches/bf16_drift.py     (the venv benches/compare.sh creates)
"""

import json
import os

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import pytorch_reference

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "tests", "fixtures")


class Fp32RmsNorm(pytorch_reference.RMSNorm):
    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps)).to(dtype)


def load_decoder():
    pytorch_reference.RMSNorm = Fp32RmsNorm
    cfg = json.load(open(os.path.join(FIXTURES, "tiny-llama", "config.json")))
    model = pytorch_reference.Decoder(cfg)
    weights = load_file(os.path.join(FIXTURES, "tiny-llama", "model.safetensors"))
    # HF names -> the plain decoder's (no `model.`, `self_attn.` or `mlp.` levels).
    state = {
        k.replace("model.", "", 1).replace("self_attn.", "").replace("mlp.", ""): v
        for k, v in weights.items()
    }
    model.load_state_dict(state, strict=True)
    return model


def run(model, dtype, ids, labels):
    model = model.to(dtype)
    logits = model(ids).float()
    vocab = logits.shape[-1]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, vocab), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach(), loss.item(), grads


def main():
    ref = load_file(os.path.join(FIXTURES, "reference", "tiny-llama.safetensors"))
    ids, labels, golden = ref["input_ids"], ref["labels"], ref["logits"]
    model = load_decoder()
    l32, loss32, g32 = run(model, torch.float32, ids, labels)
    print(f"fp32 vs golden: logits max {(l32 - golden).abs().max().item():.2e}, loss {loss32:.6f} vs {ref['loss'].item():.6f}")
    l16, loss16, g16 = run(model, torch.bfloat16, ids, labels)
    diff = (l16 - golden).abs()
    print(
        f"bf16 vs golden: logits max {diff.max().item():.4f}, mean {diff.mean().item():.4f} "
        f"(max |logit| {golden.abs().max().item():.1f}); loss {abs(loss16 - ref['loss'].item()):.4f}"
    )
    errors = [((g16[n] - g32[n]).norm() / g32[n].norm()).item() for n in g32]
    print(f"bf16 gradients: relative L2 error {min(errors):.4f} to {max(errors):.4f}")


if __name__ == "__main__":
    main()
