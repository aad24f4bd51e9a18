"""``--check`` prints the process groups the daemon would build, rank by rank: tp, moe_tp
and sp groups contiguous, dp, cp and moe_ep strided, as MindIE places them."""
from __future__ import annotations

from tests.config.cfgkit import MC0, run_cli


def _lay(world: int, **keys) -> dict:
    edits = {f"{MC0}.worldSize": world, "BackendConfig.npuDeviceIds": [list(range(world))]}
    edits.update({f"{MC0}.{k}": v for k, v in keys.items()})
    return edits


def test_check_prints_the_process_groups_of_tp2_sp2_cp2(build):
    proc = run_cli("--check", "--config-file", str(build(_lay(4, tp=2, sp=2, cp=2, moe_ep=4))))
    assert proc.returncode == 0, proc.stderr
    lines = [line.strip() for line in proc.stderr.splitlines()]
    assert "tp groups: [0,1] [2,3]" in lines
    assert "sp groups: [0,1] [2,3]" in lines
    assert "cp groups: [0,2] [1,3]" in lines
    assert "moe_ep groups: [0,1,2,3]" in lines
    assert not [line for line in lines if line.startswith(("dp groups", "moe_tp groups"))]


def test_check_prints_mindie_r1_w8a8_layout_groups(build):
    """MindIE's R1 W8A8 example on 16 devices: dp2 / tp8 / moe_tp4 / moe_ep4."""
    proc = run_cli("--check", "--config-file",
                   str(build(_lay(16, dp=2, tp=8, moe_tp=4, moe_ep=4), name="r1.json")))
    lines = [line.strip() for line in proc.stderr.splitlines()]
    assert "tp groups: [0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]" in lines, proc.stderr
    assert "moe_tp groups: [0,1,2,3] [4,5,6,7] [8,9,10,11] [12,13,14,15]" in lines
    assert "dp groups: " + " ".join(f"[{j},{j + 8}]" for j in range(8)) in lines
    assert "moe_ep groups: " + " ".join(f"[{j},{j + 4},{j + 8},{j + 12}]" for j in range(4)) in lines
