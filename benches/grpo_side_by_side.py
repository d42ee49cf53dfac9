#!/usr/bin/env python3
"""GRPO side by side: tune's `grpo_lora_finetune_single_device` and TRL's `GRPOTrainer`, the
same model, prompts, reward, group size, lengths, LoRA rank and steps, on the CPU, one after the
other on the same machine (BENCHMARKS.md, "GRPO against TRL").

The model is SmolLM2-135M's shape (30 layers, hidden 576, GQA 9/3) with random weights and the
tiny shipped tokenizer's 2048-token vocabulary (no download: the real checkpoint is not
available offline), written once with transformers. The prompts are the first 64 instructions
of assets/data/alpaca_tiny.json as a user turn of the tokenizer's chat template; the reward is
the number of letters "e" in the completion, a task a random model can learn (TRL: a Python
function; tune: the same count in a Python program it starts once and streams completions to,
as `tune.rewards.command` runs any reward). Both sides:
2 prompts x 8 completions a step, up to 32 tokens at temperature 1, LoRA rank 8 (alpha 16) on
q_proj and v_proj, AdamW at a constant 5e-3, clipping at 1.0, no KL term, the per-completion
mean then the batch mean of the clipped surrogate (tune's GRPOSimpleLoss, TRL's
`loss_type="grpo"`), group-normalised advantages.

Usage (a venv with torch, transformers, trl and peft; tune built):

    python benches/grpo_side_by_side.py --tune target/release/tune --out /tmp/grpo-bench [--steps 20]

With `--checkpoint DIR` both sides train that checkpoint instead (with its own tokenizer and
chat template), e.g. the real SmolLM2-135M-Instruct that benches/smollm2_from_gguf.py writes.

Prints a markdown table: seconds per step, rollout tokens per second, peak RSS, and the mean
reward of the first and last quarter of the steps, and both reward curves.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
TINY = os.path.join(ROOT, "assets", "tiny-llama")
LR = 5e-3
GROUP = 8
PROMPTS_PER_STEP = 2
MAX_TOKENS = 32


def write_model(out):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if os.path.exists(os.path.join(out, "model.safetensors")):
        return
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=2048,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
        bos_token_id=2000,
        eos_token_id=2004,
        pad_token_id=2005,
        torch_dtype="float32",
    )
    LlamaForCausalLM(config).save_pretrained(out, safe_serialization=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        shutil.copy(os.path.join(TINY, f), out)


def prompts():
    rows = json.load(open(os.path.join(ROOT, "assets", "data", "alpaca_tiny.json")))
    return [r["instruction"] for r in rows[:64]]


def peak_rss_mb(time_stderr):
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", time_stderr)
    return int(m.group(1)) / 1024 if m else float("nan")


def run_tune(args, model):
    work = os.path.join(args.out, "tune")
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    with open(os.path.join(work, "prompts.jsonl"), "w") as f:
        for p in prompts():
            f.write(json.dumps({"prompt": p}) + "\n")
    # TRL's reward below, as a program tune starts once and streams completions to.
    reward = os.path.join(work, "reward.py")
    with open(reward, "w") as f:
        f.write(
            "import json, sys\n"
            "for line in sys.stdin:\n"
            "    print(json.loads(line)['completion'].count('e'), flush=True)\n"
        )
    overrides = [
        f"output_dir={work}/out",
        "model._component_=tune.models.llama3.lora_llama3_tiny",
        "model.lora_attn_modules=[q_proj,v_proj]",
        "model.apply_lora_to_mlp=False",
        "model.lora_rank=8",
        "model.lora_alpha=16",
        f"tokenizer.path={model}/tokenizer.json",
        "tokenizer.max_seq_len=512",
        f"checkpointer.checkpoint_dir={model}",
        f"dataset.data_files={work}/prompts.jsonl",
        "reward_functions=[{_component_: tune.rewards.command, name: letter_e, "
        f"command: [{sys.executable}, {reward}], weight: 1.0}}]",
        "~dataset.column_map",
        f"batch_size={PROMPTS_PER_STEP}",
        f"forward_batch_size={PROMPTS_PER_STEP}",
        f"grpo_samples={GROUP}",
        f"max_generated_tokens={MAX_TOKENS}",
        f"optimizer.lr={LR}",
        "lr_scheduler._component_=torchtune.training.lr_schedulers.get_constant_schedule_with_warmup",
        "lr_scheduler.num_warmup_steps=0",
        f"num_steps={args.steps}",
        f"seed={args.seed}",
        "save_adapter_weights_only=True",
    ]
    cmd = ["/usr/bin/time", "-v", args.tune, "run", "grpo_lora_finetune_single_device",
           "--config", "tiny/grpo_lora_single_device", *overrides]
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - started
    if done.returncode != 0:
        sys.exit(f"tune failed:\n{done.stderr[-4000:]}")
    lines = [json.loads(l) for l in open(os.path.join(work, "out", "logs", "metrics.jsonl"))]
    rewards = [l["rewards"] for l in lines]
    # tokens_per_second counts trained completion tokens over each step's whole time: a step's
    # seconds are its tokens over that rate.
    step_seconds = [l["response_lengths"] * GROUP * PROMPTS_PER_STEP / l["tokens_per_second"] for l in lines]
    rollout = [l["rollout_tokens_per_second"] for l in lines]
    return {
        "rewards": rewards,
        "step_seconds": step_seconds,
        "rollout_tokens_per_second": rollout,
        "peak_rss_mb": peak_rss_mb(done.stderr),
        "wall": wall,
    }


def trl_main(args):
    """Runs inside `/usr/bin/time -v`: TRL's GRPOTrainer, writing its figures to a JSON file."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model_dir = args.model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts()])

    def letters_e(completions, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [float(t.count("e")) for t in texts]

    config = GRPOConfig(
        output_dir=os.path.join(args.out, "trl"),
        per_device_train_batch_size=GROUP * PROMPTS_PER_STEP,
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=1.0,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_grad_norm=1.0,
        max_steps=args.steps,
        beta=0.0,
        loss_type="grpo",
        scale_rewards="group",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        shuffle_dataset=True,
    )
    peft_config = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"
    )

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.starts, self.seconds = {}, []

        def on_step_begin(self, a, state, control, **kw):
            self.start = time.time()

        def on_step_end(self, a, state, control, **kw):
            self.seconds.append(time.time() - self.start)

    timer = StepTimer()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=letters_e,
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[timer],
    )
    # Rollout time: the policy's `generate` calls, timed, with the tokens they produced.
    generation = {"seconds": 0.0, "tokens": 0}
    unwrapped = trainer.accelerator.unwrap_model(trainer.model)
    inner = unwrapped.generate

    def timed_generate(*a, **kw):
        t = time.time()
        out = inner(*a, **kw)
        generation["seconds"] += time.time() - t
        prompt_len = (kw.get("input_ids") if "input_ids" in kw else a[0]).shape[1]
        generation["tokens"] += int((out[:, prompt_len:] != tokenizer.pad_token_id).sum())
        return out

    unwrapped.generate = timed_generate
    trainer.train()
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    json.dump(
        {
            "rewards": rewards,
            "step_seconds": timer.seconds,
            "rollout_tokens_per_second": [generation["tokens"] / max(generation["seconds"], 1e-9)],
        },
        open(os.path.join(args.out, "trl.json"), "w"),
    )


