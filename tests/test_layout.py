"""The package keeps the shape issue 59 gave it (server/testing/layout.py measures it).

Why: the engine grew to 36 flat modules once and ``server/model`` to 20; spec/ and
worker/ imported each other, the config imported the engine it configures, and a module
rebound ``torch.nn.functional.linear`` for the whole process.  Each limit below is cheap
to check and easy to lose in a refactor, so the suite holds the project to it: a folder
of at most 12 modules, no import circle between files nor between sibling folders
(imports inside functions count), no function over 80 lines, nothing assigned to an
attribute of torch.  Pure file reading: no torch, no daemon.
"""
from __future__ import annotations

import pytest

from server.testing import layout


@pytest.fixture(scope="module")
def mods() -> dict[str, layout.Module]:
    return layout.modules()


def test_no_folder_holds_more_than_twelve_modules(mods):
    assert layout.crowded_folders(mods) == {}, (
        f"more than {layout.MAX_MODULES} modules in one folder: group them into "
        "sub-packages named for their concept")


def test_no_import_circle_between_files(mods):
    assert layout.file_cycles(mods) == []


def test_no_import_circle_between_sibling_folders(mods):
    assert layout.folder_cycles(mods) == []


def test_no_function_is_longer_than_eighty_lines(mods):
    assert layout.long_functions(mods) == []


def test_nothing_assigns_to_an_attribute_of_torch():
    assert list(layout.torch_patches(layout.project_sources())) == []


def test_the_measures_see_what_they_measure(tmp_path):
    """A package made to have a crowded folder, a file cycle (one of its imports inside a
    function) and a cycle between sibling folders: each check finds its own, so an empty
    answer above means something."""
    pkg = tmp_path / "server"
    for path in (pkg / "a", pkg / "b"):
        path.mkdir(parents=True)
    for path in (pkg, pkg / "a", pkg / "b"):
        (path / "__init__.py").write_text("")
    for i in range(layout.MAX_MODULES + 1):
        (pkg / "a" / f"m{i}.py").write_text("")
    (pkg / "a" / "m0.py").write_text("def f():\n    import server.b.x\n")
    (pkg / "b" / "x.py").write_text("from server.a import m1\nfrom . import y\n")
    (pkg / "b" / "y.py").write_text("def g():\n    from server.b.x import z\n")
    mods = layout.modules(tmp_path, "server")
    assert layout.crowded_folders(mods) == {"server.a": layout.MAX_MODULES + 1}
    assert layout.file_cycles(mods) == [["server.b.x", "server.b.y"]]
    assert layout.folder_cycles(mods) == [["server.a", "server.b"]]
