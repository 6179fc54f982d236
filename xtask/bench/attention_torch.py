#!/usr/bin/env python3
"""PyTorch baselines of `xtask bench attention` (run on the GPU machine by that command).

usage: python3 attention_torch.py CASES.json

CASES.json (written by xtask):
    {"warmup": int, "iters": int,
     "cases": [{"name": str, "s": S, "block": B, "anchors": [a_0, ...] (sorted),
                "window": W or null, "num_heads": Hq, "num_kv_heads": Hkv, "head_dim": D,
                "seed": int}]}

For each case, under the DFlash training mask (spec section 2; query q = j*B + o is row o of
block j, keys are the S context tokens then the N*B block tokens):
    full:    k < S and k < a_j,                    or k in block j
    sliding: k < S and a_j+o-(W-1) <= k < a_j,     or k = S + j*B + o' with o' <= o
it measures, on bf16 inputs q [1, Hq, N*B, D], k and v [1, Hkv, S+N*B, D] (requires_grad) and
an output gradient dO like q:
  - flex_attention under torch.compile with a BlockMask from create_block_mask: forward ms
    (autograd on, so the logsumexp is saved as in training) and forward+backward ms;
  - scaled_dot_product_attention with the dense boolean mask: forward+backward ms;
  - the extra memory of one forward+backward of each: torch.cuda.max_memory_allocated() after
    reset_peak_memory_stats() minus the memory allocated before it (inputs, dO and the masks),
    so O, dQ, dK, dV and every temporary count;
  - allowed_pairs, the number of (query, key) pairs the mask allows (xtask checks it against its
    attention plan, so that both sides compute the same thing).
Times: CUDA events around each iteration after the warm-up (which includes compilation), median.

Prints one JSON object on stdout and nothing else (all other output goes to stderr):
    {"torch": version, "gpu": name,
     "cases": [{"name", "allowed_pairs", "flex_fwd_ms", "flex_fwdbwd_ms", "flex_extra_bytes",
                "sdpa_fwdbwd_ms", "sdpa_extra_bytes", "errors": [str]}]}
A measurement that fails is null, with its error in "errors"; the exit status is 0 when the JSON
was written, 2 on bad input or no CUDA device.
"""

import json
import os
import statistics
import sys
import traceback


def fail(message):
    print(f"attention_torch.py: {message}", file=sys.stderr)
    sys.exit(2)


