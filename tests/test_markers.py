"""The fast inner loop stays fast: every test that starts a daemon is marked ``slow``, and
every test that reads the bundled demo model is marked ``demo``.

Why: ``scripts/test.sh -m "not slow"`` is the developers' loop (under a minute on 2 CPU
cores); one unmarked daemon test adds seconds of start-up to every run, and an unmarked
demo test breaks ``-m "not demo"`` on a tree without the model.  This checks the tests of
the current session, so in a full run (``.ci/run``) it checks them all, and under
``-m "not slow"`` it proves none of the selected tests starts a daemon.
"""
from __future__ import annotations

import inspect
import re
from functools import lru_cache
from pathlib import Path

import pytest

# How a test module or fixture reaches the bundled model (a fake folder of the same name
# under tmp_path does not count).
DEMO_REF = re.compile(r'DEMO_MODEL|(ROOT|REPO|parents\[\d\])\s*/\s*"models"\s*/\s*"deepseek-v3-tiny-mtp"')


@lru_cache(maxsize=None)
def _source(obj) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return ""


def _functions(item: pytest.Item) -> list:
    """The test function and every fixture it uses (directly or through other fixtures)."""
    funcs = [getattr(item, "function", None)]
    for defs in item._fixtureinfo.name2fixturedefs.values():
        funcs += [d.func for d in defs]
    return [f for f in funcs if f is not None]


def _starts_daemon(item: pytest.Item) -> bool:
    """The test or a fixture it uses runs ``Daemon(...)`` (server/testing/daemon.py: a
    real ``python -m server`` process)."""
    return any("Daemon(" in _source(f) for f in _functions(item))


@lru_cache(maxsize=None)
def _demo_names(path: Path) -> re.Pattern:
    """DEMO_REF, or a module-level name bound to it (``DEMO = ROOT / "models" / ...``)."""
    names = [m.group(1) for m in re.finditer(r"^(\w+)\s*=(.*)$", path.read_text(), re.M)
             if DEMO_REF.search(m.group(2))]
    return re.compile("|".join([DEMO_REF.pattern] + [rf"\b{n}\b" for n in names]))


def _reads_demo_model(item: pytest.Item) -> bool:
    """The test or a fixture it uses names the bundled model's folder."""
    if Path(item.fspath) == Path(__file__):
        return False                      # DEMO_REF itself
    pattern = _demo_names(Path(item.fspath))
    return any(pattern.search(_source(f)) for f in _functions(item))


def test_daemon_tests_are_slow_and_demo_tests_are_demo(request):
    items = [i for i in request.session.items if isinstance(i, pytest.Function)]
    unmarked_daemon = [i.nodeid for i in items
                       if _starts_daemon(i) and i.get_closest_marker("slow") is None]
    unmarked_demo = [i.nodeid for i in items
                     if _reads_demo_model(i) and i.get_closest_marker("demo") is None]
    assert not unmarked_daemon, f"start a daemon but are not marked slow: {unmarked_daemon}"
    assert not unmarked_demo, f"read models/deepseek-v3-tiny-mtp but are not marked demo: {unmarked_demo}"


def test_the_checks_recognise_daemon_and_demo_tests(request):
    """The detectors themselves: they must see tests/daemon's daemon fixtures and the demo
    model's folder (else the test above would pass vacuously).  Only meaningful when
    those tests were collected."""
    by_file = {name: [i for i in request.session.items
                      if isinstance(i, pytest.Function) and f"tests/{name}::" in i.nodeid]
               for name in ("daemon/test_daemon_openai.py", "daemon/test_daemon_demo.py",
                            "demo/test_demo_model.py", "engine/test_demo_acceptance.py")}
    if not any(by_file.values()):
        pytest.skip("none of the daemon or demo test modules is in this session")
    assert all(_starts_daemon(i) for i in by_file["daemon/test_daemon_openai.py"])
    # Some tests reach the model only through a helper function the detector does not
    # follow; each of these modules has tests that name it directly.
    for name in ("daemon/test_daemon_demo.py", "demo/test_demo_model.py",
                 "engine/test_demo_acceptance.py"):
        assert not by_file[name] or any(_reads_demo_model(i) for i in by_file[name]), name
