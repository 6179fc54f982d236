#!/usr/bin/env python3
"""transformers side of `xtask bench eval` (run on the GPU machine; nothing is downloaded).

usage: python3 eval_torch.py INPUT.json

INPUT.json (written by xtask):
    {"model_dir": DIR, "prompt": [token ids], "max_new_tokens": N, "warmup": int, "iters": int}
        Loads DIR (bf16, sdpa attention; target_torch.load_model) and times batch-1 greedy
        decoding with model.generate(do_sample=False, exactly N new tokens, no stopping on EOS):
        the median of `iters` CUDA-event timings after `warmup` calls, prefill included.

Prints one JSON object on stdout: {"torch", "transformers", "ms", "new_tokens", "tokens"}; logs go
to stderr.
"""
import json
import sys

import torch
import transformers

from target_torch import load_model, log, median_ms


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    model = load_model(spec["model_dir"])
    ids = torch.tensor([spec["prompt"]], device="cuda")
    n = spec["max_new_tokens"]

    def call():
        with torch.no_grad():
            return model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                eos_token_id=None,
                pad_token_id=0,
            )

    ms, out = median_ms(call, spec["warmup"], spec["iters"])
    tokens = out[0, ids.shape[1]:].tolist()
    log(f"transformers generate: {len(tokens)} tokens in {ms:.1f} ms = {len(tokens) / ms * 1e3:.1f} tokens/s")
    print(json.dumps({
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "ms": ms,
        "new_tokens": len(tokens),
        "tokens": tokens,
    }))


if __name__ == "__main__":
    main()
