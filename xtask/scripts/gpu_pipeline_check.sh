#!/usr/bin/env bash
# On the GPU machine (from the repository root): the pipeline of spec section 9 on one GPU, a
# target worker and a drafter worker sharing GPU 0 (`--gpus 0,0 --target-workers 1`: the target
# on a stream of its own, its features copied from its slots into the step, the gradients summed
# through NCCL with one rank), against the single-GPU trainer (the drafter's engine running the
# target itself). transformers makes two random Qwen3 targets with the fixture tokenizer (vocab
# 768): "small", 12 layers of hidden 2048 (heads of 128), rows of 2048 tokens and 256 anchors;
# "8b-layers", 8 layers of Qwen3-8B's shape (hidden 4096, 32 heads, 8 KV heads, MLP 12288), rows
# of 3072 tokens and 512 anchors (the recipe's). Each pair of runs trains 16 steps of 4 rows.
# On a machine with two GPUs or more, a third run puts the target worker on GPU 1 and the drafter
# on GPU 0 (`--gpus 1,0 --target-workers 1`: the features copied peer to peer).
# Checks: the losses are bitwise equal (the same bf16 features and kernels), and the pipeline's
# samples/s (median of steps 4.., after warm-up) are no lower than the single trainer's (2%:
# the run-to-run spread of one configuration on a shared machine). Writes OUT_DIR/pipeline.json.
# usage: xtask/scripts/gpu_pipeline_check.sh BUNDLE_DIR OUT_DIR [CASE...] (default: both)
set -euo pipefail
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
bundle=$1
out=$2
shift 2
cases=("$@")
[ $# -eq 0 ] && cases=(small 8b-layers)
work=$(mktemp -d)
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0
topologies=(single pipeline)
visible=$(nvidia-smi -L | wc -l)
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then visible=$(echo "$CUDA_VISIBLE_DEVICES" | tr ',' '\n' | wc -l); fi
if [ "$visible" -ge 2 ]; then topologies+=(apart); fi

case_run() { # case_run NAME HIDDEN MLP HEADS KV LAYERS IDS S N
  local name=$1 hidden=$2 mlp=$3 heads=$4 kv=$5 layers=$6 ids=$7 s=$8 n=$9
  mkdir -p "$work/$name"
  printf '%s' "{\"mode\": \"make\", \"model_dir\": \"$work/$name/target\", \"seed\": 3,
    \"config\": {\"vocab_size\": 768, \"hidden_size\": $hidden, \"intermediate_size\": $mlp,
    \"num_hidden_layers\": $layers, \"num_attention_heads\": $heads, \"num_key_value_heads\": $kv,
    \"head_dim\": 128, \"max_position_embeddings\": 8192, \"rms_norm_eps\": 1e-6,
    \"rope_theta\": 1000000.0, \"tie_word_embeddings\": false}}" > "$work/$name/make.json"
  python3 "$bundle/target_torch.py" "$work/$name/make.json" > /dev/null
  cp fixtures/data/tokenizer-qwen/* "$work/$name/target/"
  for topology in "${topologies[@]}"; do
    local extra=()
    if [ "$topology" = pipeline ]; then extra=(--gpus 0,0 --target-workers 1); fi
    if [ "$topology" = apart ]; then extra=(--gpus 1,0 --target-workers 1); fi
    "$bundle/xtask" train --target "$work/$name/target" --data fixtures/data/conversations.jsonl \
      --data-cache "$work/$name/cache" --out "$work/$name/$topology" --step gpu --max-len "$s" \
      --anchors "$n" --target-layer-ids "$ids" --held-out 0.1 --steps 16 --rows-per-step 4 \
      --log-every 1 --eval-every 1000 --eval-rows 2 --checkpoint-every 1000 "${extra[@]}" \
      > "$out/$name-$topology.log"
    cp "$work/$name/$topology/metrics.jsonl" "$out/$name-$topology-metrics.jsonl"
    # The final checkpoint and drafter (16.5 GB for the 8b-layers drafter) are not checked: the
    # disk (64 GiB) would not hold every run's.
    rm -rf "$work/$name/$topology"/checkpoint-* "$work/$name/$topology/drafter"
  done
}
for c in "${cases[@]}"; do
  case $c in
    small) case_run small 2048 6144 16 8 12 1,4,7,10 2048 256 ;;
    8b-layers) case_run 8b-layers 4096 12288 32 8 8 1,3,5,6 3072 512 ;;
    *) echo "unknown case $c" >&2; exit 2 ;;
  esac
done
python3 xtask/scripts/pipeline_report.py "$work" "$out" "$bundle" "${cases[@]}"
