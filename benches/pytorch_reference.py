"""The PyTorch side of `benches/compare.sh`: the same shapes, modes and settings as `tune bench`,
in plain PyTorch (eager, fp32 on CPU, bf16 on CUDA when asked), printing one JSON object per run.

What it mirrors from `tune bench` (src/bench/mod.rs):
- the model: a Llama decoder built from `benches/shapes.json` (GQA, RoPE with the config's theta
  and llama3 scaling, RMSNorm, SwiGLU, tied embeddings), random weights;
- save the weights as safetensors, load them back (timed), then train;
- LoRA: rank r, alpha 2r, dropout 0 on q/v/o/gate/up/down, base weights frozen (requires_grad
  False), AdamW (weight decay 0.01) over the adapters only; full: AdamW over every weight;
- two warm-up steps, then `--steps` timed steps on random tokens (labels = tokens, shifted),
  full rows, or with `--row-lengths` real lengths padded as torchtune pads them,
  forward / backward / optimizer timed separately (CUDA synchronised before each reading);
- peak resident memory of the training phase (VmHWM reset after loading), and on CUDA the
  peak allocated memory.

`--impl torchtune` builds the model with torchtune's `llama3` / `lora_llama3` builders instead
of the plain module here, when torchtune imports.
"""

import argparse
import json
import math
import os
import resource
import sys
import tempfile
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))


def rope_inv_freq(cfg, head_dim):
    theta = cfg["rope_theta"]
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    scaling = cfg.get("rope_scaling")
    if scaling and scaling.get("rope_type") == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        low_wl, high_wl = old / low, old / high
        wl = 2 * math.pi / inv
        scaled = torch.where(wl > low_wl, inv / factor, inv)
        smooth = (old / wl - low) / (high - low)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wl >= high_wl) & (wl <= low_wl)
        inv = torch.where(is_mid, mid, scaled)
    return inv


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LoraLinear(nn.Module):
    """A frozen-or-trainable linear with an optional LoRA adapter as two small matmuls."""

    def __init__(self, fan_in, fan_out, rank=0, alpha=0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in).normal_(0, 0.02))
        self.rank = rank
        if rank:
            self.lora_a = nn.Parameter(torch.empty(rank, fan_in).uniform_(-1 / fan_in**0.5, 1 / fan_in**0.5))
            self.lora_b = nn.Parameter(torch.zeros(fan_out, rank))
            self.scaling = alpha / rank

    def forward(self, x):
        y = F.linear(x, self.weight)
        if self.rank:
            y = y + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling
        return y


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(var + self.eps))


class Layer(nn.Module):
    def __init__(self, cfg, lora_targets, rank, alpha):
        super().__init__()
        h, nh, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
        d = cfg.get("head_dim", h // nh)
        self.nh, self.kvh, self.d = nh, kvh, d

        def lin(name, i, o):
            r = rank if name in lora_targets else 0
            return LoraLinear(i, o, r, alpha)

        self.q_proj = lin("q_proj", h, nh * d)
        self.k_proj = lin("k_proj", h, kvh * d)
        self.v_proj = lin("v_proj", h, kvh * d)
        self.o_proj = lin("o_proj", nh * d, h)
        m = cfg["intermediate_size"]
        self.gate_proj = lin("gate_proj", h, m)
        self.up_proj = lin("up_proj", h, m)
        self.down_proj = lin("down_proj", m, h)
        self.input_layernorm = RMSNorm(h, cfg["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(h, cfg["rms_norm_eps"])

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        y = self.input_layernorm(x)
        q = self.q_proj(y).view(b, s, self.nh, self.d).transpose(1, 2)
        k = self.k_proj(y).view(b, s, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(y).view(b, s, self.kvh, self.d).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, s, -1))
        y = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))


