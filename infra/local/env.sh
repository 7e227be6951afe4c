#!/usr/bin/env bash
# Prints `export ...` lines for clients of the running local services:  eval "$(infra/local/env.sh)"
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
exec "$root/.venv/bin/python" -m dspark.services env "$@"
