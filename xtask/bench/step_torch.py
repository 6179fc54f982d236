#!/usr/bin/env python3
"""PyTorch baseline of `xtask bench step`: one DFlash drafter training step (run on the GPU machine).

usage: python3 step_torch.py STEP.json
       python3 step_torch.py --self-test      (CPU checks, see below; needs no GPU)

One step is the forward pass and loss.backward() of a DFlash drafter (spec sections 1-3) on one
training row, with no optimizer: every `.grad` is set to None before the step, so the gradients
are allocated inside it and count in its peak memory.

STEP.json (written by xtask):
    {"warmup": int, "iters": int, "seed": int, "device": "cuda" (default) or "cpu",
     "config": {"hidden": H, "intermediate": I, "num_heads": nh, "num_kv_heads": nkv,
                "head_dim": d, "vocab": V, "rms_norm_eps": f, "rope_theta": f,
                "windows": [W or null per layer], "num_features": F, "block_size": B,
                "mask_token_id": int},
     "context_len": S, "anchors": [sorted ints < S], "gamma": f, "lm_chunk_rows": int,
     "forms": ["flex", "compiled"], "policies": ["none", "selective", "per-layer"]}

The model, in bf16 (norms computed in fp32 and cast back, as HF Qwen3 does; RoPE neox style with
inv_freq = theta^(-2i/d)):
  - trainable, normal(0, 0.02), norms ones: fc [H, F*H], hidden_norm, and per layer
    input_layernorm, q/k/v/o_proj, q_norm, k_norm [d], post_attention_layernorm, gate/up/down_proj;
    final norm. Frozen: embed and lm_head [V, H], normal(0, 0.02). Features [S, F*H] normal(0, 1),
    tokens uniform in [0, V), positions 0..S-1 (one document), every anchor kept.
  - ctx = hidden_norm(features @ fc^T); x = embed([x[a_j], MASK x (B-1)] per block) [N*B, H];
    per layer: xn = input_layernorm(x); q = rope(q_norm(xn Wq^T)) at positions a_j+o;
    k = rope(k_norm(cat(ctx, xn) Wk^T)) at the context positions then the block positions;
    v = cat(ctx, xn) Wv^T; flex_attention(enable_gqa) under the DFlash mask (spec section 2: for
    query j*B+o, full: context keys k < a_j and all of block j; window W: context keys
    a_j+o-(W-1) <= k < a_j and block j's offsets <= o); x += attn Wo^T;
    x += down(silu(gate(post_layernorm(x))) * up(post_layernorm(x))); h = norm(x).
  - loss = sum_r w_r CE(h_r lm_head^T, y_r) / sum_r w_r with y_{j*B+o} = x[a_j+o] and
    w = exp(-(o-1)/gamma) for o >= 1 and a_j+o < S, else 0. The LM head and the CE run in chunks of
    `lm_chunk_rows` rows, each under torch.utils.checkpoint (logits upcast to fp32 for the CE), so
    only one chunk's logits ever exist.
The BlockMask (create_block_mask, one per distinct window), the RoPE tables, labels and weights
are built before the timed steps, as a trainer does once per batch.

Forms:
  "flex"      flex_attention under torch.compile(dynamic=False), everything else eager: what
              public trainers do.
  "compiled"  torch.compile(dynamic=False, fullgraph=True) of each decoder layer function (its
              flex_attention and, for the checkpointing policies, its torch.utils.checkpoint
              calls inside the compiled region, as torchtitan compiles checkpointed blocks), of
              the LM-head chunk function (checkpoint inside), of the ctx projection and of the
              final norm. A part whose compiled step fails is tried next as checkpoint(compiled
              function), then eager (flex still compiled); each fallback is listed in "errors"
              while the measurement stands.
Checkpointing policies (torch.utils.checkpoint, use_reentrant=False, preserve_rng_state=False as
the step draws no random numbers):
  "none"       no checkpointing (the LM-head chunks are always checkpointed).
  "per-layer"  each decoder layer is one checkpoint: only its inputs are kept (x and the shared ctx).
  "selective"  per layer: checkpoint(x, ctx -> q, k, v), then flex_attention outside any
               checkpoint (its autograd keeps q, k, v, the output and the logsumexp), then
               checkpoint(x, attention output -> layer output). Kept per layer: x, q, k, v, the
               attention output and its logsumexp; recomputed: the norms, the q/k/v projections,
               RoPE, o_proj and the MLP. (PyTorch's policy-based selective checkpointing,
               create_selective_checkpoint_contexts, is not used: its dispatch-mode policy and
               the flex_attention higher-order op have a record of not working together,
               pytorch/pytorch#147879.) Under "compiled" the
               partitioner sees both checkpoints and flex in one graph and may recompute q, k, v
               from x instead of keeping them.

Measurement: `warmup` steps (at least one; compilation happens there), then one step between
torch.cuda.reset_peak_memory_stats() and torch.cuda.max_memory_allocated() (peak_bytes: weights,
frozen tables, features, masks, activations and gradients; resident_bytes is
torch.cuda.memory_allocated() just before it), then `iters` steps timed with CUDA events,
median in step_ms. Everything is freed between configurations. With "device": "cpu" (smoke
tests only) nothing is compiled, the two forms run the same eager code, times come from
time.perf_counter and the memory fields are null; as flex_attention has no backward on the CPU,
attention there is scaled_dot_product_attention under the dense boolean mask that create_mask
builds from the same mask_mod (the self-test checks both against the spec's predicate).

Prints one JSON object on stdout and nothing else (all other output goes to stderr):
    {"torch": version, "gpu": name or "cpu",
     "results": [{"form", "policy", "step_ms", "peak_bytes", "embed_bytes" (the frozen embedding
                  table's share of peak_bytes), "resident_bytes", "loss", "errors": [str]}]}
A measurement that fails is null, with its error and a short traceback tail in "errors"; a loss
that is not finite is null with an error. The exit status is 0 when the JSON was written, 2 on
bad input (the message names the field) or when "device" is "cuda" and torch sees no CUDA device.

--self-test runs on the CPU: check_mask_against_dense() compares flex_attention under the
BlockMask (forward; flex_attention has no CPU backward) and the CPU stand-in (forward and q/k/v
gradients) with a dense softmax attention under an explicit boolean mask built pair by pair from
the spec's predicate (and, where CUDA is available, compiled flex_attention on the GPU: forward
and gradients), then a small drafter step is run under every policy and its loss and gradients
are compared across policies; it prints a report and exits 1 on a mismatch.
"""