def run_trl(args, model):
    cmd = ["/usr/bin/time", "-v", sys.executable, os.path.abspath(__file__), "--trl-child",
           "--model", model, "--out", args.out, "--steps", str(args.steps), "--seed", str(args.seed)]
    started = time.time()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    wall = time.time() - started
    if done.returncode != 0:
        sys.exit(f"TRL failed:\n{done.stderr[-6000:]}")
    figures = json.load(open(os.path.join(args.out, "trl.json")))
    figures["peak_rss_mb"] = peak_rss_mb(done.stderr)
    figures["wall"] = wall
    return figures


def quarter_means(rewards):
    q = max(len(rewards) // 4, 1)
    return sum(rewards[:q]) / q, sum(rewards[-q:]) / q


def median(v):
    v = sorted(v)
    return v[len(v) // 2]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tune", default=os.path.join(ROOT, "target", "release", "tune"))
    p.add_argument("--out", default="/tmp/grpo-bench")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seed", type=int, default=42, help="both sides' seed (sampling, shuffling)")
    p.add_argument("--model")
    p.add_argument(
        "--checkpoint",
        help="an HF checkpoint folder to train instead of the random SmolLM2-135M-shaped model "
        "(benches/smollm2_from_gguf.py writes the real SmolLM2-135M-Instruct)",
    )
    p.add_argument("--trl-child", action="store_true")
    p.add_argument("--reuse-tune", action="store_true", help="take tune's figures from OUT/tune.json")
    args = p.parse_args()
    if args.trl_child:
        return trl_main(args)
    os.makedirs(args.out, exist_ok=True)
    if args.checkpoint:
        model = os.path.abspath(args.checkpoint)
    else:
        model = os.path.join(args.out, "model")
        write_model(model)
    tune_json = os.path.join(args.out, "tune.json")
    if args.reuse_tune:
        tune = json.load(open(tune_json))
    else:
        tune = run_tune(args, model)
        json.dump(tune, open(tune_json, "w"))
    results = {"tune": tune, "TRL": run_trl(args, model)}
    print(f"| | s/step (median, steps 2-{args.steps}) | rollout tokens/s | peak RSS (MB) | mean reward, first / last {max(args.steps // 4, 1)} steps | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        first, last = quarter_means(r["rewards"])
        print(
            f"| {name} | {median(r['step_seconds'][1:]):.2f} | {median(r['rollout_tokens_per_second']):.0f} | "
            f"{r['peak_rss_mb']:.0f} | {first:.2f} / {last:.2f} | {r['wall']:.0f} |"
        )
    for name, r in results.items():
        print(f"{name} rewards: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    json.dump(results, open(os.path.join(args.out, "results.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
