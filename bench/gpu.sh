#!/usr/bin/env bash
# SmolLM2-135M-Instruct end to end on one CUDA GPU in a few minutes, printing what it measured:
#   1. the target: GGUF conversion and load times, target-only tokens/s at batch 1 and 16 (bfloat16);
#   2. a small target cache (the config's training prompts) and a DSpark drafter trained on it
#      (1 worker, DeepSpeed ZeRO-2, bf16), then its tau beside the oracle bound and its speedup over
#      target-only decoding at batch 1 on the config's evaluation prompt sets (results.md);
#   3. SPS(B), the target's verification steps/s at B tokens, and t_d(R), the drafting round.
#
#     make install TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cu128"   # once
#     bench/gpu.sh                                  # everything under results/gpu (OUT=...)
#     DEVICE=cpu STEPS=20 EXAMPLES=2 PROMPTS=2 bench/gpu.sh     # the same path on a CPU machine
#     bench/gpu.sh --set "eval.prompt_sets={humaneval: data/prompts/eval/humaneval.jsonl}"   # more overrides
# Sizes: EXAMPLES conversations per training source, STEPS training steps, PROMPTS per evaluation set;
# SPEED=0 skips step 1.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-results/gpu}
EXAMPLES=${EXAMPLES:-16}
STEPS=${STEPS:-300}
PROMPTS=${PROMPTS:-8}
SPEED=${SPEED:-1}
RUN=gpu-dspark
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STORE="file://$OUT/store"  # no object store needed: a local folder is a storage root too
C=(
    --config configs/smollm2.yaml
    --set "storage.root=$STORE"
    --set "mlflow.tracking_uri=sqlite:///$OUT/mlflow.db"
    --set "eval.out_dir=$OUT"
    --set "cache.max_examples=$EXAMPLES"
    --set "train.run_name=$RUN"
    --set "train.max_steps=$STEPS"
    --set "train.checkpoint_every=100"
    --set "train.gamma=7"
    --set "train.num_layers=2"
    --set "train.markov_rank=256"
    --set "eval.prompts_per_domain=$PROMPTS"
    --set "eval.calibration_prompts_per_domain=$PROMPTS"
    --set "eval.temperatures=[0.0,1.0]"
)
if [[ $DEVICE == cuda* ]]; then
    C+=(
        --set "target.device=$DEVICE"
        --set target.dtype=bfloat16
        --set target.threads=0
        --set cache.num_gpus_per_actor=1
        --set cache.batch_size=32
        --set cache.max_new_tokens=128
        --set train.gpus_per_worker=1
        --set train.bf16=true
        --set train.num_workers=1
        --set train.global_batch=16
        --set train.micro_batch=16
    )
    DTYPES=bfloat16
else
    DTYPES=float32
fi
C+=("$@")  # the caller's overrides last: they win
t0=$SECONDS
stamp() { echo "[gpu.sh] $1 done at $((SECONDS - t0)) s"; }
"$PY" -c "import torch; print('[gpu.sh] torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
if [[ $SPEED != 0 ]]; then
    "$PY" bench/target_speed.py "${C[@]}" --dtypes "$DTYPES" --repeats 5 --max-new 32
    stamp "target speed"
fi
"$PY" jobs/train_dspark.py "${C[@]}"
stamp "cache, training and evaluation"
"$PY" jobs/profile_sps.py "${C[@]}" --drafter "$STORE/drafters/$RUN" --out "$OUT/sps.json" \
    --batches 1,2,4,8,16,32,64 --repeats 5
stamp "SPS(B) and t_d(R)"
