#!/usr/bin/env bash
# The best SmolLM2-135M-Instruct drafter measured (docs/smollm2.md, the "math5" rows), rebuilt in one
# resumable command: eight caches of the target's answers, joined as they grow, and eight training stages,
# each warm-started from the one before; then a batch-1 cost profile and the evaluation at T=0 with static
# verification and the greedy prefix scheduler (tau and speedup on humaneval and gsm8k).
#
#   1. answers to the 792 committed training prompts (Arena-Hard, LiveCodeBench, LBPP, SWE-bench, AIME);
#      1,607 steps from the target's top layers (lr 1e-3, the comparison bench's)
#   2-3. a second and a third answer to each (seeds 1, 2), joined; 800 and 1,000 steps at lr 3e-4
#   4-8. answers to the 484 MATH-500 prompts outside the evaluated subset (seeds 0-4), joined one seed at a
#      time; 1,000, 1,000, 1,000, 600 and 600 steps at lr 3e-4
#
#     bench/smollm2_drafter.sh                          # about 7.5 h on a 2-core AVX-512-BF16 host
#     EXAMPLES=3 STEPS_SCALE=0.01 PROMPTS=1 ROOT=/tmp/chain/store OUT=/tmp/chain/out bench/smollm2_drafter.sh  # < 20 min
#     bench/smollm2_drafter.sh --set target.threads=16  # overrides for every step
# Rerunning skips what is finished: a cache with its manifest, a stage with its drafter (a cache build that
# was stopped resumes from its finished shards; a stopped training stage starts over).
# Sizes: EXAMPLES conversations per training source (0 = all), STEPS_SCALE multiplies every stage's steps,
# PROMPTS per evaluation set. ROOT is the storage root the caches go under (a folder, or s3://BUCKET/PREFIX
# with the store's endpoint in the environment: a rerun then asks the build, which skips published shards),
# OUT the drafters' and results' folder. Bash 3.2 or later.
# DRY=1 prints the commands instead of running them (tests/unit/test_smollm2_drafter.py checks the chain).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROOT=${ROOT:-.local/store}
OUT=${OUT:-results/chain-smollm2}
EXAMPLES=${EXAMPLES:-0}
STEPS_SCALE=${STEPS_SCALE:-1}
PROMPTS=${PROMPTS:-12}
mkdir -p "$OUT"
C=(--config configs/smollm2.yaml --set "storage.root=$ROOT")
USER_SETS=("$@")  # the caller's overrides last in every command: they win
CACHE=(--set cache.max_examples="$EXAMPLES" --set cache.max_new_tokens=128 --set cache.batch_size=32
    --set cache.shard_rows=64)
INDOMAIN='[data/prompts/train/arena-hard-v2.jsonl,data/prompts/train/livecodebench.jsonl,data/prompts/train/lbpp.jsonl,data/prompts/train/swe-bench.jsonl,data/prompts/train/aime24.jsonl,data/prompts/train/aime25.jsonl]'
MATH='[data/prompts/train/math500-rest.jsonl]'
t0=$SECONDS
stamp() { [[ -n ${DRY:-} ]] || echo "[smollm2_drafter.sh] $1 done at $((SECONDS - t0)) s"; }
run() { if [[ -n ${DRY:-} ]]; then printf '%q ' "$@" && echo; else "$@"; fi; }