import gc
import json
import math
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from attention_torch import dflash_mask_mod, raise_recompile_limits, time_ms  # noqa: E402

FORMS = ("flex", "compiled")
POLICIES = ("none", "selective", "per-layer")
# The parts of a step that the "compiled" form compiles, in order.
PARTS = ("ctx", "layers", "final_norm", "lm_chunk")


def log(message):
    print(message, file=sys.stderr, flush=True)


def fail(message):
    """Exits 2 with `message`, named by the script that runs (this one, or one importing it)."""
    print(f"{os.path.basename(sys.argv[0])}: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


# ----------------------------------------------------------------------------------------------
# Input


def parse_spec(spec, where):
    """Checks STEP.json's object; returns a normalised copy or exits 2 naming the bad field."""

    def bad(field, why):
        fail(f"{where}: field {field!r}: {why}")

    def get(obj, key, prefix=""):
        if not isinstance(obj, dict) or key not in obj:
            bad(prefix + key, "missing")
        return obj[key]

    def integer(value, field, minimum=None):
        if isinstance(value, bool) or not isinstance(value, int):
            bad(field, f"expected an integer, got {value!r}")
        if minimum is not None and value < minimum:
            bad(field, f"must be at least {minimum}, got {value}")
        return value

    def positive_float(value, field):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            bad(field, f"expected a positive number, got {value!r}")
        return float(value)

    def names(value, field, allowed):
        if not isinstance(value, list) or not value:
            bad(field, f"expected a non-empty list of {list(allowed)}")
        for v in value:
            if v not in allowed:
                bad(field, f"unknown entry {v!r}, expected one of {list(allowed)}")
        return list(dict.fromkeys(value))

    if not isinstance(spec, dict):
        fail(f"{where}: expected a JSON object")
    out = {
        "warmup": integer(get(spec, "warmup"), "warmup", 0),
        "iters": integer(get(spec, "iters"), "iters", 1),
        "seed": integer(get(spec, "seed"), "seed", 0),
        "device": spec.get("device", "cuda"),
    }
    if out["device"] not in ("cuda", "cpu"):
        bad("device", f"expected \"cuda\" or \"cpu\", got {out['device']!r}")
    c = get(spec, "config")
    if not isinstance(c, dict):
        bad("config", "expected an object")
    cfg = {}
    for key in ("hidden", "intermediate", "num_heads", "num_kv_heads", "head_dim", "vocab", "num_features", "block_size"):
        cfg[key] = integer(get(c, key, "config."), "config." + key, 1)
    for key in ("rms_norm_eps", "rope_theta"):
        cfg[key] = positive_float(get(c, key, "config."), "config." + key)
    if cfg["num_heads"] % cfg["num_kv_heads"]:
        bad("config.num_kv_heads", f"{cfg['num_kv_heads']} does not divide num_heads {cfg['num_heads']}")
    if cfg["head_dim"] % 2:
        bad("config.head_dim", f"must be even for RoPE, got {cfg['head_dim']}")
    cfg["mask_token_id"] = integer(get(c, "mask_token_id", "config."), "config.mask_token_id", 0)
    if cfg["mask_token_id"] >= cfg["vocab"]:
        bad("config.mask_token_id", f"{cfg['mask_token_id']} is not below vocab {cfg['vocab']}")
    windows = get(c, "windows", "config.")
    if not isinstance(windows, list) or not windows:
        bad("config.windows", "expected a non-empty list with one entry (W or null) per layer")
    cfg["windows"] = [None if w is None else integer(w, f"config.windows[{i}]", 1) for i, w in enumerate(windows)]
    out["config"] = cfg

    s = out["context_len"] = integer(get(spec, "context_len"), "context_len", 1)
    anchors = get(spec, "anchors")
    if not isinstance(anchors, list) or not anchors:
        bad("anchors", "expected a non-empty list of sorted positions")
    for i, a in enumerate(anchors):
        integer(a, f"anchors[{i}]", 0)
        if a >= s:
            bad(f"anchors[{i}]", f"{a} is not below context_len {s}")
        if i and a <= anchors[i - 1]:
            bad(f"anchors[{i}]", f"{a} does not follow {anchors[i - 1]}: anchors must be strictly increasing")
    out["anchors"] = list(anchors)
    out["gamma"] = positive_float(get(spec, "gamma"), "gamma")
    out["lm_chunk_rows"] = integer(get(spec, "lm_chunk_rows"), "lm_chunk_rows", 1)
    out["forms"] = names(get(spec, "forms"), "forms", FORMS)
    out["policies"] = names(get(spec, "policies"), "policies", POLICIES)
    return out


# ----------------------------------------------------------------------------------------------
# The drafter


def model_functions(torch, cfg):
    """The pure functions of one step (weights are arguments, so one compiled graph serves every
    layer): context, attn_inputs, attn_output_mlp, final_norm, chunk_loss."""
    F = torch.nn.functional
    nh, nkv, d, eps = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"], cfg["rms_norm_eps"]
    half = d // 2

    def rms_norm(x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return w * xf.to(x.dtype)

    def rope(x, cos, sin):  # x [T, heads, d], cos/sin [T, 1, d]
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def context(features, fc_w, norm_w):
        return rms_norm(F.linear(features, fc_w), norm_w)

    # Layer weights w: (input_ln, q, k, v, o, q_norm, k_norm, post_ln, gate, up, down).
    def attn_inputs(x, ctx, w, rope_tables):
        cos_q, sin_q, cos_k, sin_k = rope_tables
        xn = rms_norm(x, w[0])
        q = rope(rms_norm(F.linear(xn, w[1]).unflatten(-1, (nh, d)), w[5]), cos_q, sin_q)
        kv_in = torch.cat((ctx, xn), dim=0)
        k = rope(rms_norm(F.linear(kv_in, w[2]).unflatten(-1, (nkv, d)), w[6]), cos_k, sin_k)
        v = F.linear(kv_in, w[3]).unflatten(-1, (nkv, d))
        return tuple(t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, len, d]

    def attn_output_mlp(x, attn, w):
        x = x + F.linear(attn.squeeze(0).transpose(0, 1).flatten(1), w[4])
        xn = rms_norm(x, w[7])
        return x + F.linear(F.silu(F.linear(xn, w[8])) * F.linear(xn, w[9]), w[10])

    def final_norm(x, w):
        return rms_norm(x, w)

    def chunk_loss(h, lm_head, labels, weights):
        logits = F.linear(h, lm_head).float()
        return (F.cross_entropy(logits, labels, reduction="none") * weights).sum()

    return {
        "context": context,
        "attn_inputs": attn_inputs,
        "attn_output_mlp": attn_output_mlp,
        "final_norm": final_norm,
        "chunk_loss": chunk_loss,
    }


def build_state(torch, create_block_mask, spec, dev, features=None, tokens=None, embed=None, lm_head=None):
    """Parameters, frozen tables and one row's inputs, all from `spec["seed"]`.

    `features` [S, F*H] bf16, `tokens` (int64 [S]) and the frozen `embed` and `lm_head` [V, H]
    bf16, all on `dev`, are used where given instead of random ones (which are then not drawn):
    train_torch.py passes the target's features and weights. set_row() puts another row in."""
    cfg = spec["config"]
    h, i, nh, nkv, d = cfg["hidden"], cfg["intermediate"], cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
    v, f, b = cfg["vocab"], cfg["num_features"], cfg["block_size"]
    s, anchors = spec["context_len"], spec["anchors"]
    bf16 = torch.bfloat16
    gen = torch.Generator(device=dev)
    gen.manual_seed(spec["seed"])

    def normal(*shape, std=0.02):
        return torch.randn(*shape, generator=gen, device=dev, dtype=bf16).mul_(std)

    def ones(n):
        return torch.ones(n, device=dev, dtype=bf16)

    params = {"fc.weight": normal(h, f * h), "hidden_norm.weight": ones(h)}
    layers = []
    for l in range(len(cfg["windows"])):
        w = (
            ones(h),
            normal(nh * d, h),
            normal(nkv * d, h),
            normal(nkv * d, h),
            normal(h, nh * d),
            ones(d),
            ones(d),
            ones(h),
            normal(i, h),
            normal(i, h),
            normal(h, i),
        )
        names = ("input_layernorm", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm",
                 "post_attention_layernorm", "gate_proj", "up_proj", "down_proj")
        for name, t in zip(names, w):
            params[f"layers.{l}.{name}.weight"] = t
        layers.append(w)
    params["norm.weight"] = ones(h)
    for t in params.values():
        t.requires_grad_()
    if embed is None:
        embed = normal(v, h)
    if lm_head is None:
        lm_head = normal(v, h)
    if features is None:
        features = torch.randn(s, f * h, generator=gen, device=dev, dtype=bf16)
    if tokens is None:
        tokens = torch.randint(0, v, (s,), generator=gen, device=dev)

    n = len(anchors)
    nq = n * b
    weights, q_pos = [], []
    for a in anchors:
        for o in range(b):
            p = a + o
            q_pos.append(p)
            weights.append(math.exp(-(o - 1) / spec["gamma"]) if o >= 1 and p < s else 0.0)
    wsum = sum(weights)
    anchors_t = torch.tensor(anchors, dtype=torch.int64, device=dev)
    block_ids_t, labels_t = row_targets(torch, tokens, anchors_t, s, b, cfg["mask_token_id"])

    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, d, 2, dtype=torch.int64, device=dev).float() / d))

    def tables(positions):
        freqs = torch.tensor(positions, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(bf16)[:, None, :], emb.sin().to(bf16)[:, None, :]

    cos_q, sin_q = tables(q_pos)
    cos_k, sin_k = tables(list(range(s)) + q_pos)

    masks = {}
    for w in cfg["windows"]:
        if w not in masks:
            masks[w] = create_block_mask(dflash_mask_mod(torch, anchors_t, s, b, w), None, None, nq, s + nq, device=dev)

    rows = spec["lm_chunk_rows"]
    chunks = [(r, min(r + rows, nq)) for r in range(0, nq, rows)]
    weights_t = torch.tensor(weights, dtype=torch.float32, device=dev)
    return {
        "params": params,
        "layers": layers,
        "embed": embed,
        "lm_head": lm_head,
        "features": features,
        "block_ids": block_ids_t,
        "rope": (cos_q, sin_q, cos_k, sin_k),
        "anchors": anchors_t,
        "layer_masks": [masks[w] for w in cfg["windows"]],
        "chunks": chunks,
        "chunk_labels": [labels_t[r0:r1] for r0, r1 in chunks],
        "chunk_weights": [weights_t[r0:r1] for r0, r1 in chunks],
        "wsum": wsum if wsum > 0 else 1.0,  # no weighted row: the loss is 0
        "row_shape": (s, b, cfg["mask_token_id"]),
    }


def row_targets(torch, tokens, anchors, s, block, mask_token_id):
    """The drafter's input ids and labels [N*B] (int64) of the row with `tokens` (int64 [S]), by
    indexing on their device (no copy to the host): block j is [x[a_j], MASK x (B-1)] and row
    j*B+o's label is x[a_j+o], 0 past the row's end (where its weight is 0)."""
    offsets = torch.arange(block, dtype=torch.int64, device=tokens.device)
    pos = (anchors[:, None] + offsets[None, :]).flatten()
    labels = torch.where(pos < s, tokens[pos.clamp(max=s - 1)], torch.zeros_like(pos))
    block_ids = torch.full_like(pos, mask_token_id)
    block_ids[::block] = tokens[anchors]
    return block_ids, labels


def set_row(torch, state, features, tokens):
    """Puts another row of the same length into `state` (features [S, F*H] bf16 and tokens int64 [S]
    on its device), as an online trainer does each step; the anchors, masks, RoPE tables and loss
    weights stay. A step built by make_step_builder reads these entries at each call."""
    s, block, mask_token_id = state["row_shape"]
    block_ids, labels = row_targets(torch, tokens, state["anchors"], s, block, mask_token_id)
    state["features"] = features
    state["block_ids"] = block_ids
    state["chunk_labels"] = [labels[r0:r1] for r0, r1 in state["chunks"]]


def dense_attention_cpu(torch):
    """The CPU stand-in for flex_attention (which has no CPU backward): the same call signature,
    scaled_dot_product_attention under the dense mask of the BlockMask's mask_mod."""
    from torch.nn.attention.flex_attention import create_mask

    F = torch.nn.functional

    def attend(q, k, v, block_mask, enable_gqa):
        mask = create_mask(block_mask.mask_mod, None, None, q.shape[-2], k.shape[-2], device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)

    return attend


def clear_grads(state):
    for t in state["params"].values():
        t.grad = None


def part_variants(form, policy, compiling):
    """How each part may run, best first; "eager" keeps compiled flex_attention for attention."""
    if form == "flex" or not compiling:
        return {part: ["eager"] for part in PARTS}
    checkpointed = ["compile(checkpoint)", "checkpoint(compile)", "eager"]
    return {
        "ctx": ["compile", "eager"],
        "layers": ["compile", "eager"] if policy == "none" else checkpointed,
        "final_norm": ["compile", "eager"],
        "lm_chunk": checkpointed,
    }


def make_step_builder(torch, fns, flex_attention, flex_eager_form, policy, state):
    """Returns build(choice) -> step(), where choice maps each part to one of its variants.

    flex_attention is the raw function (traced inside compiled regions); flex_eager_form is what
    eager code calls (flex_attention under torch.compile on CUDA, the raw one on the CPU)."""
    from torch.utils.checkpoint import checkpoint

    F = torch.nn.functional

    def compiled(fn):
        return torch.compile(fn, dynamic=False, fullgraph=True)

    def checkpointed(fn):
        def run(*args):
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)

        return run

    attn_inputs, attn_output_mlp = fns["attn_inputs"], fns["attn_output_mlp"]

    def plain_layer(attend):
        def layer(x, ctx, w, rope_tables, block_mask):
            q, k, v = attn_inputs(x, ctx, w, rope_tables)
            return attn_output_mlp(x, attend(q, k, v, block_mask=block_mask, enable_gqa=True), w)

        return layer

    def selective_layer(attend, pre, post):
        def layer(x, ctx, w, rope_tables, block_mask):
            q, k, v = pre(x, ctx, w, rope_tables)
            return post(x, attend(q, k, v, block_mask=block_mask, enable_gqa=True), w)

        return layer

    def layer_fn(variant):
        if variant == "eager":
            if policy == "none":
                return plain_layer(flex_eager_form)
            if policy == "per-layer":
                return checkpointed(plain_layer(flex_eager_form))
            return selective_layer(flex_eager_form, checkpointed(attn_inputs), checkpointed(attn_output_mlp))
        if variant in ("compile", "compile(checkpoint)"):
            if policy == "none":
                return compiled(plain_layer(flex_attention))
            if policy == "per-layer":
                return compiled(checkpointed(plain_layer(flex_attention)))
            return compiled(selective_layer(flex_attention, checkpointed(attn_inputs), checkpointed(attn_output_mlp)))
        if variant == "checkpoint(compile)":
            if policy == "per-layer":
                return checkpointed(compiled(plain_layer(flex_attention)))
            return selective_layer(
                flex_eager_form, checkpointed(compiled(attn_inputs)), checkpointed(compiled(attn_output_mlp))
            )
        raise ValueError(f"layers: unknown variant {variant}")

    def simple_fn(fn, variant):
        return compiled(fn) if variant == "compile" else fn

    def lm_fn(variant):
        fn = fns["chunk_loss"]
        if variant == "compile(checkpoint)":
            return compiled(checkpointed(fn))
        if variant == "checkpoint(compile)":
            return checkpointed(compiled(fn))
        return checkpointed(fn)

    def build(choice):
        ctx_fn = simple_fn(fns["context"], choice["ctx"])
        layer = layer_fn(choice["layers"])
        norm_fn = simple_fn(fns["final_norm"], choice["final_norm"])
        chunk_fn = lm_fn(choice["lm_chunk"])
        p = state["params"]

        def step():
            ctx = ctx_fn(state["features"], p["fc.weight"], p["hidden_norm.weight"])
            x = F.embedding(state["block_ids"], state["embed"])
            for w, block_mask in zip(state["layers"], state["layer_masks"]):
                x = layer(x, ctx, w, state["rope"], block_mask)
            h = norm_fn(x, p["norm.weight"])
            total = None
            for (r0, r1), labels, weights in zip(state["chunks"], state["chunk_labels"], state["chunk_weights"]):
                part = chunk_fn(h[r0:r1], state["lm_head"], labels, weights)
                total = part if total is None else total + part
            loss = total / state["wsum"]
            loss.backward()
            return loss.detach()

        return step

    return build


