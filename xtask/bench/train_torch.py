#!/usr/bin/env python3
"""PyTorch baseline of `xtask bench train`: online DFlash drafter training steps on one GPU.

usage: python3 train_torch.py TRAIN.json
       python3 train_torch.py --self-test      (CPU checks on a tiny random Qwen3; needs no GPU)

One training step, online (no feature cache):
  1. a fresh row of S random token ids, uniform in [0, vocab) without the mask token (one
     document, positions 0..S-1, drawn on the device from a generator seeded with "seed");
  2. the frozen target (transformers, bf16, attn_implementation="sdpa", loaded by
     target_torch.load_model) runs target_torch.forward_hidden_states on it: the plain
     model(input_ids, output_hidden_states=True, use_cache=False) under torch.no_grad(), so all
     layers and the LM head, as `xtask bench target` times it;
     features = cat([hidden_states[l + 1] for l in layer_ids], dim=-1) [S, F*H] bf16, the output of
     each listed layer; the other hidden states and the logits are dropped right away;
  3. the drafter step of step_torch.py (forward and loss.backward(), its "form" and "policy") on
     those features and tokens; the drafter's frozen embed and lm_head are the target's own
     weights (shared, not copied);
  4. the optimizer as the Rust trainer runs it (the spec's recipe: bf16 compute, fp32 master
     weights): each bf16 gradient cast to an fp32 master's .grad, the global norm clipped to 1
     (clip_grad_norm_, foreach), torch.optim.AdamW(fp32 masters, lr=6e-4, weight_decay 0 as the recipe, fused=True).step(),
     the masters copied back into the bf16 weights (torch._foreach_copy_), then zero_grad() on
     both (the gradients are set to None).
The anchors, the BlockMasks, the RoPE tables and the loss weights depend only on the spec and are
built once (step_torch.build_state); each step puts its row in with step_torch.set_row.

TRAIN.json (written by xtask):
    {"target_dir": DIR (an HF Qwen3 checkpoint), "layer_ids": [target layers whose outputs are the
     features], "context_len": S, "anchors": [sorted ints < S], "gamma": f, "lm_chunk_rows": int,
     "warmup": int, "iters": int (>= 1), "seed": int,
     "form": "flex" | "compiled" (default "compiled"), "policy": "none" | "selective" |
     "per-layer" (default "per-layer"), "device": "cuda" (default) | "cpu" (smoke tests),
     "config": the drafter's config as step_torch.py reads it; its hidden and vocab must be the
     target's and its num_features the number of layer_ids}
The forms and policies are step_torch.py's. "compiled" falls back part by part as step_torch.py
does; if that fails as a whole the step is built again as "flex" and "form" says so, with the
reason in "errors".

Measurement: the first step (its drafter part is step_torch.settle's trial, where compilation
happens) is followed by zero_grad without an optimizer step; then `warmup` full steps (1-4), then
torch.cuda.reset_peak_memory_stats() and `iters` full steps with three CUDA events each (before
the row is drawn, after its features exist, after zero_grad), each step followed by a
synchronisation (as the Rust trainer's steps end: it reads the loss). ms_per_step = the median
over the steps of each step's first to last event, as `xtask bench train` times its own steps;
target_ms and step_ms = the medians of each step's two spans (tokens + target forward +
features; set_row + drafter forward and backward + AdamW + zero_grad). peak_gb = torch.cuda.max_memory_allocated()
over the timed steps / 1e9 (target weights, drafter, AdamW state, activations and gradients). On
the CPU (smoke tests) nothing is compiled, times come from time.perf_counter and peak_gb is null.

Prints one JSON line on stdout and nothing else (all other output goes to stderr):
    {"ms_per_step", "target_ms", "step_ms", "samples_per_s", "tokens_per_s" (S * samples_per_s),
     "peak_gb", "form", "policy", "parts" (each compiled part's variant), "errors": [str],
     "losses": [the first 8 steps' losses, warm-up included], "torch", "transformers", "gpu"}
A measurement that fails leaves its fields null, with the error in "errors"; a loss that is not
finite is null with an error. The exit status is 0 when the JSON was written, 2 on bad input (the
message names the field) or when "device" is "cuda" and torch sees no CUDA device.

--self-test (CPU, bf16, the drafter through step_torch.py's CPU stand-in for flex_attention):
saves a tiny random Qwen3ForCausalLM to a temporary folder, then checks the token draw (range, no
mask token), the features against hidden_states[l + 1] of a separate forward and against the
outputs of the decoder layers themselves (forward hooks), step_torch.row_targets against the
spec's definition, set_row against a state built on that row, that a full step updates the
drafter and leaves the target alone, and an end-to-end run (finite losses, all fields set); it
prints a report and exits 1 on a failure.
"""

