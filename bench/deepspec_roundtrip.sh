#!/usr/bin/env bash
# Export drafters in DeepSpec's layout (jobs/export.py --layout deepspec --reference, float32) and load
# each with DeepSpec's own model classes (bench/deepspec_check.py), checking that they reproduce our draft
# and confidence logits. DEEPSPEC_SRC: a checkout of github.com/deepseek-ai/DeepSpec.
#     DEEPSPEC_SRC=~/src/DeepSpec bench/deepspec_roundtrip.sh DRAFTER_URI [DRAFTER_URI ...]
#     CONFIG=configs/smollm2.yaml EXPORT_ARGS="--set target.dtype=float32" DEEPSPEC_SRC=... \
#         bench/deepspec_roundtrip.sh .local/store/drafters/smollm2-dspark
# (the verifier is loaded in float32: a bfloat16 target's reference features differ from it by rounding)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/exports-deepspec}
status=0
for drafter in "$@"; do
    out="$OUT/$(basename "$drafter")"
    if ! .venv/bin/python jobs/export.py ${CONFIG:+--config "$CONFIG"} --drafter "$drafter" --out "$out" \
        --layout deepspec --dtype float32 --reference ${EXPORT_ARGS:-}; then
        status=1
        continue
    fi
    .venv/bin/python bench/deepspec_check.py "$out" --deepspec-src "${DEEPSPEC_SRC:?a DeepSpec checkout}" || status=1
done
exit $status
