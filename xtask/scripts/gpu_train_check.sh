#!/usr/bin/env bash
# On the GPU machine (from the repository root): a real run on the GPU, end to end, and its exact
# resumption. transformers makes a small random target folder with the fixture tokenizer: a Qwen3
# (KIND dense: heads of 64, which the GPU kernels need) or a Qwen3.5 hybrid (KIND hybrid: three
# GatedDeltaNet layers with heads of 128 and a gated attention layer with heads of 64, spec section
# 10); `xtask train --target ... --data ... --step gpu` trains on the fixture conversations with
# the target's features computed online on the GPU. Then:
#   - the whole run measures the real tau at each evaluation (`--tau-prompts`, the GPU's cached
#     decoders beside the step);
#   - the same run killed with SIGKILL after its first checkpoint and resumed gives bitwise the
#     uninterrupted run's losses (the GPU kernels are deterministic: no atomics, fixed orders);
#   - a 3-step run's losses equal those of the same run on the CPU twins in f32 (`--step host`)
#     within the bf16 step bound (2e-2 relative);
#   - `xtask eval` decodes with the trained drafter on the GPU (K/V caches and, for a hybrid,
#     GatedDeltaNet states; bf16) and with the reference decoders on the CPU (f32); the CPU is
#     exactly lossless, the GPU up to bf16 near-ties;
#   - hybrid: `xtask features --device gpu` caches the target's features and a 3-step run from the
#     cache has the online run's losses within the bf16 step bound.
# The logs, metrics and eval JSONs end up packed in OUT_DIR/logs.tgz (one file, also on a failure:
# a device call brings back 8 files at most); the summary is printed.
# usage: xtask/scripts/gpu_train_check.sh BUNDLE_DIR OUT_DIR [dense|hybrid]
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bundle=$1
out=$2
kind=${3:-dense}
work=$(mktemp -d)
mkdir -p "$out"
pack() { (cd "$out" && tar czf "$work/logs.tgz" . && find . -mindepth 1 -delete && mv "$work/logs.tgz" .); }
trap pack EXIT

case "$kind" in
dense)
  cat > "$work/make.json" <<EOF
{"mode": "make", "model_dir": "$work/target", "seed": 1,
 "config": {"vocab_size": 768, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": false}}
EOF
  python3 "$bundle/target_torch.py" "$work/make.json" > /dev/null
  ;;
hybrid)
  cat > "$work/make.json" <<EOF
{"mode": "make", "model_dir": "$work/target", "seed": 1,
 "config": {"vocab_size": 768, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
            "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
            "linear_num_key_heads": 1, "linear_num_value_heads": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
            "tie_word_embeddings": false}}
EOF
  python3 "$bundle/target_hybrid_torch.py" "$work/make.json" > /dev/null
  ;;
*)
  echo "KIND: dense or hybrid, not $kind"
  exit 2
  ;;