import json
import math
import os
import statistics
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_torch  # noqa: E402  (imports no torch at module level)

LR = 6e-4
CLIP_NORM = 1.0
LOSSES_KEPT = 8


log = step_torch.log
fail = step_torch.fail


# ----------------------------------------------------------------------------------------------
# Input


def parse_spec(raw, where):
    """Checks TRAIN.json's object; returns a normalised copy or exits 2 naming the bad field. The
    drafter's part (config, row shape, counts) is checked by step_torch.parse_spec."""
    if not isinstance(raw, dict):
        fail(f"{where}: expected a JSON object")

    def bad(field, why):
        fail(f"{where}: field {field!r}: {why}")

    target_dir = raw.get("target_dir")
    if not isinstance(target_dir, str) or not target_dir:
        bad("target_dir", f"expected a folder name, got {target_dir!r}")
    layer_ids = raw.get("layer_ids")
    if not isinstance(layer_ids, list) or not layer_ids:
        bad("layer_ids", "expected a non-empty list of target layer indices")
    for i, l in enumerate(layer_ids):
        if isinstance(l, bool) or not isinstance(l, int) or l < 0:
            bad(f"layer_ids[{i}]", f"expected a non-negative integer, got {l!r}")
    form = raw.get("form", "compiled")
    if form not in step_torch.FORMS:
        bad("form", f"expected one of {list(step_torch.FORMS)}, got {form!r}")
    policy = raw.get("policy", "per-layer")
    if policy not in step_torch.POLICIES:
        bad("policy", f"expected one of {list(step_torch.POLICIES)}, got {policy!r}")

    keys = ("warmup", "iters", "seed", "device", "config", "context_len", "anchors", "gamma", "lm_chunk_rows")
    step_like = {k: raw[k] for k in keys if k in raw}
    step_like["forms"] = [form]
    step_like["policies"] = [policy]
    spec = step_torch.parse_spec(step_like, where)
    if spec["config"]["num_features"] != len(layer_ids):
        bad("config.num_features", f"{spec['config']['num_features']} is not the number of layer_ids ({len(layer_ids)})")
    spec.update({"target_dir": target_dir, "layer_ids": list(layer_ids), "form": form, "policy": policy})
    return spec


def check_target_config(spec, config, where):
    """The target's config (a transformers config) against the spec; exits 2 on a mismatch."""
    cfg = spec["config"]
    if config.hidden_size != cfg["hidden"]:
        fail(f"{where}: field 'config.hidden': {cfg['hidden']} is not the target's hidden_size {config.hidden_size}")
    if config.vocab_size != cfg["vocab"]:
        fail(f"{where}: field 'config.vocab': {cfg['vocab']} is not the target's vocab_size {config.vocab_size}")
    layers = config.num_hidden_layers
    for i, l in enumerate(spec["layer_ids"]):
        if l >= layers:
            fail(f"{where}: field 'layer_ids[{i}]': {l} is not below the target's {layers} layers")
    if layers - 1 in spec["layer_ids"]:
        log(f"NOTE layer {layers - 1} is the last one: transformers' hidden_states[{layers}] is after the final norm")
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and spec["context_len"] > max_pos:
        log(f"NOTE context_len {spec['context_len']} is beyond the target's max_position_embeddings {max_pos}")


# ----------------------------------------------------------------------------------------------
# One online step


def draw_tokens(torch, gen, s, vocab, mask_token_id, dev):
    """S ids uniform in [0, vocab) without `mask_token_id`, int64 on `dev` (no host sync)."""
    t = torch.randint(0, vocab - 1, (s,), generator=gen, device=dev)
    return t + (t >= mask_token_id).to(t.dtype)


