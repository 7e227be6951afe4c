#!/usr/bin/env bash
# Prints `export ...` lines for clients of the running local services:  eval "$(infra/local/env.sh)"
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
export PYTHONPATH="$root/platform${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's library and state
exec "$root/.venv/bin/python" -m dspark.services env "$@"