# build NAME SOURCES SEED: the target's answers to SOURCES, sampled with SEED
build() {
    [[ -f $ROOT/caches/$1/manifest.json ]] && return
    run "$PY" jobs/build_cache.py "${C[@]}" "${CACHE[@]}" --set "cache.name=$1" --set "cache.sources=$2" \
        --set "cache.seed=$3" ${USER_SETS[@]+"${USER_SETS[@]}"}
    stamp "cache $1"
}
# join_caches NAME A B: caches A and B as one (their shards copied; no target)
join_caches() {
    [[ -f $ROOT/caches/$1/manifest.json ]] && return
    run "$PY" jobs/build_cache.py "${C[@]}" --set "cache.name=$1" \
        --set "cache.source_uri=[$ROOT/caches/$2,$ROOT/caches/$3]" ${USER_SETS[@]+"${USER_SETS[@]}"}
    stamp "cache $1"
}
# scaled N: N x STEPS_SCALE, at least 1
scaled() { awk -v n="$1" -v k="$STEPS_SCALE" 'BEGIN { m = int(n * k + 0.5); print (m < 1 ? 1 : m) }'; }
# train STAGE CACHE STEPS EVERY [FROM LR]: DSpark (2 layers, gamma 7) on CACHE, held-out tau every EVERY steps
# (a tenth of the cache's rows held out), from the target's top layers or warm from stage FROM at LR
train() {
    [[ -f $OUT/$1/dspark/model.safetensors ]] && return
    local warm=()
    [[ $# -gt 4 ]] && warm=(--set "train.warm_start=$OUT/$5/dspark" --set "train.lr=$6")
    run "$PY" bench/drafter_comparison.py "${C[@]}" --cache "$ROOT/caches/$2" --steps "$(scaled "$3")" \
        --curve-every "$(scaled "$4")" --variants dspark --train-only --out "$OUT/$1" \
        --set train.global_batch=8 --set train.micro_batch=4 ${warm[@]+"${warm[@]}"} ${USER_SETS[@]+"${USER_SETS[@]}"}
    stamp "stage $1 ($(scaled "$3") steps on $2)"
}

build smollm2-indomain "$INDOMAIN" 0
train top smollm2-indomain 1607 400
build smollm2-indomain-s1 "$INDOMAIN" 1
join_caches smollm2-indomain-2seeds smollm2-indomain smollm2-indomain-s1
train seeds2 smollm2-indomain-2seeds 800 400 top 3e-4
build smollm2-indomain-s2 "$INDOMAIN" 2
join_caches smollm2-indomain-3seeds smollm2-indomain-2seeds smollm2-indomain-s2
train seeds3 smollm2-indomain-3seeds 1000 500 seeds2 3e-4
build smollm2-math500-rest "$MATH" 0
join_caches smollm2-indomain-3seeds-math smollm2-indomain-3seeds smollm2-math500-rest
train math smollm2-indomain-3seeds-math 1000 500 seeds3 3e-4
prev=math
for k in 2 3 4 5; do  # the math prompts' k-th answers (seed k - 1)
    build "smollm2-math500-rest-s$((k - 1))" "$MATH" $((k - 1))
    join_caches "smollm2-indomain-3seeds-math$k" "smollm2-indomain-3seeds-math${prev#math}" "smollm2-math500-rest-s$((k - 1))"
    if ((k < 4)); then train "math$k" "smollm2-indomain-3seeds-math$k" 1000 500 "$prev" 3e-4
    else train "math$k" "smollm2-indomain-3seeds-math$k" 600 300 "$prev" 3e-4; fi
    prev=math$k
done

# the batch-1 cost table the greedy prefix scheduler prices rounds with, then the evaluation at T=0
run "$PY" jobs/profile_sps.py "${C[@]}" --drafter "$OUT/math5/dspark" --out "$OUT/sps-b1.json" \
    --batches 1,2,3,4,5,6,7,8 --max-requests 1 --context 256 ${USER_SETS[@]+"${USER_SETS[@]}"}
stamp "profile"
run "$PY" jobs/evaluate.py "${C[@]}" --drafter "math5=$OUT/math5/dspark" --set "eval.out_dir=$OUT/eval" \
    --set "eval.temperatures=[0.0]" --set "eval.prompts_per_domain=$PROMPTS" \
    --set "eval.prompt_sets={humaneval: data/prompts/eval/humaneval.jsonl, gsm8k: data/prompts/eval/gsm8k.jsonl}" \
    --set eval.policy=greedy --set "eval.sps_table=$OUT/sps-b1.json" ${USER_SETS[@]+"${USER_SETS[@]}"}
stamp "evaluation ($OUT/eval/results.md)"