def target_features(torch, target_torch, model, tokens, layer_ids):
    """cat([hidden_states[l + 1] for l in layer_ids], -1) [S, F*H] of the target's forward of `tokens`;
    the rest of its output (other hidden states, logits) is freed on return."""
    out = target_torch.forward_hidden_states(model, tokens[None, :])
    hidden = out.hidden_states
    with torch.no_grad():
        features = torch.cat([hidden[l + 1][0] for l in layer_ids], dim=-1)
    del out, hidden
    return features


def make_trainer(torch, target_torch, spec, model, env, errors):
    """Builds the drafter (state, step, AdamW) on the first row and runs that first step (the
    drafter part through step_torch.settle); returns a dict with "full_step" and what it uses."""
    dev = env["dev"]
    cuda = dev.type == "cuda"
    cfg = spec["config"]
    s = spec["context_len"]
    gen = torch.Generator(device=dev)
    gen.manual_seed(spec["seed"])
    embed = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach()

    def next_row():
        tokens = draw_tokens(torch, gen, s, cfg["vocab"], cfg["mask_token_id"], dev)
        return tokens, target_features(torch, target_torch, model, tokens, spec["layer_ids"])

    tokens, features = next_row()
    state = step_torch.build_state(
        torch, env["create_block_mask"], spec, dev, features=features, tokens=tokens, embed=embed, lm_head=lm_head
    )
    del tokens, features
    params = list(state["params"].values())
    # fp32 master weights: AdamW (and its fp32 moments) update these; the bf16 weights are copies.
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    if cuda:
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0, fused=True)
    else:
        opt = torch.optim.AdamW(masters, lr=LR, weight_decay=0.0)

    forms = [spec["form"]] + (["flex"] if spec["form"] == "compiled" else [])
    policy = spec["policy"]
    step = choice = form = None
    for k, form in enumerate(forms):
        label = f"{form}/{policy}"
        try:
            fns = step_torch.model_functions(torch, cfg)
            build = step_torch.make_step_builder(
                torch, fns, env["flex_attention"], env["flex_eager_form"], policy, state
            )
            variants = step_torch.part_variants(form, policy, compiling=cuda)
            t0 = time.perf_counter()
            step, choice = step_torch.settle(torch, build, variants, state, errors, label)
            log(f"[{label}] first drafter step {time.perf_counter() - t0:.1f} s (compilation included), parts {choice}")
            break
        except Exception as e:  # noqa: BLE001 - "compiled" falls back to "flex"
            if k + 1 == len(forms):
                raise
            traceback.print_exc(file=sys.stderr)
            errors.append(f"form {form} failed, falling back to flex: {step_torch.describe_error(e)}")
            step = build = fns = None
            step_torch.clear_grads(state)
            torch._dynamo.reset()
            step_torch.free_memory(torch)
    opt.zero_grad(set_to_none=True)
    for p in params:
        p.grad = None

    def full_step(marks=None):
        """One online step; `marks` (three callables) are called before the row is drawn, once its
        features exist and after zero_grad. Returns the loss (a detached 0-d tensor)."""
        if marks:
            marks[0]()
        tokens, features = next_row()
        if marks:
            marks[1]()
        step_torch.set_row(torch, state, features, tokens)
        del tokens, features
        loss = step()
        for m, p in zip(masters, params):
            m.grad = p.grad.float()
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, CLIP_NORM, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_copy_([p.data for p in params], [m.data for m in masters])
        if marks:
            marks[2]()
        return loss

    return {"state": state, "opt": opt, "step": step, "form": form, "parts": choice, "full_step": full_step}