class Decoder(nn.Module):
    def __init__(self, cfg, lora_targets=(), rank=0, alpha=0.0):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
        nn.init.normal_(self.embed_tokens.weight, 0, 0.02)
        self.layers = nn.ModuleList(Layer(cfg, lora_targets, rank, alpha) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        d = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        self.register_buffer("inv_freq", rope_inv_freq(cfg, d), persistent=False)

    def forward(self, tokens):
        s = tokens.shape[1]
        t = torch.arange(s, device=tokens.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        dtype = self.embed_tokens.weight.dtype
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        # Tied embeddings: the output projection is the embedding matrix.
        return F.linear(self.norm(x), self.embed_tokens.weight)


def torchtune_model(cfg, lora_targets, rank, alpha, use_dora=False, quantize_base=False):
    from torchtune.models.llama3 import llama3, lora_llama3

    kw = dict(
        vocab_size=cfg["vocab_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"],
        embed_dim=cfg["hidden_size"],
        max_seq_len=4096,
        intermediate_dim=cfg["intermediate_size"],
        norm_eps=cfg["rms_norm_eps"],
        rope_base=cfg["rope_theta"],
    )
    if not rank:
        model = llama3(**kw)
    else:
        attn = [m for m in ("q_proj", "k_proj", "v_proj", "output_proj") if m.replace("output_proj", "o_proj") in lora_targets]
        model = lora_llama3(
            lora_attn_modules=attn,
            apply_lora_to_mlp=True,
            apply_lora_to_output=False,
            lora_rank=rank,
            lora_alpha=alpha,
            lora_dropout=0.0,
            use_dora=use_dora,
            quantize_base=quantize_base,
            **kw,
        )
    # Tie the output projection to the embedding, as the shapes' configs do.
    if hasattr(model, "output") and hasattr(model.output, "weight"):
        model.output.weight = model.tok_embeddings.weight
    return model


def peak_rss_bytes():
    # VmHWM, which clear_refs resets (ru_maxrss does not).
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="tiny")
    # dora: torchtune's DoRALinear; qlora/qdora: LoRA/DoRA on torchao NF4 base weights
    # (`quantize_base=True`, torchtune's qlora_* builders). These need --impl torchtune.
    p.add_argument(
        "--mode", choices=["lora", "dora", "qlora", "qdora", "full", "forward"], default="lora"
    )
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--impl", choices=["plain", "torchtune"], default="plain")
    # As `tune bench --dtype`: weights, activations and optimizer state in this dtype.
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    # As `tune bench --row-lengths`: rows of these lengths (cut to --seq-len), --batch-size at a
    # time, right-padded to each batch's longest with labels -100 as torchtune's collate pads
    # them and computed padded, as torchtune does; tokens/s counts labelled tokens
    # (torchtune's num_tokens).
    p.add_argument("--row-lengths")
    a = p.parse_args()
    lengths = json.load(open(a.row_lengths))["lengths"] if a.row_lengths else None

    cfg = json.load(open(os.path.join(HERE, "shapes.json")))[a.shape]
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    torch.manual_seed(0)
    lora = a.mode in ("lora", "dora", "qlora", "qdora")
    nf4 = a.mode in ("qlora", "qdora")
    if a.mode in ("dora", "qlora", "qdora") and a.impl != "torchtune":
        p.error(f"--mode {a.mode} runs torchtune's modules: add --impl torchtune")
    targets = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj") if lora else ()
    rank, alpha = (a.lora_rank, 2.0 * a.lora_rank) if lora else (0, 0.0)

    def build():
        if a.impl == "torchtune":
            # NF4 bases are built in the run's dtype, as torchtune's recipes build them
            # (`training.set_default_dtype`); `.to(dtype)` would not apply to NF4 tensors.
            previous = torch.get_default_dtype()
            torch.set_default_dtype(dtype if nf4 else previous)
            try:
                return torchtune_model(
                    cfg, targets, rank, alpha,
                    use_dora=a.mode in ("dora", "qdora"), quantize_base=nf4,
                )
            finally:
                torch.set_default_dtype(previous)
        return Decoder(cfg, targets, rank, alpha)

    # Save and load a checkpoint of this shape (load timed, as tune bench does).
    from safetensors.torch import load_file, save_file

    model = build()
    params = sum(
        p.numel() for n, p in model.named_parameters() if "lora" not in n and "magnitude" not in n
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "model.safetensors")
        state = {
            k: v.contiguous()
            for k, v in model.state_dict().items()
            if "lora" not in k and "magnitude" not in k
        }
        # Tied weights share storage; safetensors refuses shared tensors, so store one copy.
        seen, unique = set(), {}
        for k, v in state.items():
            if v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                unique[k] = v
        save_file(unique, path)
        del model, state, unique
        t = time.perf_counter()
        loaded = load_file(path)
        model = build()
        model.load_state_dict(loaded, strict=False)
        # torchtune's recipes set DoRA's magnitudes from the loaded weights' norms.
        for m in model.modules():
            if hasattr(m, "initialize_dora_magnitude"):
                m.initialize_dora_magnitude()
        load_s = time.perf_counter() - t
        del loaded
    model = model.to(device=dev) if nf4 else model.to(device=dev, dtype=dtype)

    for n, prm in model.named_parameters():
        prm.requires_grad = (a.mode == "full") or (lora and ("lora" in n or "magnitude" in n))
    trainable = [prm for prm in model.parameters() if prm.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-5, weight_decay=0.01) if trainable else None
    if a.mode == "forward":
        model.eval()

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    # Peak memory of the training phase only, as tune bench reports it (Linux resets VmHWM
    # when 5 is written to clear_refs); the checkpoint load above is measured by its time.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    g = torch.Generator().manual_seed(0)
    fwd = bwd = step = 0.0
    warmup = 2  # as `tune bench`: the steady state, not the allocators' first steps
    timed_tokens = 0
    next_row = 0
    for i in range(a.steps + warmup):
        if lengths is None:
            rows = [a.seq_len] * a.batch_size
        else:
            rows = [min(lengths[(next_row + r) % len(lengths)], a.seq_len) for r in range(a.batch_size)]
            next_row += a.batch_size
        longest = max(rows)
        tokens = torch.randint(0, cfg["vocab_size"], (a.batch_size, longest), generator=g)
        labels = tokens.clone()
        for r, n in enumerate(rows):
            tokens[r, n:] = 0
            labels[r, n:] = -100
        tokens, labels = tokens.to(dev), labels.to(dev)
        if i >= warmup:
            timed_tokens += sum(rows)
        sync()
        t0 = time.perf_counter()
        with torch.set_grad_enabled(a.mode != "forward"):
            logits = model(tokens)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                labels[:, 1:].reshape(-1),
                ignore_index=-100,
            )
        sync()
        t1 = time.perf_counter()
        if a.mode != "forward":
            loss.backward()
            sync()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            sync()
            t3 = time.perf_counter()
            if i >= warmup:
                bwd += t2 - t1
                step += t3 - t2
        if i >= warmup:
            fwd += t1 - t0
        del logits, loss
    n = a.steps
    total = (fwd + bwd + step) / n
    out = {
        "impl": "pytorch-" + a.impl,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "shape": a.shape,
        "mode": a.mode,
        "dtype": a.dtype,
        "batch_size": a.batch_size,
        "seq_len": a.seq_len,
        "params": params,
        "row_lengths": lengths is not None,
        "padding": "kept",
        "tokens_per_second": timed_tokens / (fwd + bwd + step),
        "step_seconds": total,
        "forward_seconds": fwd / n,
        "backward_seconds": bwd / n,
        "optimizer_seconds": step / n,
        "peak_memory_bytes": peak_rss_bytes(),
        "load_seconds": load_s,
    }
    if dev.type == "cuda":
        out["peak_device_memory_bytes"] = torch.cuda.max_memory_allocated()
    if nf4:
        from torchao.dtypes.nf4tensor import NF4Tensor

        stored = [p for p in model.parameters() if isinstance(p, NF4Tensor)]
        nbytes = sum(
            t.numel() * t.element_size()
            for p in stored
            for t in (p.quantized_data, p.quantized_scalers, p.quantization_factor, p.scaler_mean)
        )
        out["nf4_bytes_per_param"] = nbytes / max(1, sum(p.numel() for p in stored))
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