# ----------------------------------------------------------------------------------------------
# Measurement


def describe_error(e):
    """One line: the exception, the start of its message and the last frames of its traceback."""
    message = " ".join(str(e).split())
    if len(message) > 400:
        message = message[:400] + "..."
    frames = traceback.extract_tb(e.__traceback__)[-3:]
    tail = " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))
    return f"{type(e).__name__}: {message} [at {tail}]"


def free_memory(torch):
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def settle(torch, build, variants, state, errors, label):
    """Builds and runs the first step with each part's best variant that works; returns the step.

    A failure with every part at its best variant is followed by one trial per part (that part at
    each of its variants in turn, the other parts eager); the parts then run as found. Fallbacks go
    to `errors`. With a single variant per part an exception simply propagates."""
    choice = {part: vs[0] for part, vs in variants.items()}
    single = all(len(vs) == 1 for vs in variants.values())
    try:
        step = build(choice)
        clear_grads(state)
        step()
        return step, choice
    except Exception as e:  # noqa: BLE001 - the compiled form falls back part by part
        if single:
            raise
        traceback.print_exc(file=sys.stderr)
        errors.append(f"compiled step with {choice} failed, trying each part alone: {describe_error(e)}")
    step = None
    clear_grads(state)
    torch._dynamo.reset()
    free_memory(torch)
    final = {}
    for part, vs in variants.items():
        for variant in vs:
            if variant == "eager":
                final[part] = variant
                errors.append(f"{part}: fell back to eager (flex_attention still compiled)")
                break
            trial = {p: "eager" for p in variants}
            trial[part] = variant
            log(f"[{label}] trying {part} as {variant}, the other parts eager")
            try:
                step = build(trial)
                clear_grads(state)
                step()
                final[part] = variant
                break
            except Exception as e:  # noqa: BLE001
                traceback.print_exc(file=sys.stderr)
                errors.append(f"{part} as {variant}: {describe_error(e)}")
            step = None
            clear_grads(state)
            free_memory(torch)
    log(f"[{label}] running with {final}")
    step = build(final)
    clear_grads(state)
    step()
    return step, final


