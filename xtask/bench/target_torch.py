#!/usr/bin/env python3
"""transformers side of `xtask bench target` (run on the GPU machine; nothing is downloaded).

usage: python3 target_torch.py INPUT.json

INPUT.json (written by xtask):
    {"mode": "make", "model_dir": DIR, "config": {...Qwen3Config fields...}, "seed": int}
        Writes a random Qwen3ForCausalLM in HF format (bf16 safetensors shards, config.json) to DIR,
        unless DIR/config.json exists. Weights: transformers' own init (normal(0, 0.02) linears,
        ones for norms), made on the GPU in bf16.
    {"mode": "time", "model_dir": DIR, "seqs": [S, ...], "warmup": int, "iters": int, "seed": int}
        Loads DIR (bf16, sdpa attention) and times model(input_ids, output_hidden_states=True,
        use_cache=False) under torch.no_grad() for one row of S random tokens: the median of
        `iters` CUDA-event timings after `warmup` calls. Peak = torch.cuda.max_memory_allocated
        over the timed calls (weights included).

Prints one JSON object on stdout: {"torch": ver, "transformers": ver, "results": [...]}; logs go
to stderr.
"""
import json
import os
import sys

import torch
import transformers


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def make(spec, config_class=transformers.Qwen3Config, model_class=transformers.Qwen3ForCausalLM):
    """A random `model_class` of `config_class(**spec["config"])` saved to spec["model_dir"] (bf16,
    made on the GPU), unless a config.json is there. target_hybrid_torch.py makes its Qwen3.5 with
    this too."""
    out = spec["model_dir"]
    if os.path.isfile(os.path.join(out, "config.json")):
        log(f"{out}: exists, kept")
        return {"made": False}
    torch.manual_seed(spec["seed"])
    config = config_class(**spec["config"])
    with torch.device("cuda"):
        model = model_class(config).to(torch.bfloat16)
    log(f"made a random {model_class.__name__} of {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters; saving")
    model.save_pretrained(out, max_shard_size="4GB")
    return {"made": True}


def load_model(model_dir, device="cuda", attn_implementation="sdpa"):
    """The checkpoint in `model_dir` in bf16 on `device`, in eval mode and frozen (no parameter
    requires grad). train_torch.py loads its target with this too."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation=attn_implementation
    ).to(device).eval()
    model.requires_grad_(False)
    return model


def forward_hidden_states(model, ids):
    """transformers' forward of `ids` [1, S] under torch.no_grad(), with every hidden state."""
    with torch.no_grad():
        return model(input_ids=ids, output_hidden_states=True, use_cache=False)


def median_ms(call, warmup, iters, after_warmup=None):
    """The median of `iters` CUDA-event timings of `call()` after `warmup` untimed calls (and
    `after_warmup()`, e.g. a peak-memory reset), and the last call's output; one output is alive at
    a time. eval_torch.py times generate with this too."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    if after_warmup is not None:
        after_warmup()
    times, out = [], None
    for _ in range(iters):
        out = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = call()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2], out


def time_forward(spec):
    model = load_model(spec["model_dir"])
    vocab = model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(spec["seed"])
    results = []
    for seq in spec["seqs"]:
        ids = torch.randint(0, vocab, (1, seq), device="cuda", generator=gen)

        def call():
            return forward_hidden_states(model, ids)

        ms, out = median_ms(call, spec["warmup"], spec["iters"], torch.cuda.reset_peak_memory_stats)
        del out
        peak = torch.cuda.max_memory_allocated()
        log(f"transformers S={seq}: {ms:.2f} ms, peak {peak / 1e9:.2f} GB")
        results.append({"seq": seq, "ms": ms, "peak_bytes": peak})
    return {"results": results}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    out.update(make(spec) if spec["mode"] == "make" else time_forward(spec))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
