#!/usr/bin/env bash
# start the project's local services (object store, Ray head, MLflow server) — see platform/dspark/services.py.
#   infra/local/start.sh [objectstore] [ray] [mlflow]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
export PYTHONPATH="$root/platform${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's library and state
exec "$root/.venv/bin/python" -m dspark.services start "$@"
