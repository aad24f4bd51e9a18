#!/usr/bin/env bash
# Run the whole test suite; creates .venv (with the test extra) on first run.
# Extra arguments go to pytest.  Exit code is pytest's.
#
# The suite runs on $MTP_TEST_WORKERS pytest-xdist workers (default 2; 0 = in this process),
# a test file per worker at a time: its tests spend much of their time waiting on daemons,
# sockets and child processes, so two workers on two cores finish it in about 0.75 of the
# time one takes.  Passing -n yourself (or -p no:xdist) overrides it.  A worker that crashes
# ends the run (below).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv "test"
cd "$ROOT"
export PYTHONDONTWRITEBYTECODE=1
workers="${MTP_TEST_WORKERS:-2}"
case " $* " in
    *" -n"*|*" --numprocesses"*|*"no:xdist"*|*" --pdb"*) workers=0 ;;
esac
# A worker that dies (a native crash: SIGSEGV in a kernel) is not replaced: xdist would
# hand the crashing file to the new worker, and a worker waiting on the dead one's compile
# warm-up would idle for its timeout.  The run ends instead, naming the test
# (tests/test_crash_fails_fast.py).
if [ "$workers" != 0 ] && "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
    set -- -n "$workers" --dist loadfile --max-worker-restart 0 "$@"
fi
exec "$VENV/bin/python" -m pytest "$@"
