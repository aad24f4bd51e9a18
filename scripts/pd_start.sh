#!/usr/bin/env bash
# PD disaggregation on one machine: a prefill instance, a decode instance and the
# coordinator (conf/pd/*.json), all on loopback.  Clients call the coordinator's port
# (1025).  Ctrl-C or SIGTERM stops all three.  Creates .venv on first run.
#   scripts/pd_start.sh [--conf-dir DIR]     (DIR holds prefill.json, decode.json, coordinator.json)
# The three share the deployment's KV transfer key, DIR/kv-transfer.key (the configs name
# it): made here on first use, 64 random hex digits readable by this user only.  The
# instances take their role only from a caller holding it (docs/config.md, PD).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv ""
cd "$ROOT"
CONF=conf/pd
if [[ "${1:-}" == "--conf-dir" ]]; then CONF="$2"; fi
PY="$VENV/bin/python"
KEY="$CONF/kv-transfer.key"
if [[ ! -e "$KEY" ]]; then
  (umask 077 && "$PY" -c 'import secrets; print(secrets.token_hex(32))' > "$KEY.$$" &&
   mv -n "$KEY.$$" "$KEY"; rm -f "$KEY.$$")
fi
pids=()
stop() {
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop EXIT INT TERM
"$PY" -m server --config-file "$CONF/prefill.json" & pids+=($!)
"$PY" -m server --config-file "$CONF/decode.json" & pids+=($!)
"$PY" -m server.pd --config-file "$CONF/coordinator.json" & pids+=($!)
# Whichever ends first ends the set (a crashed instance must not leave a half set running).
wait -n