def cpu_time_ms(fn, iters, setup):
    times = []
    for _ in range(iters):
        setup()
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_config(torch, env, spec, form, policy):
    """One (form, policy) measurement; never raises."""
    label = f"{form}/{policy}"
    result = {
        "form": form,
        "policy": policy,
        "step_ms": None,
        "peak_bytes": None,
        "embed_bytes": None,
        "resident_bytes": None,
        "loss": None,
        "errors": [],
    }
    cuda = env["dev"].type == "cuda"
    state = None
    try:
        log(f"[{label}] building inputs and parameters")
        state = build_state(torch, env["create_block_mask"], spec, env["dev"])
        fns = model_functions(torch, spec["config"])
        build = make_step_builder(torch, fns, env["flex_attention"], env["flex_eager_form"], policy, state)
        variants = part_variants(form, policy, compiling=cuda)
        t0 = time.perf_counter()
        step, choice = settle(torch, build, variants, state, result["errors"], label)
        log(f"[{label}] first step {time.perf_counter() - t0:.1f} s (compilation included), parts {choice}")
        for _ in range(spec["warmup"] - 1):
            clear_grads(state)
            step()

        clear_grads(state)
        if cuda:
            torch.cuda.synchronize()
            result["resident_bytes"] = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        loss = step()
        if cuda:
            torch.cuda.synchronize()
            result["peak_bytes"] = torch.cuda.max_memory_allocated()
            result["embed_bytes"] = state["embed"].numel() * state["embed"].element_size()
        loss = float(loss)
        if math.isfinite(loss):
            result["loss"] = loss
        else:
            result["errors"].append(f"loss is not finite: {loss}")

        setup = lambda: clear_grads(state)  # noqa: E731
        if cuda:
            result["step_ms"] = time_ms(torch, step, 0, spec["iters"], setup)
        else:
            result["step_ms"] = cpu_time_ms(step, spec["iters"], setup)
        log(
            f"[{label}] step {result['step_ms']:.3f} ms, peak {result['peak_bytes']}, "
            f"resident {result['resident_bytes']}, loss {result['loss']}"
        )
    except Exception as e:  # noqa: BLE001 - one broken configuration must not lose the others
        traceback.print_exc(file=sys.stderr)
        result["errors"].append(describe_error(e))
        for key in ("step_ms", "peak_bytes", "resident_bytes", "loss"):
            result[key] = None
    finally:
        if state is not None:
            clear_grads(state)
        state = step = build = fns = None
        free_memory(torch)
        if cuda:
            # What stays after the first configuration (cuBLAS workspaces from the caching allocator,
            # 64 MiB on the H200) is the baseline; anything beyond it is a leak.
            held = torch.cuda.memory_allocated()
            if env["held_bytes"] is None:
                env["held_bytes"] = held
                log(f"[{label}] {held} bytes held after the first configuration (cuBLAS workspaces)")
            elif held > env["held_bytes"]:
                log(f"[{label}] {held - env['held_bytes']} more bytes held than after the first one: resetting dynamo")
                torch._dynamo.reset()
                free_memory(torch)
    return result


