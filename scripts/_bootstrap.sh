# Sourced by start.sh, test.sh and bench.sh: create .venv on first run and install the project.
# Usage: bootstrap_venv [EXTRAS]   (EXTRAS like "test" or "test,bench")
#
# torch comes first, so that the project's "torch>=2.4" is already satisfied.  On a
# machine without a working nvidia-smi it is the CPU build: plain pip would resolve the
# CUDA build on Linux (several GB of nvidia-* packages that a CPU cannot use).
#   MTP_TORCH_BUILD   auto (default: cuda when nvidia-smi works, else cpu), cpu or cuda
#   TORCH_CPU_INDEX   PyTorch's CPU wheel index (default https://download.pytorch.org/whl/cpu)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${MTP_VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3}"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

torch_build() {
    case "${MTP_TORCH_BUILD:-auto}" in
        cpu|cuda) echo "$MTP_TORCH_BUILD" ;;
        auto) if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
                  echo cuda
              else
                  echo cpu
              fi ;;
        *) echo "[bootstrap] MTP_TORCH_BUILD=$MTP_TORCH_BUILD; allowed: auto, cpu, cuda" >&2
           return 2 ;;
    esac
}

# True when the CPU index answers within 5 s.  Where it cannot be reached (offline
# mirrors, firewalls) this fails at once or after 5 s, not after pip's minutes of retries.
index_reachable() {
    "$PY" - "$1" >/dev/null 2>&1 <<'EOF'
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
EOF
}

install_torch() {
    local pip="$VENV/bin/pip" build
    build="$(torch_build)"
    if [ "$build" = cuda ]; then
        echo "[bootstrap] GPU found: installing torch $TORCH_VERSION (CUDA build, default index)" >&2
        "$pip" install -q "torch==$TORCH_VERSION" >&2
    elif index_reachable "$TORCH_CPU_INDEX"; then
        # --extra-index-url keeps the configured index for torch's own dependencies; the
        # CPU index's "+cpu" build wins over the default index's CUDA build of the same version.
        echo "[bootstrap] no GPU: installing the CPU build of torch $TORCH_VERSION from $TORCH_CPU_INDEX" >&2
        "$pip" install -q --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION" >&2
    else
        echo "[bootstrap] no GPU, and $TORCH_CPU_INDEX is not reachable: installing torch" \
             "$TORCH_VERSION from the configured index (a CPU build only if it offers one)" >&2
        "$pip" install -q "torch==$TORCH_VERSION" >&2
    fi
}

bootstrap_venv() {
    local extras="${1:-}"
    local stamp="$VENV/.installed${extras:+-$extras}"
    # A venv without pip is one whose creation was interrupted: made again from scratch.
    if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/pip" ]; then
        echo "[bootstrap] creating virtualenv at $VENV" >&2
        "$PY" -m venv --clear "$VENV"
    fi
    # Reinstall only when pyproject.toml changed since the last install.
    if [ ! -f "$stamp" ] || [ "$ROOT/pyproject.toml" -nt "$stamp" ]; then
        if ! "$VENV/bin/python" -c 'import torch' >/dev/null 2>&1; then
            install_torch
        fi
        local spec="$ROOT"
        [ -n "$extras" ] && spec="$ROOT[$extras]"
        echo "[bootstrap] installing project ${extras:+with extras [$extras]}" >&2
        "$VENV/bin/pip" install -q -e "$spec" >&2
        touch "$stamp"
    fi
}