esac
cp fixtures/data/tokenizer-qwen/* "$work/target/"

args() { # args OUT STEP EXTRA...: the options of one training run into OUT (EXTRA's options
  # replace these defaults: the CLI refuses an option given twice)
  local dir=$1 step=$2 defaults=(--max-len 512 --anchors 64 --eval-rows 4) kept=() i
  shift 2
  for ((i = 0; i < ${#defaults[@]}; i += 2)); do
    [[ " $* " == *" ${defaults[i]} "* ]] || kept+=("${defaults[i]}" "${defaults[i + 1]}")
  done
  echo train --target "$work/target" --data fixtures/data/conversations.jsonl \
    --data-cache "$work/cache" --out "$dir" --step "$step" "${kept[@]}" \
    --target-layer-ids 1,2 --held-out 0.2 --lr 3e-3 --log-every 1 --eval-every 20 \
    --checkpoint-every 20 --keep-checkpoints 2 "$@"
}
run() { "$bundle/xtask" $(args "$@"); }

# The whole run also measures the real tau at each evaluation with the GPU's cached decoders.
run "$work/whole" gpu --steps 60 --tau-prompts 2 --tau-tokens 24 > "$out/whole.log"
# The killed run: checkpoints slowed down (a pause between their files) so that the kill can
# land anywhere after the first one, a checkpoint's writing included.
DFLASH_TEST_PAUSE_IN_CHECKPOINT=40 "$bundle/xtask" $(args "$work/killed" gpu --steps 60) > "$out/killed.log" 2>&1 &
pid=$!
while [ ! -e "$work/killed/checkpoint-20/state.json" ]; do
  kill -0 "$pid" 2> /dev/null || { echo "the run ended before its first checkpoint"; exit 1; }
  sleep 0.01
done
sleep 0.$((RANDOM % 5))$((RANDOM % 10))
kill -9 "$pid"
wait "$pid" 2> /dev/null || true
echo "killed with $(ls -d "$work"/killed/checkpoint-* "$work"/killed/.checkpoint-* 2> /dev/null | xargs -n1 basename | tr '\n' ' ')"
"$bundle/xtask" train --resume "$work/killed" > "$out/resumed.log"
# Shorter rows and fewer anchors for the comparison: the CPU twins run single-threaded.
run "$work/gpu3" gpu --steps 3 --eval-rows 1 --max-len 256 --anchors 16 > "$out/gpu3.log"
run "$work/host" host --steps 3 --eval-rows 1 --max-len 256 --anchors 16 > "$out/host.log"
eval_args="--target $work/target --drafter $work/whole/drafter --prompts fixtures/data/conversations.jsonl --max-prompts 4 --max-new-tokens 32"
"$bundle/xtask" eval $eval_args --device gpu --out "$out/eval-gpu.json" > "$out/eval-gpu.log"
"$bundle/xtask" eval $eval_args --device cpu --out "$out/eval-cpu.json" > "$out/eval-cpu.log"
if [ "$kind" = hybrid ]; then
  "$bundle/xtask" features --device gpu --target "$work/target" --data fixtures/data/conversations.jsonl \
    --cache "$work/cache" --out "$work/features" --max-len 256 --layer-ids 1,2 --held-out 0.2 > "$out/features.log"
  run "$work/offline3" gpu --steps 3 --eval-rows 1 --max-len 256 --anchors 16 --features "$work/features" \
    > "$out/offline3.log"
fi
cp "$work/whole/metrics.jsonl" "$out/whole-metrics.jsonl"
cp "$work/killed/metrics.jsonl" "$out/resumed-metrics.jsonl"
cp "$work/host/metrics.jsonl" "$out/host-metrics.jsonl"

python3 - "$work" "$out" "$kind" <<'EOF'
import json, sys
work, kind = sys.argv[1], sys.argv[3]
def losses(name):
    # The loss's text as written (parsed exactly), per step.
    out = {}
    for line in open(f"{work}/{name}/metrics.jsonl"):
        v = json.loads(line)
        if v["kind"] == "train":
            out[v["step"]] = v["loss"]
    return out
whole, resumed, host, gpu3 = losses("whole"), losses("killed"), losses("host"), losses("gpu3")
assert len(whole) == 60 and sorted(resumed) == sorted(whole), (len(whole), sorted(resumed))
diff = [s for s in whole if whole[s] != resumed[s]]
print(f"killed and resumed: {60 - len(diff)}/60 losses bitwise equal to the uninterrupted run")
worst = max(abs(host[s] - gpu3[s]) / abs(host[s]) for s in host)
print(f"GPU vs CPU twins f32, first {len(host)} losses: worst relative difference {worst:.2e} (bound 2e-2)")
evals = [json.loads(l) for l in open(f"{work}/whole/metrics.jsonl") if '"eval"' in l]
print("held-out:", " -> ".join(f"loss {e['loss']:.3f} tau_hat {e['tau_hat']:.3f} real tau {(e.get('tau') or float('nan')):.3f}"
                               for e in evals))
first, last = whole[0], whole[59]
print(f"training loss {first:.3f} -> {last:.3f}")
worst_offline = 0.0
if kind == "hybrid":
    offline = losses("offline3")
    worst_offline = max(abs(offline[s] - gpu3[s]) / abs(gpu3[s]) for s in offline)
    print(f"from the GPU feature cache vs online, first {len(offline)} losses: worst relative difference "
          f"{worst_offline:.2e} (bound 2e-2)")
out_dir = sys.argv[2]
gpu_eval, cpu_eval = (json.load(open(f"{out_dir}/eval-{d}.json")) for d in ("gpu", "cpu"))
same = sum(a["tokens"] == b["tokens"] for a, b in zip(gpu_eval["per_prompt"], cpu_eval["per_prompt"]))
print(f"eval: GPU tau {gpu_eval['tau_over_steps']:.3f} at {gpu_eval['spec_tokens_per_s']:.1f} tokens/s "
      f"(plain {gpu_eval['plain_tokens_per_s']:.1f}), CPU reference tau {cpu_eval['tau_over_steps']:.3f}; "
      f"identical to greedy: GPU {gpu_eval['all_identical_to_plain']}, CPU {cpu_eval['all_identical_to_plain']}; "
      f"{same}/{len(gpu_eval['per_prompt'])} prompts with the same tokens on both")
sys.exit(1 if diff or worst > 2e-2 or worst_offline > 2e-2 or not cpu_eval["all_identical_to_plain"] else 0)
EOF
