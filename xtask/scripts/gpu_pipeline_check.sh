#!/usr/bin/env bash
# On the GPU machine (from the repository root): the pipeline of spec section 9 on one GPU, a
# target worker and a drafter worker sharing GPU 0 (`--gpus 0,0 --target-workers 1`: the target
# on a stream of its own, its features read in place from its slots, the gradients all-reduced
# through NCCL with one rank), against the single-GPU trainer (the drafter's engine running the
# target itself). transformers makes a random Qwen3 target of 12 layers, hidden 2048 (heads of
# 128) with the fixture tokenizer; both runs train 16 steps of 4 rows of 2048 tokens, 256
# anchors. Checks: the losses are bitwise equal (the same bf16 features and kernels), and the
# pipeline's samples/s (steps 4.., after warm-up) are no lower. Writes OUT_DIR/pipeline.json.
# usage: xtask/scripts/gpu_pipeline_check.sh BUNDLE_DIR OUT_DIR
set -euo pipefail
bundle=$1
out=$2
work=$(mktemp -d)
mkdir -p "$out"

cat > "$work/make.json" <<EOF
{"mode": "make", "model_dir": "$work/target", "seed": 3,
 "config": {"vocab_size": 768, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 12,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
            "tie_word_embeddings": false}}
EOF
python3 "$bundle/target_torch.py" "$work/make.json" > /dev/null
cp fixtures/data/tokenizer-qwen/* "$work/target/"

run() { # run OUT EXTRA...: one training run into OUT
  local dir=$1
  shift
  "$bundle/xtask" train --target "$work/target" --data fixtures/data/conversations.jsonl \
    --data-cache "$work/cache" --out "$dir" --step gpu --max-len 2048 --anchors 256 \
    --target-layer-ids 1,4,7,10 --held-out 0.1 --steps 16 --rows-per-step 4 --log-every 1 \
    --eval-every 1000 --eval-rows 2 --checkpoint-every 1000 "$@"
}
run "$work/single" > "$out/single.log"
run "$work/pipeline" --gpus 0,0 --target-workers 1 > "$out/pipeline.log"
cp "$work/single/metrics.jsonl" "$out/single-metrics.jsonl"
cp "$work/pipeline/metrics.jsonl" "$out/pipeline-metrics.jsonl"

python3 - "$work" "$out" <<'EOF'
import json, statistics, sys
work, out = sys.argv[1], sys.argv[2]
def train(name):
    return [v for v in map(json.loads, open(f"{work}/{name}/metrics.jsonl")) if v["kind"] == "train"]
single, pipeline = train("single"), train("pipeline")
same = sum(a["loss"] == b["loss"] for a, b in zip(single, pipeline))
rate = lambda lines: statistics.median(v["samples_per_s"] for v in lines[4:])
waits = [(v["drafters_waited_s"], v["targets_waited_s"]) for v in pipeline[4:]]
result = {
    "steps": len(single), "losses_bitwise_equal": same, "single_samples_per_s": rate(single),
    "pipeline_samples_per_s": rate(pipeline), "ratio": rate(pipeline) / rate(single),
    "pipeline_drafters_waited_s_per_step": statistics.median(w[0] for w in waits),
    "pipeline_targets_waited_s_per_step": statistics.median(w[1] for w in waits),
    "first_loss": single[0]["loss"], "last_loss": single[-1]["loss"],
}
json.dump(result, open(f"{out}/pipeline.json", "w"), indent=1)
print(f"losses bitwise equal: {same}/{len(single)}; loss {result['first_loss']:.4f} -> {result['last_loss']:.4f}")
print(f"samples/s (median of steps 4..): single {result['single_samples_per_s']:.2f}, "
      f"pipeline {result['pipeline_samples_per_s']:.2f} (x{result['ratio']:.3f}); per step the drafter waited "
      f"{result['pipeline_drafters_waited_s_per_step']:.3f} s, the target {result['pipeline_targets_waited_s_per_step']:.3f} s")
sys.exit(0 if same == len(single) == len(pipeline) and result["ratio"] >= 0.98 else 1)
EOF
