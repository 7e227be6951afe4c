#!/usr/bin/env bash
# stop the project's local services (object store, Ray head, MLflow server) — see platform/dspark/services.py.
#   infra/local/stop.sh [objectstore] [ray] [mlflow]
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
exec "$root/.venv/bin/python" -m dspark.services stop "$@"
