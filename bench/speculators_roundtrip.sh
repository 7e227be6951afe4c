#!/usr/bin/env bash
# Export drafters (jobs/export.py --reference) and load each with the speculators package in its own
# venv (it pins transformers <= 5.19; made once under .local/venvs/speculators), checking that it
# reproduces our draft and confidence logits and that the exported aux ids pick our tapped layers.
#     bench/speculators_roundtrip.sh DRAFTER_URI [DRAFTER_URI ...]
#     CONFIG=configs/smollm2.yaml DTYPE=float32 EXPORT_ARGS="--set target.dtype=float32" \
#         bench/speculators_roundtrip.sh .local/store/drafters/smollm2-dspark
# (the verifier is loaded in float32: a bfloat16 target's reference features differ from it by rounding)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SPECULATORS_VENV:-.local/venvs/speculators}
OUT=${OUT:-results/exports}
DTYPE=${DTYPE:-bfloat16}
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.13.0 speculators==0.9.0
    # the torchvision/torchaudio builds pip pulls in do not match the CPU torch and break transformers' imports
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio
fi
status=0
for drafter in "$@"; do
    out="$OUT/$(basename "$drafter")-$DTYPE"
    if ! .venv/bin/python jobs/export.py ${CONFIG:+--config "$CONFIG"} --drafter "$drafter" --out "$out" \
        --dtype "$DTYPE" --reference ${EXPORT_ARGS:-}; then
        status=1
        continue
    fi
    env -u PYTHONPATH "$VENV/bin/python" bench/speculators_check.py "$out" 2>&1 | grep -v " | INFO \| | WARNING \|Loading weights" || status=1
done
exit $status
