"""Worker processes and ranks start from a preloaded fork server (server/engine/child.py):
each still sees its parent's environment as it is when the child starts, not as it was
when the fork server started; each keeps the large blocks it frees."""
from __future__ import annotations

import os

import pytest

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


_FREED = """
import sys, torch
from server.engine.child import keep_freed_pages
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
if sys.argv[1] == "keep":
    assert keep_freed_pages()
t = torch.ones(64 << 20, dtype=torch.uint8)
before = rss()
del t
print(before - rss())
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/statm")
                    or "CS_GNU_LIBC_VERSION" not in getattr(os, "confstr_names", {}),
                    reason="Linux with glibc only")
def test_a_child_keeps_the_large_blocks_it_frees():
    """glibc hands a freed 64 MiB block back to the kernel (its pages fault in again on the
    next allocation); after keep_freed_pages (every child's init_child) it keeps it."""
    import subprocess
    import sys
    dropped = {mode: int(subprocess.run([sys.executable, "-c", _FREED, mode], capture_output=True, text=True,
                                        check=True).stdout) for mode in ("default", "keep")}
    assert dropped["default"] > 32 << 20
    assert dropped["keep"] < 8 << 20