def raise_recompile_limits(torch):
    """Each case's mask_mod is a new closure: allow a recompilation per case and mode."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 256))


def time_ms(torch, fn, warmup, iters, setup):
    """Median ms of `fn` over `iters` runs after `warmup` runs; `setup` runs untimed before each."""
    for _ in range(warmup):
        setup()
        fn()
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        setup()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def extra_bytes(torch, fn, setup):
    """Peak memory of one `fn` minus the memory allocated before it, in bytes."""
    setup()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    setup()
    return peak - before


def dflash_mask_mod(torch, anchors, s, block, window):
    """The DFlash mask as a flex_attention mask_mod over the `anchors` tensor (int64, cuda)."""

    def full(b, h, q_idx, kv_idx):
        j = q_idx // block
        context = (kv_idx < s) & (kv_idx < anchors[j])
        own_block = (kv_idx >= s) & ((kv_idx - s) // block == j)
        return context | own_block

    def sliding(b, h, q_idx, kv_idx):
        j = q_idx // block
        o = q_idx % block
        a = anchors[j]
        context = (kv_idx < s) & (kv_idx < a) & (a + o - (window - 1) <= kv_idx)
        own_block = (kv_idx >= s) & ((kv_idx - s) // block == j) & ((kv_idx - s) % block <= o)
        return context | own_block

    return full if window is None else sliding


def run_case(torch, flex, create_block_mask, case, warmup, iters):
    import torch.nn.functional as F

    name = case["name"]
    s, block, window = int(case["s"]), int(case["block"]), case["window"]
    hq, hkv, d = int(case["num_heads"]), int(case["num_kv_heads"]), int(case["head_dim"])
    dev = torch.device("cuda")
    anchors = torch.tensor([int(a) for a in case["anchors"]], dtype=torch.int64, device=dev)
    n_q = anchors.numel() * block
    n_kv = s + n_q
    result = {
        "name": name,
        "allowed_pairs": None,
        "flex_fwd_ms": None,
        "flex_fwdbwd_ms": None,
        "flex_extra_bytes": None,
        "sdpa_fwdbwd_ms": None,
        "sdpa_extra_bytes": None,
        "errors": [],
    }
    print(f"[{name}] Q {n_q} x KV {n_kv}, heads {hq}/{hkv}, d {d}, window {window}", file=sys.stderr)
    mask_mod = dflash_mask_mod(torch, anchors, s, block, None if window is None else int(window))

    gen = torch.Generator(device=dev)
    gen.manual_seed(int(case["seed"]))

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=dev, dtype=torch.bfloat16)

    q = randn(1, hq, n_q, d).requires_grad_()
    k = randn(1, hkv, n_kv, d).requires_grad_()
    v = randn(1, hkv, n_kv, d).requires_grad_()
    dout = randn(1, hq, n_q, d)

    def clear_grads():
        q.grad = None
        k.grad = None
        v.grad = None

    def measure(label, what, fn, key):
        try:
            result[key] = fn()
            print(f"[{name}] {label} {what}: {result[key]}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - reported per measurement, the others go on
            traceback.print_exc(file=sys.stderr)
            result["errors"].append(f"{label} {what}: {type(e).__name__}: {e}")

    # Dense boolean mask [Q, KV] from the same predicate: the pair count and SDPA's mask.
    dense = None
    try:
        q_idx = torch.arange(n_q, device=dev)[:, None]
        kv_idx = torch.arange(n_kv, device=dev)[None, :]
        dense = mask_mod(None, None, q_idx, kv_idx)
        del q_idx, kv_idx
        result["allowed_pairs"] = int(dense.sum().item())
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        result["errors"].append(f"dense mask: {type(e).__name__}: {e}")

    try:
        block_mask = create_block_mask(mask_mod, None, None, n_q, n_kv, device=dev)
    except Exception as e:  # noqa: BLE001
        traceback.print_exc(file=sys.stderr)
        result["errors"].append(f"create_block_mask: {type(e).__name__}: {e}")
        block_mask = None

    if block_mask is not None:

        def flex_fwd():
            flex(q, k, v, block_mask=block_mask, enable_gqa=True)

        def flex_fwdbwd():
            flex(q, k, v, block_mask=block_mask, enable_gqa=True).backward(dout)

        measure("flex", "fwd ms", lambda: time_ms(torch, flex_fwd, warmup, iters, clear_grads), "flex_fwd_ms")
        measure("flex", "fwd+bwd ms", lambda: time_ms(torch, flex_fwdbwd, warmup, iters, clear_grads), "flex_fwdbwd_ms")
        measure("flex", "extra bytes", lambda: extra_bytes(torch, flex_fwdbwd, clear_grads), "flex_extra_bytes")

    if dense is not None:
        attn_mask = dense[None, None]

        def sdpa_fwdbwd():
            F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, enable_gqa=True).backward(dout)

        measure("sdpa", "fwd+bwd ms", lambda: time_ms(torch, sdpa_fwdbwd, warmup, iters, clear_grads), "sdpa_fwdbwd_ms")
        measure("sdpa", "extra bytes", lambda: extra_bytes(torch, sdpa_fwdbwd, clear_grads), "sdpa_extra_bytes")

    clear_grads()
    del q, k, v, dout, dense, block_mask
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return result


def main():
    if len(sys.argv) != 2:
        fail("usage: python3 attention_torch.py CASES.json")
    try:
        with open(sys.argv[1]) as f:
            spec = json.load(f)
        warmup, iters, cases = int(spec["warmup"]), int(spec["iters"]), spec["cases"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"{sys.argv[1]}: {type(e).__name__}: {e}")
    if iters < 1:
        fail(f"{sys.argv[1]}: iters must be at least 1")

    # Only the final JSON goes to the real stdout; Python, torch.compile and its worker processes
    # (which inherit file descriptor 1) write to stderr.
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not torch.cuda.is_available():
        fail("torch sees no CUDA device")
    raise_recompile_limits(torch)
    flex = torch.compile(flex_attention, dynamic=False)
    results = []
    for case in cases:
        try:
            results.append(run_case(torch, flex, create_block_mask, case, warmup, iters))
        except Exception as e:  # noqa: BLE001 - one broken case must not lose the others
            traceback.print_exc(file=sys.stderr)
            results.append({"name": case.get("name"), "errors": [f"case: {type(e).__name__}: {e}"]})
            torch.cuda.empty_cache()
    json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cases": results}, json_out)
    json_out.write("\n")
    json_out.flush()


if __name__ == "__main__":
    main()
