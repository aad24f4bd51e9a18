#!/usr/bin/env bash
# Run the whole test suite; creates .venv (with the test extra) on first run.
# Extra arguments go to pytest.  Exit code is pytest's.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv "test"
cd "$ROOT"
export PYTHONDONTWRITEBYTECODE=1
exec "$VENV/bin/python" -m pytest "$@"