def note_loss_agreement(results):
    """Logs whether the policies of each form gave the same loss (they compute the same function)."""
    for form in FORMS:
        losses = {r["policy"]: r["loss"] for r in results if r["form"] == form and r["loss"] is not None}
        if len(losses) < 2:
            continue
        values = list(losses.values())
        spread = (max(values) - min(values)) / max(abs(min(values)), 1e-30)
        if spread == 0:
            log(f"{form}: the loss is identical under {sorted(losses)}: {values[0]}")
        else:
            log(f"NOTE {form}: the loss differs across policies (relative spread {spread:.2e}): {losses}")


def make_env(torch, dev):
    """What every step on `dev` shares: the mask builder, flex_attention (raw, for compiled regions)
    and the attention eager code calls (compiled flex_attention on CUDA, the stand-in on the CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dev.type == "cuda":
        raise_recompile_limits(torch)
        flex_eager_form = torch.compile(flex_attention, dynamic=False)
    else:
        flex_eager_form = dense_attention_cpu(torch)
    return {
        "dev": dev,
        "create_block_mask": create_block_mask,
        "flex_attention": flex_attention,
        "flex_eager_form": flex_eager_form,
        "held_bytes": None,
    }


def run_all(torch, spec):
    dev = torch.device(spec["device"])
    cuda = dev.type == "cuda"
    env = make_env(torch, dev)
    results = []
    for form in spec["forms"]:
        for policy in spec["policies"]:
            results.append(run_config(torch, env, spec, form, policy))
    note_loss_agreement(results)
    return {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(dev) if cuda else "cpu", "results": results}


# ----------------------------------------------------------------------------------------------
# Self-test (CPU)

SMOKE_SPEC = {
    "warmup": 1,
    "iters": 2,
    "seed": 7,
    "device": "cpu",
    "config": {
        "hidden": 64,
        "intermediate": 128,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
        "vocab": 300,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "windows": [None, 8],
        "num_features": 3,
        "block_size": 4,
        "mask_token_id": 299,
    },
    "context_len": 64,
    "anchors": [3, 30, 62],
    "gamma": 4.0,
    "lm_chunk_rows": 5,
    "forms": list(FORMS),
    "policies": list(POLICIES),
}


def dense_spec_mask(s, block, anchors, window):
    """The spec's predicate (section 2), pair by pair, as nested lists [N*B][S+N*B] of bools."""
    nq = len(anchors) * block
    rows = []
    for q in range(nq):
        j, o = divmod(q, block)
        a = anchors[j]
        row = []
        for k in range(s + nq):
            if k < s:
                allowed = k < a if window is None else a + o - (window - 1) <= k < a
            else:
                jk, ok = divmod(k - s, block)
                allowed = jk == j and (window is None or ok <= o)
            row.append(allowed)
        rows.append(row)
    return rows


