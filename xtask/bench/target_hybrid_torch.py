#!/usr/bin/env python3
"""transformers side of `xtask bench hybrid` (run on the GPU machine; nothing is downloaded).

usage: python3 target_hybrid_torch.py INPUT.json

INPUT.json (written by xtask):
    {"mode": "make", "model_dir": DIR, "config": {...Qwen3_5TextConfig fields...}, "seed": int}
        Writes a random Qwen3_5ForCausalLM in HF format (bf16 safetensors shards, config.json) to
        DIR, unless DIR/config.json exists. Weights: transformers' own init, made on the GPU in bf16.
    {"mode": "time", "model_dir": DIR, "seq": S, "warmup": int, "iters": int, "seed": int,
     "layer_ids": [...], "features_out": FILE, "lm_head": bool}
        Loads DIR (bf16, sdpa attention) and times the decoder stack
        model.model(input_ids, output_hidden_states=True, use_cache=False) under torch.no_grad() (no
        LM head; with "lm_head" the whole model(...), logits included) for one row of S random tokens: the median of `iters` CUDA-event timings after
        `warmup` calls; peak = torch.cuda.max_memory_allocated over the timed calls (weights
        included). Then one more call with forward hooks on the decoder layers `layer_ids` writes
        their outputs (the drafter's features, [S, F*H] float32, little-endian, in layer_ids order)
        to FILE, with the tokens beside it (FILE.tokens, u32), for xtask to compare with its own.
    {"mode": "documents", "cases": [{"model_dir": DIR, "documents": [[token, ...], ...],
                                     "layer_ids": [...], "features_out": FILE}, ...]}
        For each case, loads DIR (bf16, sdpa) and runs each document alone through the decoder
        stack: the outputs of the layers `layer_ids` (forward hooks), [sum of T, F*H] float32 in
        document order, to FILE, for xtask to compare with the reference in f32 (the error bf16
        storage costs).
    In both, which GatedDeltaNet kernels transformers runs follows from the environment: the
    flash-linear-attention package (`fla`) when it is importable, else the PyTorch fallback;
    the answer says which ("gdn_kernels").

Prints one JSON object on stdout: {"torch": ver, "transformers": ver, ...}; logs go to stderr.
"""
import importlib.util
import json
import sys

import torch
import transformers

import target_torch
from target_torch import log, median_ms


def make(spec):
    return target_torch.make(spec, transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM)


def gdn_kernels():
    """What transformers' GatedDeltaNet layers run here: fla's Triton kernels or the torch path."""
    if importlib.util.find_spec("fla") is None:
        return "torch (flash-linear-attention not installed; causal-conv1d not installed)"
    import fla

    conv = "causal-conv1d" if importlib.util.find_spec("causal_conv1d") else "torch conv1d"
    return f"fla {getattr(fla, '__version__', '?')} + {conv}"


def time_forward(spec):
    model = target_torch.load_model(spec["model_dir"])
    kernels = gdn_kernels()
    log(f"GatedDeltaNet kernels: {kernels}")
    seq, vocab = spec["seq"], model.config.vocab_size
    gen = torch.Generator(device="cuda").manual_seed(spec["seed"])
    ids = torch.randint(0, vocab, (1, seq), device="cuda", generator=gen)

    run = model if spec.get("lm_head") else model.model

    def call():
        with torch.no_grad():
            return run(input_ids=ids, output_hidden_states=True, use_cache=False)

    ms, out = median_ms(call, spec["warmup"], spec["iters"], torch.cuda.reset_peak_memory_stats)
    del out
    peak = torch.cuda.max_memory_allocated()
    log(f"transformers ({kernels}) S={seq}: {ms:.2f} ms, peak {peak / 1e9:.2f} GB")
    result = {"seq": seq, "ms": ms, "peak_bytes": peak, "gdn_kernels": kernels}
    if spec.get("features_out"):
        write_f32(spec["features_out"], tapped_features(model, ids, spec["layer_ids"]))
        with open(spec["features_out"] + ".tokens", "wb") as f:
            f.write(ids[0].to(torch.int32).cpu().numpy().tobytes())
    return result


def tapped_features(model, ids, layer_ids):
    """The outputs of decoder layers `layer_ids` for `ids` [1, T] (forward hooks, no LM head),
    concatenated per token: [T, F*H] float32."""
    captured = {}
    hooks = [
        model.model.layers[l].register_forward_hook(
            lambda _m, _i, o, l=l: captured.__setitem__(l, (o[0] if isinstance(o, tuple) else o).detach())
        )
        for l in layer_ids
    ]
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return torch.cat([captured[l][0].float() for l in layer_ids], dim=-1)


def write_f32(path, tensor):
    with open(path, "wb") as f:
        f.write(tensor.contiguous().cpu().numpy().tobytes())


def document_features(spec):
    kernels = gdn_kernels()
    for case in spec["cases"]:
        model = target_torch.load_model(case["model_dir"])
        features = [
            tapped_features(model, torch.tensor([doc], device="cuda"), case["layer_ids"]) for doc in case["documents"]
        ]
        write_f32(case["features_out"], torch.cat(features))
        log(f"transformers ({kernels}): features of {len(features)} documents of {case['model_dir']}")
    return {"gdn_kernels": kernels}


MODES = {"make": make, "time": time_forward, "documents": document_features}


def main():
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    out.update(MODES[spec["mode"]](spec))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