def run_train(torch, target_torch, spec, model, env):
    """The measurement; never raises (a failure leaves nulls and its error)."""
    dev = env["dev"]
    cuda = dev.type == "cuda"
    s = spec["context_len"]
    result = {
        "ms_per_step": None,
        "target_ms": None,
        "step_ms": None,
        "samples_per_s": None,
        "tokens_per_s": None,
        "peak_gb": None,
        "form": None,
        "policy": spec["policy"],
        "parts": None,
        "errors": [],
        "losses": [],
    }
    kept = []

    def keep(loss):
        if len(kept) < LOSSES_KEPT:
            kept.append(loss)

    trainer = None
    try:
        log(f"building the drafter on the first row (S={s}, layers {spec['layer_ids']})")
        trainer = make_trainer(torch, target_torch, spec, model, env, result["errors"])
        result["form"], result["parts"] = trainer["form"], trainer["parts"]
        full_step = trainer["full_step"]
        t0 = time.perf_counter()
        for _ in range(spec["warmup"]):
            keep(full_step())
        if cuda:
            torch.cuda.synchronize()
        log(f"{spec['warmup']} warm-up steps in {time.perf_counter() - t0:.1f} s")

        iters = spec["iters"]
        if cuda:
            log(f"resident before the timed steps: {torch.cuda.memory_allocated() / 1e9:.2f} GB")
            torch.cuda.reset_peak_memory_stats()
            events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
            wall = time.perf_counter()
            for ev in events:
                keep(full_step([e.record for e in ev]))
                # Each step ends in a synchronisation, as the Rust trainer's steps do (it reads
                # the loss): steps are not queued behind each other.
                torch.cuda.synchronize()
            wall = (time.perf_counter() - wall) * 1e3 / iters
            total = statistics.median(ev[0].elapsed_time(ev[2]) for ev in events)
            target = statistics.median(ev[0].elapsed_time(ev[1]) for ev in events)
            drafter = statistics.median(ev[1].elapsed_time(ev[2]) for ev in events)
            result["peak_gb"] = torch.cuda.max_memory_allocated() / 1e9
            log(f"host wall clock {wall:.2f} ms per step")
        else:
            total = target = drafter = 0.0
            for _ in range(iters):
                stamps = []
                stamp = lambda: stamps.append(time.perf_counter())  # noqa: E731
                keep(full_step([stamp, stamp, stamp]))
                total += (stamps[2] - stamps[0]) * 1e3
                target += (stamps[1] - stamps[0]) * 1e3
                drafter += (stamps[2] - stamps[1]) * 1e3
            total, target, drafter = total / iters, target / iters, drafter / iters
        result["ms_per_step"] = total
        result["target_ms"] = target
        result["step_ms"] = drafter
        result["samples_per_s"] = 1e3 / total if total > 0 else None
        result["tokens_per_s"] = s * result["samples_per_s"] if total > 0 else None
        log(
            f"[{result['form']}/{spec['policy']}] {total:.3f} ms per step (target {target:.3f}, drafter step "
            f"{drafter:.3f}), {result['tokens_per_s']} tokens/s, peak {result['peak_gb']} GB"
        )
    except Exception as e:  # noqa: BLE001 - the JSON is written all the same
        traceback.print_exc(file=sys.stderr)
        result["errors"].append(step_torch.describe_error(e))
        for key in ("ms_per_step", "target_ms", "step_ms", "samples_per_s", "tokens_per_s", "peak_gb"):
            result[key] = None
    for i, loss in enumerate(kept):
        value = float(loss)
        if math.isfinite(value):
            result["losses"].append(value)
        else:
            result["losses"].append(None)
            result["errors"].append(f"loss of step {i} is not finite: {value}")
    log(f"losses {result['losses']}")
    trainer = None
    return result


def run(torch, transformers, spec, where, attn_implementation="sdpa"):
    import target_torch

    dev = torch.device(spec["device"])
    check_target_config(spec, transformers.AutoConfig.from_pretrained(spec["target_dir"]), where)
    t0 = time.perf_counter()
    model = target_torch.load_model(spec["target_dir"], device=dev, attn_implementation=attn_implementation)
    log(f"loaded the target from {spec['target_dir']} in {time.perf_counter() - t0:.1f} s")
    env = step_torch.make_env(torch, dev)
    report = run_train(torch, target_torch, spec, model, env)
    report.update({
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
    })
    return report


# ----------------------------------------------------------------------------------------------
# Self-test (CPU)

SELF_TEST_TARGET = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}

SELF_TEST_SPEC = {
    "layer_ids": [0, 1, 2],
    "context_len": 64,
    "anchors": [3, 30, 62],
    "gamma": 4.0,
    "lm_chunk_rows": 5,
    "warmup": 1,
    "iters": 2,
    "seed": 7,
    "form": "compiled",
    "policy": "per-layer",
    "device": "cpu",
    "config": dict(step_torch.SMOKE_SPEC["config"]),  # hidden 64, vocab 300, 3 features, mask 299
}