def check_mask_against_dense(torch=None):
    """Checks the DFlash mask and the attention calls against a dense softmax attention (fp32)
    under an explicit boolean mask built pair by pair from the spec's predicate, on the smoke
    shapes, for full attention and windows 8, 3 and 1:
      - create_mask(dflash_mask_mod) equals the explicit mask exactly;
      - flex_attention under the BlockMask (eager, CPU, forward only: it has no CPU backward):
        the output;
      - the CPU stand-in (dense_attention_cpu): the output and the q, k, v gradients;
      - when CUDA is available, flex_attention under torch.compile on the GPU: the output and the
        q, k, v gradients.
    Returns a list of (name, max abs difference, ok)."""
    if torch is None:
        import torch
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    s, block, anchors = 64, 4, [3, 30, 62]
    nh, nkv, d = 4, 2, 16
    nq, nk = len(anchors) * block, s + len(anchors) * block
    gen = torch.Generator().manual_seed(1)
    stand_in = dense_attention_cpu(torch)
    cuda = torch.cuda.is_available()
    flex_compiled = torch.compile(flex_attention, dynamic=False) if cuda else None
    checks = []

    def reference(q, k, v, mask, dout):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        rep = nh // nkv
        scores = q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2) * d**-0.5
        out = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(rep, dim=1)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def with_grads(attend, q, k, v, block_mask, dout):
        q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
        out = attend(q, k, v, block_mask=block_mask, enable_gqa=True)
        out.backward(dout)
        return out.detach(), q.grad, k.grad, v.grad

    def compare(name, got, want):
        for what, a, b in zip(("out", "dq", "dk", "dv"), got, want):
            diff = (a.detach().cpu().float() - b.detach().cpu().float()).abs().max().item()
            checks.append((f"{name} {what}", diff, diff < 1e-4))

    for window in (None, 8, 3, 1):
        name = "full" if window is None else f"window {window}"
        q, k, v, dout = (torch.randn(1, h, n, d, generator=gen) for h, n in ((nh, nq), (nkv, nk), (nkv, nk), (nh, nq)))
        mask = torch.tensor(dense_spec_mask(s, block, anchors, window))
        want = reference(q, k, v, mask, dout)
        mask_mod = dflash_mask_mod(torch, torch.tensor(anchors, dtype=torch.int64), s, block, window)

        built = create_mask(mask_mod, None, None, nq, nk, device="cpu")[0, 0]
        mismatches = int((built != mask).sum())
        checks.append((f"{name} mask_mod == spec mask ({int(mask.sum())} allowed pairs, {mismatches} differ)",
                       float(mismatches), mismatches == 0 and bool(mask.any(-1).all())))

        block_mask = create_block_mask(mask_mod, None, None, nq, nk, device="cpu")
        with torch.no_grad():
            out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
        compare(f"{name} flex_attention (cpu, eager)", (out,), want)
        compare(f"{name} cpu stand-in", with_grads(stand_in, q, k, v, block_mask, dout), want)

        if cuda:
            dev = torch.device("cuda")
            mask_mod = dflash_mask_mod(torch, torch.tensor(anchors, dtype=torch.int64, device=dev), s, block, window)
            block_mask = create_block_mask(mask_mod, None, None, nq, nk, device=dev)
            got = with_grads(flex_compiled, *(t.to(dev) for t in (q, k, v)), block_mask, dout.to(dev))
            compare(f"{name} flex_attention (cuda, compiled)", got, want)
    return checks


