"""Decoding speed of transformers on a Hugging Face model directory, for the generation rows of
BENCHMARKS.md side by side with `tune run generate` (which prints its own prefill and decode
rates). Not part of CI.

    python benches/generate_reference.py --model-dir /tmp/smol-random \
        --tokenizer assets/tiny-llama/tokenizer.json --max-new-tokens 64 [--dtype fp32|bf16] \
        [--temperature 0.6 --top-k 300]

The prompt is "Tell me a joke." encoded by the tokenizer (as `tune run generate` with `chat:
False`). Exactly `--max-new-tokens` tokens are generated (`min_new_tokens` equal, no EOS stop), with
the KV cache, greedily unless a temperature is given. The decode rate excludes the first token
(prefill), as tune reports it: (N - 1) / (time for N tokens - time for 1 token).
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    a = p.parse_args()

    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=dtype)
    model.eval()
    load_s = time.perf_counter() - t
    tok = PreTrainedTokenizerFast(tokenizer_file=a.tokenizer)
    ids = torch.tensor([tok.encode("Tell me a joke.")])
    sampling = dict(do_sample=False)
    if a.temperature > 0:
        sampling = dict(do_sample=True, temperature=a.temperature, top_k=a.top_k)

    def run(n):
        torch.manual_seed(1234)
        t = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                max_new_tokens=n,
                min_new_tokens=n,
                use_cache=True,
                pad_token_id=0,
                **sampling,
            )
        assert out.shape[1] == ids.shape[1] + n
        return time.perf_counter() - t

    run(2)  # warm-up
    first = run(1)
    total = run(a.max_new_tokens)
    print(
        json.dumps(
            {
                "impl": "transformers",
                "torch": torch.__version__,
                "threads": torch.get_num_threads(),
                "dtype": a.dtype,
                "prompt_tokens": ids.shape[1],
                "new_tokens": a.max_new_tokens,
                "load_seconds": load_s,
                "prefill_seconds": first,
                "decode_tokens_per_second": (a.max_new_tokens - 1) / (total - first),
                "end_to_end_tokens_per_second": a.max_new_tokens / total,
            }
        )
    )


if __name__ == "__main__":
    main()
