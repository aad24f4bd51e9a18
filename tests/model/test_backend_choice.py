"""Which product backend each CPU class gets (server/model/kernels/choice.py), with the
capability probe stubbed: AVX2-only, AVX-512, AVX-512 BF16/VNNI and AMX.  And the
environment variables that force a backend: read once, refused when outside their set."""
from __future__ import annotations

import pytest
import torch

import server.model.quant.int8 as int8
from server.model import kernels, quant
from server.model.kernels import avx512, choice, cpu, half_cpu, native, select, settings
from server.model.kernels.products import Products

CLASSES = cpu.EXAMPLES


def test_each_example_belongs_to_its_class():
    assert {name: caps.cpu_class for name, caps in CLASSES.items()} == {n: n for n in CLASSES}
    assert cpu.CpuCaps().cpu_class == "other"
    assert set(CLASSES) | {"other"} == set(kernels.CPU_CLASSES)


ALL = frozenset({"half_avx2", "avx512_bf16", "avx512_vnni"})          # every kernel built
NONE = frozenset()


@pytest.mark.parametrize("name, built, want", [
    ("avx2", ALL, "avx2"), ("avx2", NONE, "float32"),
    ("avx512", ALL, "avx2"), ("avx512", NONE, "float32"),          # no BF16: as AVX2-only
    ("avx512_bf16_vnni", ALL, "avx512"), ("avx512_bf16_vnni", NONE, "onednn"),
    ("amx", ALL, "avx512"), ("amx", NONE, "onednn"),
])
def test_the_automatic_16_bit_backend_per_cpu_class(name, built, want):
    assert choice.half_backend(CLASSES[name], built) == want


@pytest.mark.parametrize("name, want", [
    ("avx2", ("int_mm", "float", "avx2")), ("avx512", ("int_mm", "float", "avx2")),
    ("avx512_bf16_vnni", ("int_mm", "float", "avx2", "vnni")), ("amx", ("int_mm", "float", "avx2", "vnni")),
])
def test_the_int8_candidates_per_cpu_class(name, want):
    caps = CLASSES[name]
    assert choice.int8_candidates(caps, half=False, built=ALL) == want
    assert choice.int8_candidates(caps, half=True, built=ALL) == want + ("int8pack",)
    assert choice.int8_candidates(caps, half=True, built=NONE) == ("int_mm", "float", "int8pack")
    # A CPU without the instructions never measures a kernel, even if something claims it built.
    assert choice.int8_candidates(cpu.CpuCaps(), half=False, built=ALL) == ("int_mm", "float")


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_measured_int8_choice_measures_only_what_the_class_can_run(name, monkeypatch):
    """The stubbed probe reaches the measurement: every candidate it allows is timed, the
    fastest is taken, and the choice is kept per kind of model."""
    monkeypatch.setattr(int8, "cpu_caps", lambda: CLASSES[name])
    monkeypatch.setattr(int8, "_built_kernels", lambda: ALL)
    monkeypatch.setattr(int8, "_FASTEST", {})
    timed = []
    monkeypatch.setattr(int8, "_measure_int8_backends",
                        lambda backends: timed.append(backends) or backends[-1])
    kernels_ = ("avx2", "vnni") if CLASSES[name].avx512_vnni else ("avx2",)
    assert quant.fastest_int8_backend("cpu", torch.bfloat16) == "int8pack"
    assert quant.fastest_int8_backend("cpu", torch.float32) == kernels_[-1]
    quant.fastest_int8_backend("cpu", torch.bfloat16)                 # measured once
    assert timed == [("int_mm", "float") + kernels_ + ("int8pack",), ("int_mm", "float") + kernels_]
    assert quant.fastest_int8_backend("cuda", torch.bfloat16) == "int_mm"


def test_forced_backends_are_checked_against_the_cpu_and_model():
    avx2, bare, zen4 = CLASSES["avx2"], cpu.CpuCaps(), CLASSES["avx512_bf16_vnni"]
    assert choice.forced_int8_backend("int8pack", avx2, half=True, built=ALL) == "int8pack"
    with pytest.raises(choice.BackendUnavailable, match="16-bit models only"):
        choice.forced_int8_backend("int8pack", avx2, half=False, built=ALL)
    with pytest.raises(choice.BackendUnavailable, match="the CPU lacks AVX2, FMA, F16C"):
        choice.forced_int8_backend("avx2", bare, half=True, built=ALL)
    with pytest.raises(choice.BackendUnavailable, match="avx512_vnni.c, which cannot run here .the CPU lacks"):
        choice.forced_int8_backend("vnni", avx2, half=True, built=ALL)
    assert choice.forced_int8_backend("vnni", zen4, half=False, built=ALL) == "vnni"
    with pytest.raises(choice.BackendUnavailable, match="no C compiler"):
        choice.half_backend(avx2, NONE, forced="avx2")
    with pytest.raises(choice.BackendUnavailable, match="the CPU lacks AVX512_BF16"):
        choice.half_backend(CLASSES["avx512"], ALL, forced="avx512")
    assert choice.half_backend(CLASSES["amx"], ALL, forced="avx2") == "avx2"
    assert choice.half_backend(avx2, ALL, forced="onednn") == "onednn"