def self_test():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    ok = True
    print("check_mask_against_dense (flex_attention vs dense softmax with the spec's boolean mask):")
    for name, diff, good in check_mask_against_dense(torch):
        ok &= good
        print(f"  {'ok  ' if good else 'FAIL'} {name}: max abs diff {diff:.2e}")

    spec = parse_spec(SMOKE_SPEC, "self-test spec")
    dev = torch.device("cpu")
    print("policies (CPU, eager): loss and gradients of one step")
    reference = None
    for policy in POLICIES:
        state = build_state(torch, create_block_mask, spec, dev)
        fns = model_functions(torch, spec["config"])
        build = make_step_builder(torch, fns, flex_attention, dense_attention_cpu(torch), policy, state)
        step = build({part: "eager" for part in PARTS})
        clear_grads(state)
        loss = float(step())
        grads = {name: t.grad.float().clone() for name, t in state["params"].items()}
        missing = [name for name, t in state["params"].items() if t.grad is None or not t.grad.abs().sum() > 0]
        if reference is None:
            reference = (loss, grads)
            same_loss, grad_diff = True, 0.0
        else:
            same_loss = loss == reference[0]
            grad_diff = max((grads[n] - reference[1][n]).abs().max().item() for n in grads)
        good = math.isfinite(loss) and same_loss and grad_diff == 0.0 and not missing
        ok &= good
        print(
            f"  {'ok  ' if good else 'FAIL'} {policy}: loss {loss!r}, same loss as none: {same_loss}, "
            f"max grad diff vs none {grad_diff:.2e}, parameters without gradient: {missing or 'none'}"
        )
    print("self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------


def read_spec(script, self_test, parse):
    """The spec file named on `script`'s command line, parsed by `parse(raw, file)`; with
    `--self-test`, runs `self_test()` and exits with its status."""
    if sys.argv[1:] == ["--self-test"]:
        sys.exit(self_test())
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        fail(f"usage: python3 {script} SPEC.json | --self-test")
    try:
        with open(sys.argv[1]) as f:
            raw = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"{sys.argv[1]}: {type(e).__name__}: {e}")
    return parse(raw, sys.argv[1])


def json_stdout():
    """The real stdout, for the final JSON only; from here on everything else (Python, torch.compile
    and its worker processes, which inherit file descriptor 1) writes to stderr."""
    json_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    return json_out


def main():
    spec = read_spec("step_torch.py", self_test, parse_spec)

    json_out = json_stdout()

    import torch

    if spec["device"] == "cuda" and not torch.cuda.is_available():
        fail("torch sees no CUDA device (\"device\": \"cuda\")")
    report = run_all(torch, spec)
    json.dump(report, json_out)
    json_out.write("\n")
    json_out.flush()


if __name__ == "__main__":
    main()
