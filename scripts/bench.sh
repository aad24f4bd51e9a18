#!/usr/bin/env bash
# Run the serving benchmark (python -m benchmarks.serve) in .venv with the `bench` extra
# (httpx, transformers, matplotlib); creates or completes the virtualenv on first run.
# Arguments go to benchmarks.serve (--help lists them).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv "bench"
cd "$ROOT"
exec "$VENV/bin/python" -m benchmarks.serve "$@"
