"""Suite-wide settings (one torch thread, runs repeatable) and the fixtures of more than one
folder."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Daemons the tests start run uncompiled (a compile costs 15-60 s per start); the compiled
# step has its own tests, which ask for it (tests/engine/test_compiled_step.py).
os.environ.setdefault("MTP_SERVE_COMPILE", "0")
# The compiled-step tests' graphs call their kernels from Python, not a C++ wrapper: ~9 s
# less compile a graph, and a clean checkout compiles ~30 of them cold.  The C++ wrapper
# (the default) is compiled, saved and loaded by tests/model/test_half_cpu.py.
os.environ.setdefault("MTP_SERVE_COMPILE_CPP_WRAPPER", "0")
# Inductor compiles in this process rather than through a pool of worker processes: on
# two cores the pool's start-up (each worker imports torch) costs more than it saves.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Inductor trusts the CPU's reported vector flags instead of proving each by compiling and
# loading a test library: 8 s in every process's first compile on a clean machine (CI's),
# several times a run.  The serving path does the same (compile_step.compile_settings).
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# One intra-op thread: the tests run tiny models, where a second thread only adds
# synchronisation, and on a shared 2-core machine its spin-waits slow every step badly.
# (Daemons the tests start set their own threads.)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    """One random tiny checkpoint (with MTP weights) per session, for the daemon tests and
    the daemon's start-up units."""
    from server.testing.daemon import tiny_checkpoint
    return tiny_checkpoint(tmp_path_factory.mktemp("tiny-ckpt"))


@pytest.fixture(scope="session")
def quantized(tmp_path_factory, worker_id):
    """The demo model through training/quantize.py, once per run: msModelSlim W8A8 mixed
    (static attention, dynamic MLPs), W4A8 experts, compressed-tensors int8 (every linear
    W8A8_DYNAMIC; the vocabulary heads float, or int8 too: ``ct_heads``) and FA3 KV scales.  Name -> checkpoint directory.  Under xdist the first
    worker to ask writes them (15-20 s) into the run's shared temp folder and the others
    read them."""
    from pathlib import Path

    from filelock import FileLock
    from training import quantize
    demo = Path(__file__).resolve().parents[1] / "models" / "deepseek-v3-tiny-mtp"
    if not any(demo.glob("*.safetensors")):
        pytest.skip("demo model weights not present")
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if worker_id != "master" else base) / "quantized"
    out = {name: root / name for name in ("w8a8", "w4a8", "ct", "ct_heads", "fa3")}
    with FileLock(str(root) + ".lock"):
        if not (root / "complete").is_file():
            for name, extra in (("w8a8", []), ("w4a8", ["--w4a8-experts"]),
                                ("ct", ["--format", "compressed-tensors"]),
                                ("ct_heads", ["--format", "compressed-tensors", "--quant-heads"]),
                                ("fa3", ["--fa-quant"])):
                out[name].mkdir(parents=True, exist_ok=True)
                assert quantize.main([str(demo), str(out[name]), "--calib-samples", "32", *extra]) == 0
            (root / "complete").touch()
    return out


@pytest.fixture(scope="session")
def worker_id(request) -> str:
    """xdist's own fixture of the name, also when its plugin is off."""
    return _worker(request.config)


def _worker(config) -> str:
    """xdist's worker name ("gw0", ...); "master" without xdist."""
    workerinput = getattr(config, "workerinput", None)
    return workerinput["workerid"] if workerinput else "master"


# -- the compiled-step tests' graphs, made while the rest of the suite runs -----------------
_WARM: dict = {"procs": [], "done": {}, "stop": False, "thread": None, "dirs": [], "marks": None}
# (test file, the demo model's shard under this plan (ParallelPlan's world_size, moe_tp,
# moe_ep; rank 0) or None, max query length): the graphs those tests compile.  tp=2 ranks
# share one graph set (compile_step._plan_key).
_WARM_SETS = (("tests/engine/test_compiled_step.py", None, 2),
              ("tests/engine/test_parallel_compiled.py", (2, 2, 1), 1))


def pytest_collection_modifyitems(session, config, items):
    """The tests of the warmed graph sets run late, before the PD tests (whole files, so
    that xdist's loadfile schedule sends them late too): by then the background compile
    made their graphs, so neither a test nor a worker idles waiting for it, and the PD and
    text files keep the other worker busy meanwhile (run last, test_compiled_step.py's
    minute left one worker idle at the end)."""
    if os.environ.get("MTP_SERVE_TEST_WARM_COMPILE", "1") == "0":
        return
    warmed = tuple(test for test, *_ in _WARM_SETS)
    late = [i for i in items if i.nodeid.startswith(warmed)]
    others = [i for i in items if not i.nodeid.startswith(warmed)]
    cut = next((n for n, i in enumerate(others) if i.nodeid.startswith("tests/pd/")), len(others))
    items[:] = others[:cut] + late + others[cut:]


