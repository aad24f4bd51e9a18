"""The Docker image serves as the README says: ``docker run -p 1025:1025 -p 1026:1026
-p 1027:1027 mtp-serve`` answers on all three planes from the host.

Why: the image once set MIES_CONTAINER_IP=0.0.0.0 over a config with
allowAllZeroIpListening false, so the documented ``docker run`` exited 2 at once.  What
needs no Docker daemon is checked everywhere: the config the image's CMD names passes
``--check`` with the image's environment and binds every plane on 0.0.0.0, and the README
publishes the ports the config uses.  Building and running the image needs a Docker
daemon (and the network for pip); without one that test is skipped and says why.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def dockerfile_env() -> dict[str, str]:
    """The ENV the image sets (``ENV A=1 B=2`` lines, with backslash continuations)."""
    text = DOCKERFILE.replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            for pair in shlex.split(line[4:]):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


def dockerfile_json(instruction: str) -> list[str]:
    (line,) = [x for x in DOCKERFILE.splitlines() if x.startswith(instruction + " ")]
    return json.loads(line[len(instruction) + 1:])


def image_config() -> Path:
    cmd = dockerfile_json("CMD")
    workdir = re.search(r"^WORKDIR (\S+)", DOCKERFILE, re.M).group(1)
    assert "--config-file" in cmd
    path = Path(cmd[cmd.index("--config-file") + 1])
    assert not path.is_absolute() or str(path).startswith(workdir)
    return ROOT / path if not path.is_absolute() else ROOT / path.relative_to(workdir)


def readme_docker_run() -> str:
    runs = [line.strip() for line in (ROOT / "README.md").read_text().splitlines()
            if line.strip().startswith("docker run ")]
    assert runs, "README has no docker run example"
    return runs[0]


@pytest.mark.demo                      # --check reads the demo model's config.json
def test_image_config_passes_check_with_the_image_environment(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MIES_", "MINDIE_"))}
    env.update(dockerfile_env())
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run([sys.executable, "-m", "server", *dockerfile_json("CMD"), "--check"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    server = out["ServerConfig"]
    assert server["ipAddress"] == server["managementIpAddress"] == "0.0.0.0"   # reachable from the host
    assert out["Derived"]["warnings"] == [], out["Derived"]["warnings"]
    assert dockerfile_json("ENTRYPOINT") == ["python", "-m", "server"]


def test_image_config_is_the_shipped_config_bound_to_all_interfaces():
    """No drift: conf/container.json differs from conf/config.json only in where it listens."""
    shipped = json.loads((ROOT / "conf" / "config.json").read_text())
    image = json.loads(image_config().read_text())
    for key in ("ipAddress", "managementIpAddress", "allowAllZeroIpListening"):
        shipped["ServerConfig"].pop(key), image["ServerConfig"].pop(key)
    assert image == shipped


def test_readme_publishes_the_three_planes_and_the_image_exposes_them():
    server = json.loads(image_config().read_text())["ServerConfig"]
    ports = {server["port"], server["managementPort"], server["metricsPort"]}
    run = readme_docker_run()
    published = {int(host) for host, inner in re.findall(r"-p (\d+):(\d+)", run) if host == inner}
    assert published == ports, run
    exposed = set(map(int, re.search(r"^EXPOSE (.+)$", DOCKERFILE, re.M).group(1).split()))
    assert exposed == ports


def test_cpu_build_is_the_default_and_uses_the_cpu_wheel_index():
    assert re.search(r"^ARG TORCH_BUILD=cpu$", DOCKERFILE, re.M)
    assert "--index-url \"$TORCH_CPU_INDEX\"" in DOCKERFILE
    assert "ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu" in DOCKERFILE


def docker_daemon() -> str | None:
    """None when a Docker daemon answers, else why not."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    try:
        proc = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"],
                              capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "docker version timed out"
    if proc.returncode != 0:
        return "no Docker daemon reachable: " + (proc.stderr.strip().splitlines() or ["?"])[-1]
    return None


@pytest.mark.slow
@pytest.mark.demo
@pytest.mark.timeout(3600)
def test_image_builds_and_serves_the_three_planes():
    why = docker_daemon()
    if why:
        pytest.skip(why)
    tag = f"mtp-serve-test:{uuid.uuid4().hex[:8]}"
    build = subprocess.run(["docker", "build", "-t", tag, str(ROOT)], capture_output=True,
                           text=True, timeout=3000)
    assert build.returncode == 0, build.stderr[-3000:]
    name = f"mtp-serve-test-{uuid.uuid4().hex[:8]}"
    try:
        # the README's command, with the host ports left to Docker
        run = subprocess.run(["docker", "run", "-d", "--name", name, "-p", "1025", "-p", "1026",
                              "-p", "1027", tag], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        urls = {}
        for plane, port in (("business", 1025), ("management", 1026), ("metrics", 1027)):
            out = subprocess.run(["docker", "port", name, f"{port}/tcp"], capture_output=True,
                                 text=True, timeout=30).stdout.splitlines()[0]
            urls[plane] = "http://127.0.0.1:" + out.rsplit(":", 1)[1]
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(urls["business"] + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            logs = subprocess.run(["docker", "logs", name], capture_output=True, text=True).stderr
            assert time.monotonic() < deadline, logs[-3000:]
            time.sleep(2)
        chat = httpx.post(urls["business"] + "/v1/chat/completions", timeout=120, json={
            "model": "deepseek-v3-tiny-mtp", "max_tokens": 8,
            "messages": [{"role": "user", "content": "What is 12 plus 30?"}]})
        assert chat.status_code == 200, chat.text
        assert httpx.get(urls["management"] + "/v1/status", timeout=30).status_code == 200
        assert "spec_decode" in httpx.get(urls["metrics"] + "/metrics", timeout=30).text
    finally:
        subprocess.run(["docker", "rm", "-f", name], capture_output=True, timeout=60)
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True, timeout=120)


def test_the_image_has_the_compilers_the_fast_paths_need():
    """half_avx2.c is built with cc and the compiled step's C++ with g++, on the machine that
    serves: an image without them serves on oneDNN and the uncompiled step."""
    text = DOCKERFILE.replace("\\\n", " ")
    install = re.search(r"apt-get install [^&\n]*", text).group(0)
    assert {"gcc", "g++", "libc6-dev"} <= set(install.split())
    assert "command -v cc && command -v g++" in DOCKERFILE


def test_an_offline_build_takes_every_wheel_from_the_wheels_folder():
    assert re.search(r"^ARG OFFLINE=0$", DOCKERFILE, re.M)
    assert "COPY wheels/ /opt/wheels/" in DOCKERFILE and "PIP_FIND_LINKS=/opt/wheels" in DOCKERFILE
    assert DOCKERFILE.count("--no-index") == 2                 # torch, then the project
    assert (ROOT / "wheels" / "README.md").is_file()
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "wheels" not in ignored and ".cache" in ignored      # bench checkpoints stay out


def test_container_check_says_so_and_exits_0_without_an_engine(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    for tool in ("docker", "podman"):                           # clients, no engine behind them
        (fake / tool).write_text("#!/bin/sh\nexit 1\n")
        (fake / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    env.pop("CONTAINER_ENGINE", None)
    done = subprocess.run(["bash", str(ROOT / "scripts" / "container_check.sh")], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "no docker or podman engine answers here" in done.stdout
    assert "scripts/container_check.sh" in (ROOT / "README.md").read_text()