def self_test():
    import torch
    import transformers

    import target_torch

    checks = []

    def check(name, good, detail=""):
        checks.append(bool(good))
        print(f"  {'ok  ' if good else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    with tempfile.TemporaryDirectory() as folder:
        try:
            torch.manual_seed(0)
            config = transformers.Qwen3Config(**SELF_TEST_TARGET)
            transformers.Qwen3ForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
            raw = dict(SELF_TEST_SPEC, target_dir=folder)
            spec = parse_spec(raw, "self-test spec")
            dev = torch.device("cpu")
            check_target_config(spec, transformers.AutoConfig.from_pretrained(folder), "self-test spec")
            model = target_torch.load_model(folder, device=dev, attn_implementation="sdpa")
            cfg, s, layers = spec["config"], spec["context_len"], config.num_hidden_layers
            print(f"tiny random Qwen3 ({layers} layers, hidden {config.hidden_size}) in {folder}")

            print("token rows:")
            gen = torch.Generator(device=dev).manual_seed(1)
            for mask in (cfg["mask_token_id"], 5):
                t = draw_tokens(torch, gen, 20000, cfg["vocab"], mask, dev)
                seen = set(t.tolist())
                good = (
                    t.dtype == torch.int64 and int(t.min()) >= 0 and int(t.max()) < cfg["vocab"]
                    and mask not in seen and len(seen) == cfg["vocab"] - 1
                )
                check(f"mask {mask}: ids in [0, {cfg['vocab']}) without it, every other id drawn", good,
                      f"min {int(t.min())}, max {int(t.max())}, {len(seen)} distinct")

            print("features:")
            tokens = draw_tokens(torch, gen, s, cfg["vocab"], cfg["mask_token_id"], dev)
            features = target_features(torch, target_torch, model, tokens, spec["layer_ids"])
            hooked = {}

            def hook(l):
                def record(module, args, output):
                    hooked[l] = (output[0] if isinstance(output, tuple) else output).detach().clone()

                return record

            handles = [model.model.layers[l].register_forward_hook(hook(l)) for l in spec["layer_ids"]]
            try:
                with torch.no_grad():
                    out = model(input_ids=tokens[None, :], output_hidden_states=True, use_cache=False)
            finally:
                for handle in handles:
                    handle.remove()
            hidden = out.hidden_states
            want = torch.cat([hidden[l + 1][0] for l in spec["layer_ids"]], dim=-1)
            f_h = cfg["num_features"] * cfg["hidden"]
            check(f"{len(hidden)} hidden states (layers + 1)", len(hidden) == layers + 1)
            check(f"features [{s}, {f_h}] bf16", tuple(features.shape) == (s, f_h) and features.dtype == torch.bfloat16,
                  f"got {tuple(features.shape)} {features.dtype}")
            check("features == cat(hidden_states[l + 1]) of a separate forward", torch.equal(features, want))
            for l in spec["layer_ids"]:
                check(f"hidden_states[{l + 1}] == the output of decoder layer {l} (hook)",
                      l in hooked and torch.equal(hooked[l][0], hidden[l + 1][0]))
            check("features are not all zero", bool(features.abs().sum() > 0))
            del out, hidden, want

            print("row targets and set_row:")
            anchors_t = torch.tensor(spec["anchors"], dtype=torch.int64)
            b = cfg["block_size"]
            block_ids, labels = step_torch.row_targets(torch, tokens, anchors_t, s, b, cfg["mask_token_id"])
            x = tokens.tolist()
            want_ids, want_labels = [], []
            for a in spec["anchors"]:
                want_ids += [x[a]] + [cfg["mask_token_id"]] * (b - 1)
                want_labels += [x[a + o] if a + o < s else 0 for o in range(b)]
            check("block ids [x[a_j], MASK...] per block", block_ids.tolist() == want_ids)
            check("labels x[a_j + o], 0 past the end", labels.tolist() == want_labels)

            env = step_torch.make_env(torch, dev)
            embed = model.get_input_embeddings().weight.detach()
            lm_head = model.get_output_embeddings().weight.detach()
            tokens2 = draw_tokens(torch, gen, s, cfg["vocab"], cfg["mask_token_id"], dev)
            features2 = target_features(torch, target_torch, model, tokens2, spec["layer_ids"])
            losses = []
            for first in ((features, tokens), (features2, tokens2)):
                state = step_torch.build_state(torch, env["create_block_mask"], spec, dev, features=first[0],
                                               tokens=first[1], embed=embed, lm_head=lm_head)
                fns = step_torch.model_functions(torch, cfg)
                build = step_torch.make_step_builder(torch, fns, env["flex_attention"], env["flex_eager_form"],
                                                     spec["policy"], state)
                step = build({part: "eager" for part in step_torch.PARTS})
                if first[1] is tokens:
                    step_torch.set_row(torch, state, features2, tokens2)
                step_torch.clear_grads(state)
                losses.append(float(step()))
            check("built on row 1 then set_row(row 2) gives the loss of a state built on row 2",
                  losses[0] == losses[1] and math.isfinite(losses[0]), f"{losses[0]!r} vs {losses[1]!r}")

            print("one full step (target forward, drafter step, AdamW):")
            errors = []
            trainer = make_trainer(torch, target_torch, spec, model, env, errors)
            params = trainer["state"]["params"]
            before = {n: t.detach().clone() for n, t in params.items()}
            target_before = {n: t.detach().clone() for n, t in model.named_parameters()}
            loss = float(trainer["full_step"]())
            # In bf16 an AdamW step of lr 1e-4 moves the matrices (|w| ~ 0.02, spacing ~1e-4) but not
            # the norm weights at 1.0 (spacing 2^-7): only the matrices must have changed.
            matrices = [n for n, t in params.items() if t.dim() == 2]
            changed = [n for n in matrices if not torch.equal(params[n].detach(), before[n])]
            check("loss finite", math.isfinite(loss), repr(loss))
            check("every drafter matrix updated by AdamW", len(changed) == len(matrices),
                  f"{len(changed)} of {len(matrices)}")
            check("gradients cleared after the step", all(t.grad is None for t in params.values()))
            check("the target is frozen: no gradient, weights unchanged",
                  all(t.grad is None and not t.requires_grad and torch.equal(t, target_before[n])
                      for n, t in model.named_parameters()))
            check("the drafter's embed and lm_head are the target's",
                  trainer["state"]["embed"].data_ptr() == model.get_input_embeddings().weight.data_ptr()
                  and trainer["state"]["lm_head"].data_ptr() == model.get_output_embeddings().weight.data_ptr())
            check("no fallback errors", not errors, str(errors))
            trainer = None

            print("end to end (run_train, as on the GPU but on the CPU):")
            result = run_train(torch, target_torch, spec, model, env)
            n_losses = min(LOSSES_KEPT, spec["warmup"] + spec["iters"])
            check("no errors", not result["errors"], str(result["errors"]))
            check(f"{n_losses} finite losses", len(result["losses"]) == n_losses
                  and all(v is not None and math.isfinite(v) for v in result["losses"]), str(result["losses"]))
            timed = ("ms_per_step", "target_ms", "step_ms", "samples_per_s", "tokens_per_s")
            check("times set and positive", all(result[k] is not None and result[k] > 0 for k in timed),
                  str({k: result[k] for k in timed}))
            check("form as asked", result["form"] == spec["form"], str(result["form"]))
            json.dumps(result, allow_nan=False)
        except Exception:  # noqa: BLE001 - any exception fails the self-test
            traceback.print_exc()
            check("self-test ran without an exception", False)
    ok = bool(checks) and all(checks)
    print("self-test:", "ok" if ok else "FAILED")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------


def main():
    spec = step_torch.read_spec("train_torch.py", self_test, parse_spec)
    if not os.path.isfile(os.path.join(spec["target_dir"], "config.json")):
        fail(f"{sys.argv[1]}: field 'target_dir': {spec['target_dir']} has no config.json")

    json_out = step_torch.json_stdout()

    import torch
    import transformers

    if spec["device"] == "cuda" and not torch.cuda.is_available():
        fail("torch sees no CUDA device (\"device\": \"cuda\")")
    report = run(torch, transformers, spec, sys.argv[1])
    json_out.write(json.dumps(report) + "\n")
    json_out.flush()


if __name__ == "__main__":
    main()
