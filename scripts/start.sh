#!/usr/bin/env bash
# Start the daemon on conf/config.json (or --config-file PATH); creates .venv on first run.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv ""
cd "$ROOT"
exec "$VENV/bin/python" -m server "$@"
