#!/usr/bin/env bash
# Run scripts/bench.py in .venv with the `bench` extra (httpx, transformers, matplotlib);
# creates or completes the virtualenv on first run.  Arguments go to bench.py.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv "bench"
cd "$ROOT"
exec "$VENV/bin/python" scripts/bench.py "$@"