def _marks(config):
    """Under pytest-xdist (scripts/test.sh runs two workers): a folder every worker of this
    run knows, where the one worker that warms up marks each graph set wanted and done, so
    that a compiled test on another worker waits for it instead of compiling the same
    graphs a second time.  None without xdist."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return None
    import tempfile
    from pathlib import Path
    return Path(tempfile.gettempdir()) / f"mtp-warm-{workerinput['testrunuid']}"


def _mark(test: str) -> str:
    return test.replace("/", "_")


def pytest_collection_finish(session):
    """The compiled-step tests need 13 graphs of the demo model (MTP k=1) and the compiled
    tp=2 test 8 of its shard (MTP off): about two minutes of compile on two cores when the
    cache is cold.  The suite leaves cores idle (its tests wait on daemons and sockets), so
    one compile child at a time, at one thread, makes them from now on, and the tests wait
    (``warm_compile``) if they get there first; a graph not made yet they make themselves
    (files are written atomically, so two makers never clash).  Under xdist only worker gw0
    warms up (the others wait on its marks, ``_marks``).  $MTP_SERVE_TEST_WARM_COMPILE=0:
    no warm-up."""
    if os.environ.get("MTP_SERVE_TEST_WARM_COMPILE", "1") == "0" or session.config.option.collectonly:
        return
    marks = _WARM["marks"] = _marks(session.config)
    if _worker(session.config) not in ("master", "gw0"):
        return                          # gw0 collected the same items and marks what it warms
    wanted = [w for w in _WARM_SETS if any(i.nodeid.startswith(w[0]) for i in session.items)]
    from server.testing.daemon import demo_model_ready
    if not wanted or not demo_model_ready():
        return
    import threading
    if marks is not None:
        marks.mkdir(parents=True, exist_ok=True)
        (marks / "warmer.pid").write_text(str(os.getpid()))
    for test, *_ in wanted:
        _WARM["done"][test] = threading.Event()
        if marks is not None:
            (marks / f"{_mark(test)}.wanted").touch()
    # Each set's cache folder and compile settings, read now: once tests run, one of them
    # may set the compile environment for a while (test_half_cpu.py's C++ wrapper), and a
    # set keyed or compiled under it is one no test asks for.
    jobs = [(test, *_warm_job(plan, q)) for test, plan, q in wanted]

    def run() -> None:
        for n, (test, *job) in enumerate(jobs):
            try:
                _warm(n, *job)
            finally:
                _WARM["done"][test].set()
                if marks is not None:
                    (marks / f"{_mark(test)}.done").touch()
    _WARM["thread"] = threading.Thread(target=run, name="warm-compile", daemon=True)
    _WARM["thread"].start()


def _warm_job(plan: tuple | None, q: int) -> tuple:
    """(model, its cache folder, every graph of the set, max query length, C++ wrapper?,
    threads) of one graph set.  Every graph, not only those missing from the folder: the
    child loads the ones there, which builds their C++ into Inductor's code cache of this
    environment.  Why: the folder's key holds no path of the virtualenv, Inductor's does, so
    a fresh clone found the graphs made by an earlier one and its compiled-step test built
    their C++ itself while loading them (~55 s of a 7-minute suite; ~4 s without)."""
    from server.engine.worker import compile_step
    from server.model.loading import load_checkpoint
    from server.model.parallel.plan import ParallelPlan
    from server.testing.daemon import DEMO_MODEL
    device = torch.device("cpu")
    model, _ = load_checkpoint(DEMO_MODEL, plan=ParallelPlan(*plan) if plan else None)
    folder = compile_step.cache_dir(model, device)
    files = [f for r in compile_step.graph_rounds(model, q) for f in r]
    return model, folder, files, q, compile_step.cpp_wrapper(device), torch.get_num_threads()


def _warm(n: int, model, folder, files: list[str], q: int, cpp_wrapper: bool, threads: int) -> None:
    """One graph set made by one compile child (waited for)."""
    import tempfile
    from pathlib import Path

    from server.engine.worker import compile_child
    if files and not _WARM["stop"]:
        tmp = Path(tempfile.mkdtemp(prefix="mtp-warm-compile-"))
        _WARM["dirs"].append(tmp)
        proc, _log = compile_child.spawn_compile_child(model, 16, torch.device("cpu"), folder, q, files,
                                                       tmp / f"warm{n}", cpp_wrapper=cpp_wrapper,
                                                       threads=threads)
        _WARM["procs"].append(proc)
        proc.wait()


def pytest_sessionfinish(session, exitstatus):
    # Under xdist another worker may still wait for the warm-up: it finishes unless the run
    # was interrupted.  Alone, nothing waits for it any more.
    if (_WARM["marks"] is not None and _WARM["thread"] is not None
            and exitstatus != pytest.ExitCode.INTERRUPTED):
        _WARM["thread"].join(timeout=900)
    _WARM["stop"] = True
    for proc in _WARM["procs"]:
        if proc.poll() is None:
            proc.kill()
    if _WARM["thread"] is not None:          # not torn down mid-load at exit
        _WARM["thread"].join(timeout=30)
    import shutil
    for tmp in _WARM["dirs"]:                # the children's specs and logs
        shutil.rmtree(tmp, ignore_errors=True)
    if _WARM["marks"] is not None and _WARM["thread"] is not None:
        shutil.rmtree(_WARM["marks"], ignore_errors=True)


@pytest.fixture
def warm_compile(request):
    """Waits until the graphs of the asking test's file are made (``pytest_collection_finish``),
    here or, under xdist, on worker gw0."""
    test = request.node.nodeid.split("::")[0]
    done = _WARM["done"].get(test)
    if done is not None:
        done.wait(timeout=900)
        return
    marks = _WARM["marks"]
    if marks is None:
        return
    import time
    deadline = time.monotonic() + 900
    while (marks / f"{_mark(test)}.wanted").exists() and time.monotonic() < deadline:
        if (marks / f"{_mark(test)}.done").exists() or not _warmer_alive(marks):
            return                      # made, or its maker died: the test makes what is missing
        time.sleep(0.5)


def _warmer_alive(marks) -> bool:
    """Whether the worker warming the graphs still runs (a worker that crashed never marks
    its sets done: waiting on it idled the run for the full timeout)."""
    try:
        os.kill(int((marks / "warmer.pid").read_text()), 0)
    except (OSError, ValueError):
        return False
    return True
