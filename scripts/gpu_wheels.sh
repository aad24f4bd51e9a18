#!/usr/bin/env bash
# Download, on a machine with network, the wheels the GPU image lacks into .whl/ (not
# tracked: listed in .git/info/exclude), for CPython 3.12 x86_64 manylinux.
# scripts/gpu_check.sh installs them there (pip --no-index --no-deps --target /tmp/site).
#
# Each package is pinned to the version installed in .venv (so the GPU run uses what the
# tests here use); a package the venv lacks is left unpinned.  --no-deps: the list below
# is the whole runtime closure of the daemon, benchmarks.serve and benchmarks.engine_step,
# the engine tests and pytest, minus what the torch image already carries (torch, its CUDA
# wheels, sympy, networkx, numpy).
#
# Env: PYVER (default 3.12), WHL_DIR (default .whl), PYTHON (default python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYVER="${PYVER:-3.12}"
WHL_DIR="${WHL_DIR:-.whl}"
PYTHON="${PYTHON:-python3}"

PACKAGES=(
  # serving (pyproject dependencies) and their imports
  fastapi starlette uvicorn h11 click pydantic pydantic-core annotated-types
  typing-inspection typing-extensions annotated-doc opentelemetry-api
  orjson prometheus-client safetensors tokenizers jinja2 markupsafe
  # tokenizers -> huggingface-hub (imported lazily; small)
  huggingface-hub hf-xet filelock fsspec pyyaml tqdm packaging
  # HTTP clients: benchmarks/ (httpx), tests/daemon (openai -> httpx2)
  httpx httpcore anyio sniffio idna certifi
  openai distro jiter httpx2 httpcore2 truststore
  # test runner
  pytest pluggy iniconfig pygments pytest-timeout
)

# name==version from the venv, keyed by the normalised name (PEP 503).
declare -A PINNED=()
if [[ -x .venv/bin/python ]]; then
  while IFS='=' read -r name _ version; do
    [[ -n "$name" && -n "$version" ]] || continue
    key="$(echo "$name" | tr 'A-Z_.' 'a-z--')"
    PINNED[$key]="$version"
  done < <(.venv/bin/python -m pip list --format=freeze 2>/dev/null | grep '==')
fi

mkdir -p "$WHL_DIR"
failed=()
for pkg in "${PACKAGES[@]}"; do
  key="$(echo "$pkg" | tr 'A-Z_.' 'a-z--')"
  spec="$pkg"
  [[ -n "${PINNED[$key]:-}" ]] && spec="$pkg==${PINNED[$key]}"
  # Pure-python wheels (py3-none-any) match these flags too.
  if ! "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
      --python-version "$PYVER" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$WHL_DIR" "$spec" 2> >(grep -v "neither a file nor a directory" >&2 || true); then
    failed+=("$spec")
  fi
done

# Keep the wheels out of git (info/exclude is per clone, not tracked).
EXCLUDE="$(git rev-parse --git-path info/exclude 2>/dev/null || echo .git/info/exclude)"
mkdir -p "$(dirname "$EXCLUDE")"
touch "$EXCLUDE"
grep -qxF '.whl/' "$EXCLUDE" || echo '.whl/' >> "$EXCLUDE"

echo "wheels in $WHL_DIR: $(ls "$WHL_DIR"/*.whl | wc -l) files, $(du -sh "$WHL_DIR" | cut -f1)"
if ((${#failed[@]})); then
  echo "FAILED to download: ${failed[*]}" >&2
  exit 1
fi
