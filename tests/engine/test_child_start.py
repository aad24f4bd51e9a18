"""Worker processes and ranks start from a preloaded fork server (server/engine/child.py):
each still sees its parent's environment as it is when the child starts, not as it was
when the fork server started."""
from __future__ import annotations

import os

from server.engine.child import child_context, init_child


def _report(name: str, conn, environ: dict) -> None:
    init_child(0, environ=environ)
    import sys
    conn.send((os.environ.get(name), "torch" in sys.modules))
    conn.close()


def test_a_child_sees_the_environment_of_its_start(monkeypatch):
    ctx = child_context()
    results = []
    for value in ("first", "second"):                # the server started with "first"
        monkeypatch.setenv("MTP_SERVE_CHILD_PROBE", value)
        rx, tx = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_report, args=("MTP_SERVE_CHILD_PROBE", tx, dict(os.environ)))
        proc.start()
        tx.close()
        results.append(rx.recv())
        proc.join(30)
        assert proc.exitcode == 0
    assert [v for v, _ in results] == ["first", "second"]
    if ctx.get_start_method() == "forkserver":       # the preload did its work
        assert all(preloaded for _, preloaded in results)