def test_the_environment_is_parsed_once_and_refused_outside_its_set():
    s = settings.parse({"MTP_SERVE_INT8_BACKEND": " Int8Pack ", "MTP_SERVE_HALF_BACKEND": "float32",
                        "MTP_SERVE_KERNEL_CACHE": "/tmp/k"})
    assert (s.int8_backend, s.half_backend, s.half_kernel, str(s.kernel_cache)) == \
        ("int8pack", "float32", True, "/tmp/k")
    assert settings.parse({}) == settings.KernelSettings()
    with pytest.raises(settings.KernelSettingError) as e:
        settings.parse({"MTP_SERVE_INT8_BACKEND": "amx", "MTP_SERVE_HALF_BACKEND": "amx",
                        "MTP_SERVE_HALF_KERNEL": "yes"})
    for part in ("$MTP_SERVE_INT8_BACKEND='amx'; not a backend; allowed: auto, int_mm, int8pack, avx2, vnni, float",
                 "$MTP_SERVE_HALF_BACKEND='amx'", "$MTP_SERVE_HALF_KERNEL='yes'"):
        assert part in str(e.value)
    with pytest.raises(settings.KernelSettingError, match="HALF_KERNEL='0'; forbids"):
        settings.parse({"MTP_SERVE_HALF_KERNEL": "0", "MTP_SERVE_HALF_BACKEND": "avx2"})


def test_check_refuses_a_bad_value_before_anything_loads():
    """``--check`` and the start read the environment through the config loader: a bad
    kernel variable is a config issue at its own path, with the others."""
    from server.config.errors import ConfigError
    from server.config.loader import parse_config
    from tests.config.cfgkit import minimal
    with pytest.raises(ConfigError) as e:
        parse_config(minimal(), check_files=False,
                     env={"MTP_SERVE_INT8_BACKEND": "vnn1", "MTP_SERVE_HALF_KERNEL": "2"})
    paths = [i.path for i in e.value.issues]
    assert "$MTP_SERVE_INT8_BACKEND" in paths and "$MTP_SERVE_HALF_KERNEL" in paths
    parse_config(minimal(), check_files=False, env={"MTP_SERVE_INT8_BACKEND": "int8pack"})


def test_a_bad_value_stops_the_load_with_its_name(tmp_path, monkeypatch):
    from server.model.loading import CheckpointError, load_checkpoint
    from server.testing.tiny_checkpoint import make_tiny_checkpoint
    path = make_tiny_checkpoint(tmp_path / "tiny")
    monkeypatch.setenv(kernels.INT8_ENV, "fast")
    kernels.kernel_settings.cache_clear()
    try:
        with pytest.raises(CheckpointError, match=r"\$MTP_SERVE_INT8_BACKEND='fast'"):
            load_checkpoint(path, int8_backend="auto")
    finally:
        monkeypatch.undo()
        kernels.kernel_settings.cache_clear()


def test_the_forced_16_bit_backend_decides_the_products_and_the_heads_layout(monkeypatch):
    """Each 16-bit backend this CPU can run, forced: its products, and row-major heads where
    our kernels read rows; "onednn" takes torch's own."""
    cases = [("float32", half_cpu.HalfCpuProducts), ("onednn", Products)]
    if native.half_kernel() is not None:
        cases.append(("avx2", half_cpu.HalfCpuProducts))
    if native.kernel_library("avx512_bf16") is not None:
        cases.append(("avx512", avx512.Avx512Products))
    try:
        for forced, kind in cases:
            monkeypatch.setenv(kernels.HALF_ENV, forced)
            kernels.kernel_settings.cache_clear()
            select.half_backend_name.cache_clear()
            assert select.half_backend_name() == forced
            p = select.model_products(torch.bfloat16, "cpu")
            assert type(p) is kind and p.name == ("torch" if forced == "onednn" else forced)
            assert p.column_major(torch.bfloat16) is (forced == "onednn" and kernels.cpu_caps().native_bf16)
            if kind is half_cpu.HalfCpuProducts:
                assert (p.kernel is not None) is (forced == "avx2")
    finally:
        monkeypatch.undo()
        kernels.kernel_settings.cache_clear()
        select.half_backend_name.cache_clear()
