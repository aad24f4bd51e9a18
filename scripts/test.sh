#!/usr/bin/env bash
# Run the whole test suite; creates .venv (with the test extra) on first run.
# Extra arguments go to pytest.  Exit code is pytest's.
#
# The suite runs on $MTP_TEST_WORKERS pytest-xdist workers (default 2; 0 = in this process),
# a test file per worker at a time: its tests spend much of their time waiting on daemons,
# sockets and child processes, so two workers on two cores finish it in about 0.75 of the
# time one takes.  Passing -n yourself (or -p no:xdist) overrides it.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
bootstrap_venv "test"
cd "$ROOT"
export PYTHONDONTWRITEBYTECODE=1
workers="${MTP_TEST_WORKERS:-2}"
case " $* " in
    *" -n"*|*" --numprocesses"*|*"no:xdist"*|*" --pdb"*) workers=0 ;;
esac
if [ "$workers" != 0 ] && "$VENV/bin/python" -c "import xdist" 2>/dev/null; then
    set -- -n "$workers" --dist loadfile "$@"
fi
exec "$VENV/bin/python" -m pytest "$@"
