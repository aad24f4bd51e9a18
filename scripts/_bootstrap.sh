# Sourced by start.sh and test.sh: create .venv on first run and install the project.
# Usage: bootstrap_venv [EXTRAS]   (EXTRAS like "test" or "test,bench")
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MTP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"

bootstrap_venv() {
    local extras="${1:-}"
    local stamp="$VENV/.installed${extras:+-$extras}"
    if [ ! -x "$VENV/bin/python" ]; then
        echo "[bootstrap] creating virtualenv at $VENV" >&2
        "$PY" -m venv "$VENV"
    fi
    # Reinstall only when pyproject.toml changed since the last install.
    if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
        if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
                echo "[bootstrap] GPU found: installing torch 2.13.0 (build chosen by pip)" >&2
                "$VENV/bin/pip" install -q torch==2.13.0 >&2
            else
                # On CPU machines this resolves to the CPU wheel; never pull a CUDA build here.
                echo "[bootstrap] no GPU: installing CPU torch 2.13.0" >&2
                "$VENV/bin/pip" install -q torch==2.13.0 >&2
            fi
        fi
        local spec="$ROOT"
        [ -n "$extras" ] && spec="$ROOT[$extras]"
        echo "[bootstrap] installing project ${extras:+with extras [$extras]}" >&2
        "$VENV/bin/pip" install -q -e "$spec" >&2
        touch "$stamp"
    fi
}
