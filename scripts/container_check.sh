#!/usr/bin/env bash
# Build the image, start it, ask one chat completion, and check /v1/status says the
# compiled decode step serves (the image has the compilers the fast paths need).
# Where neither docker nor podman has a running engine (CI has neither) it says so and
# exits 0.  Extra arguments go to the build (e.g. --build-arg OFFLINE=1).
#   CONTAINER_ENGINE   docker or podman (default: the first that answers)
#   CHECK_TIMEOUT      seconds to wait for the compiled step (default 900)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TIMEOUT="${CHECK_TIMEOUT:-900}"

engine="${CONTAINER_ENGINE:-}"
if [ -z "$engine" ]; then
    for candidate in docker podman; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" info >/dev/null 2>&1; then
            engine="$candidate"
            break
        fi
    done
fi
if [ -z "$engine" ]; then
    echo "container_check: no docker or podman engine answers here; nothing built or checked"
    exit 0
fi

tag="mtp-serve-check:$$"
name="mtp-serve-check-$$"
cleanup() {
    "$engine" rm -f "$name" >/dev/null 2>&1 || true
    "$engine" rmi -f "$tag" >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "container_check: building $tag with $engine"
"$engine" build -t "$tag" "$@" "$ROOT"
"$engine" run -d --name "$name" -p 1025 -p 1026 -p 1027 "$tag" >/dev/null
port() { "$engine" port "$name" "$1/tcp" | head -n1 | sed 's/.*://'; }
business="http://127.0.0.1:$(port 1025)"
management="http://127.0.0.1:$(port 1026)"

python3 - "$business" "$management" "$TIMEOUT" <<'PY'
import json, sys, time, urllib.request

business, management, timeout = sys.argv[1], sys.argv[2], float(sys.argv[3])


def get(url):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.status, r.read()


deadline = time.monotonic() + timeout
while True:
    try:
        if get(business + "/health")[0] == 200:
            break
    except OSError:
        pass
    if time.monotonic() > deadline:
        sys.exit("container_check: the daemon never answered /health")
    time.sleep(2)

body = json.dumps({"model": "deepseek-v3-tiny-mtp", "max_tokens": 8,
                   "messages": [{"role": "user", "content": "What is 12 plus 30?"}]}).encode()
req = urllib.request.Request(business + "/v1/chat/completions", data=body,
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    chat = json.load(r)
print("container_check: chat answered:", repr(chat["choices"][0]["message"]["content"]))

while True:
    runtime = json.loads(get(management + "/v1/status")[1])["runtime"]
    if runtime.get("compile_state") == "compiled" and runtime.get("decode_path") == "compiled":
        print(f"container_check: the compiled step serves (compiled in {runtime.get('compile_seconds')} s)")
        break
    if runtime.get("compile_state") == "failed" or time.monotonic() > deadline:
        sys.exit(f"container_check: the compiled step is not in use: {json.dumps(runtime)}")
    time.sleep(5)
PY
echo "container_check: OK"
