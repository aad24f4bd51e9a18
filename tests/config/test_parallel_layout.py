"""MindIE's parallel layout rules (tp, dp, cp, sp, moe_tp, moe_ep) and what this build serves.

A layout that breaks a rule is refused at load (ConfigError, one issue at the key to edit);
a layout that follows the rules but needs dp and sp both above 1, or sp or dp above 1
beside a feature that moves whole KV blocks (host/disk tier, swap preemption, PD; cp
above 1 always comes with sp above 1), loads, and is reported apart as not served by
this build: ``--check`` and the daemon's start exit 1 on it.  tp2/sp2/cp2 is served.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.config import ConfigError, parse_config
from server.config.parallel import unserved_parallel
from tests.config.cfgkit import MC0, REPO, edited, minimal, run_cli, write_weights

PP = f"{MC0}.plugin_params"
NST = f"{PP}.num_speculative_tokens"


def lay(world: int, **keys) -> dict:
    """Edits for one node of ``world`` devices with the given ModelConfig[0] keys."""
    edits = {f"{MC0}.worldSize": world, "BackendConfig.npuDeviceIds": [list(range(world))]}
    edits.update({f"{MC0}.{k}": v for k, v in keys.items()})
    return edits


def mtp(k: int) -> str:
    return json.dumps({"plugin_type": "mtp", "num_speculative_tokens": k})


def load(edits: dict, tmp_path, env: dict | None = None):
    write_weights(tmp_path / "tiny-model")
    return parse_config(edited(minimal(), edits), base_dir=tmp_path, env=env or {})


def refused(edits: dict, tmp_path, env: dict | None = None):
    with pytest.raises(ConfigError) as info:
        load(edits, tmp_path, env)
    return info.value.issues


# (id, edits, (world, tp, dp, cp, sp, moe_tp, moe_ep), keys this build does not serve)
ACCEPTED = [
    ("16dev-dp2-tp8-moe_tp4-moe_ep4", lay(16, dp=2, tp=8, moe_tp=4, moe_ep=4),
     (16, 8, 2, 1, 1, 4, 4), set()),
    ("16dev-dp2-tp8-moe_tp1-moe_ep16", lay(16, dp=2, tp=8, moe_tp=1, moe_ep=16),
     (16, 8, 2, 1, 1, 1, 16), set()),
    ("dp2-tp1-moe_ep2", lay(2, dp=2, tp=1, moe_ep=2), (2, 1, 2, 1, 1, 1, 2), set()),
    ("dp2-tp2-moe_ep4", lay(4, dp=2, tp=2, moe_ep=4), (4, 2, 2, 1, 1, 1, 4), set()),
    ("tp2-sp2", lay(2, tp=2, sp=2), (2, 2, 1, 1, 2, 2, 1), set()),
    # MoE keys given: with neither, moe_tp would be tp (2) and not cover the 4 ranks
    ("tp2-sp2-cp2", lay(4, tp=2, sp=2, cp=2, moe_ep=4), (4, 2, 1, 2, 2, 1, 4), set()),
    ("mindie-cp-example-16dev", lay(16, dp=1, cp=2, sp=8, tp=8, moe_ep=16, moe_tp=1),
     (16, 8, 1, 2, 8, 1, 16), set()),
    ("tp2-moe_ep2-moe_tp1", lay(2, tp=2, moe_ep=2, moe_tp=1), (2, 2, 1, 1, 1, 1, 2), set()),
    ("moe_tp-only", lay(4, moe_tp=2), (4, 4, 1, 1, 1, 2, 2), set()),
    ("dp-minus-one-is-unset", lay(2, dp=-1), (2, 2, 1, 1, 1, 2, 1), set()),
    ("sp2-with-mtp-k1", {**lay(2, tp=2, sp=2), PP: mtp(1)}, (2, 2, 1, 1, 2, 2, 1), set()),
]


@pytest.mark.parametrize("case_id,edits,sizes,unserved", ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_mindie_layouts_follow_the_rules(case_id, edits, sizes, unserved, tmp_path):
    cfg = load(edits, tmp_path)                       # no ConfigError: no rule is broken
    p = cfg.parallel
    assert (p.world_size, p.tp, p.dp, p.cp, p.sp, p.moe_tp, p.moe_ep) == sizes
    notes = unserved_parallel(p)
    assert {n.path.rsplit(".", 1)[1] for n in notes} == unserved
    assert [n.path for n in cfg.unserved] == [n.path for n in notes]
    for note in notes:
        key = note.path.rsplit(".", 1)[1]
        assert f"{key} {getattr(p, key)} (" in note.message
        assert "is a valid MindIE layout but this build does not serve it yet" in note.message
        assert f"serve with {key} 1" in note.message
    derived = cfg.to_dict()["Derived"]["parallel"]
    assert derived["followsMindIERules"] is True
    assert derived["notServed"] == [n.message for n in notes]


def test_dp_is_served_and_reaches_the_engine(tmp_path):
    from server.engine.config import engine_config_from_app
    cfg = load({**lay(2, dp=2, tp=1, moe_ep=2), PP: mtp(2)}, tmp_path)
    assert cfg.unserved == []
    par = engine_config_from_app(cfg).parallel
    assert (par.world_size, par.dp, par.tp, par.moe_tp, par.moe_ep) == (2, 2, 1, 1, 2)


def test_dp_with_sp_is_not_served(tmp_path):
    cfg = load(lay(4, dp=2, tp=2, sp=2, moe_ep=4), tmp_path)
    [note] = cfg.unserved
    assert note.path == f"{MC0}.sp" and f"{MC0}.dp" in note.related
    assert note.message == ("sp 2 (sequence parallel) with dp 2 (attention data parallel) is "
                            "a valid MindIE layout but this build does not serve the two "
                            "together yet; serve with sp 1")


def test_sp_is_served_and_reaches_the_engine(tmp_path):
    from server.engine.config import engine_config_from_app
    cfg = load({**lay(2, tp=2, sp=2), PP: mtp(1)}, tmp_path)
    assert cfg.unserved == []
    par = engine_config_from_app(cfg).parallel
    assert (par.world_size, par.sp, par.moe_tp, par.moe_ep) == (2, 2, 2, 1)


SP_WITH = [
    ("host-pool", {"BackendConfig.kvPoolConfig": {"backend": "host"},
                   PP: json.dumps({"plugin_type": "prefix_cache"})},
     "BackendConfig.kvPoolConfig.backend", "the host KV pool (and its disk tier)",
     "an empty kvPoolConfig.backend"),
    ("swap-preemption", {"BackendConfig.ScheduleConfig.maxPreemptCount": 2},
     "BackendConfig.ScheduleConfig.maxPreemptCount", "preemption by swapping to host memory",
     "maxPreemptCount 0"),
]


@pytest.mark.parametrize("case_id,edits,path,what,fix", SP_WITH, ids=[c[0] for c in SP_WITH])
def test_dp_beside_a_block_mover_is_not_served(case_id, edits, path, what, fix, tmp_path):
    cfg = load({**lay(2, dp=2, tp=1, moe_ep=2), **edits}, tmp_path)
    [note] = cfg.unserved
    assert note.path == path and f"{MC0}.dp" in note.related
    assert note.message == (f"dp 2 (attention data parallel) splits the KV pool over its "
                            f"groups, and {what} moves whole blocks of one pool: not served "
                            f"together by this build; serve with {fix} or dp 1")


@pytest.mark.parametrize("case_id,edits,path,what,fix", SP_WITH, ids=[c[0] for c in SP_WITH])
def test_sp_beside_a_block_mover_is_not_served(case_id, edits, path, what, fix, tmp_path):
    """sp 2 is served, but not beside what moves whole KV blocks of one pool: reported at
    that key, as not served (the daemon refuses to start); with sp 1 it is served."""
    cfg = load({**lay(2, tp=2, sp=2), **edits}, tmp_path)
    [note] = cfg.unserved
    assert note.path == path and f"{MC0}.sp" in note.related
    assert note.message == (f"sp 2 (sequence parallel) stripes the KV pool over the ranks, and "
                            f"{what} moves whole blocks of one pool: not served together by "
                            f"this build; serve with {fix} or sp 1")
    assert load({**lay(2, tp=2), **edits}, tmp_path).unserved == []


def test_cp_is_served_and_reaches_the_engine(tmp_path):
    from server.engine.config import engine_config_from_app
    cfg = load({**lay(4, tp=2, sp=2, cp=2, moe_ep=4), PP: mtp(1)}, tmp_path)
    assert cfg.unserved == []
    par = engine_config_from_app(cfg).parallel
    assert (par.world_size, par.tp, par.cp, par.sp, par.moe_tp, par.moe_ep) == (4, 2, 2, 2, 1, 4)


P_NODE_ROLE = {"ServerConfig.inferMode": "dmi", "ServerConfig.interCommPort": 1300,
               "ServerConfig.pdRole": "prefill", "ServerConfig.pdPeers": []}


@pytest.mark.parametrize("case_id,edits,sizes", [
    # the issue's "1 P with cp=2 sp=2 + 1 D with dp=2" (tests/pd/test_pd_parallel.py)
    ("P-tp2-sp2-cp2", {**lay(4, tp=2, sp=2, cp=2, moe_ep=4), "pd": "prefill"}, (4, 2, 2, 2, 1)),
    ("D-dp2-tp1-ep2", {**lay(2, dp=2, tp=1, moe_ep=2), "pd": "decode"}, (2, 1, 1, 1, 2)),
    # sp on a D node is MindIE's rule-pass without moe_ep (experts over moe_tp)
    ("D-sp2-moe_tp2", {**lay(2, tp=2, sp=2), "pd": "decode"}, (2, 2, 1, 2, 1)),
    ("P-dp2-tp1-ep2", {**lay(2, dp=2, tp=1, moe_ep=2), "pd": "prefill"}, (2, 1, 1, 1, 2)),
], ids=lambda c: c if isinstance(c, str) else "")
def test_pd_beside_a_striped_pool_is_served_and_reaches_the_engine(case_id, edits, sizes,
                                                                   tmp_path):
    """PD's KV transfer reads and writes blocks over the stripes
    (engine/kv/transfer/striped.py): a P or D node with sp, cp or dp validates and is
    served; only the KV tiers and swap preemption stay refused beside a striped pool."""
    from server.engine.config import engine_config_from_app
    edits = dict(edits)
    role = edits.pop("pd")
    node = {**P_NODE_ROLE, "ServerConfig.pdRole": role,
            "ServerConfig.pdPeers": [] if role == "prefill" else ["10.0.0.2"]}
    cfg = load({**edits, **node, PP: mtp(1)}, tmp_path)
    assert cfg.unserved == []
    par = engine_config_from_app(cfg).parallel
    assert (par.world_size, par.tp, par.cp, par.sp, par.dp) == sizes


@pytest.mark.parametrize("case_id,edits,path,what,fix", SP_WITH, ids=[c[0] for c in SP_WITH])
def test_cp_beside_a_block_mover_is_not_served(case_id, edits, path, what, fix, tmp_path):
    """cp > 1 runs on sp's striped pool: the same block movers are refused, at their key."""
    cfg = load({**lay(4, tp=2, sp=2, cp=2, moe_ep=4), **edits}, tmp_path)
    [note] = cfg.unserved
    assert note.path == path and f"{MC0}.sp" in note.related
    assert f"{what} moves whole blocks of one pool: not served together" in note.message


D_NODE = {"ServerConfig.inferMode": "dmi", "ServerConfig.interCommPort": 1300,
          "ServerConfig.pdRole": "decode", "ServerConfig.pdPeers": ["10.0.0.2"]}
# (id, edits, env, path, texts that must appear in the issue's message or allowed, related)
REFUSED = [
    ("tp-cp-dp-not-world", lay(4, tp=2, moe_ep=2), None, f"{MC0}.tp",
     ["tp * cp * dp == worldSize (4)", "2 x 1 x 1 = 2, not worldSize (4)"], f"{MC0}.worldSize"),
    ("dp-with-default-tp", lay(4, dp=2), None, f"{MC0}.dp",
     ["tp * cp * dp == worldSize (4)", "tp (unset: worldSize)", "tp is 2"], f"{MC0}.tp"),
    ("dp-times-tp-over-world", lay(16, dp=4, tp=8, moe_ep=16), None, f"{MC0}.tp",
     ["8 x 1 x 4 = 32, not worldSize (16)"], f"{MC0}.dp"),
    ("cp-with-dp", lay(8, tp=2, sp=2, cp=2, dp=2, moe_ep=8), None, f"{MC0}.cp",
     ["cannot be combined with dp 2", "with cp > 1, dp must be 1"], f"{MC0}.dp"),
    ("cp-without-sp", lay(4, tp=2, cp=2, moe_ep=4), None, f"{MC0}.cp",
     ["needs sp > 1", "1 unless sp > 1"], f"{MC0}.sp"),
    ("sp-not-tp", lay(4, tp=4, sp=2), None, f"{MC0}.sp",
     ["sp 2 (sequence parallel) must equal tp (4)", "1 or tp (4)"], f"{MC0}.tp"),
    ("moe-product-not-world", lay(16, dp=2, tp=8, moe_tp=4, moe_ep=2), None, f"{MC0}.moe_ep",
     ["moe_tp * moe_ep == worldSize (16)", "4 x 2 = 8"], f"{MC0}.moe_tp"),
    ("moe_tp-only-not-dividing", lay(4, moe_tp=3), None, f"{MC0}.moe_tp",
     ["moe_tp * moe_ep == worldSize (4)"], f"{MC0}.moe_ep"),
    ("tp-below-world-without-moe-keys", lay(16, dp=2, tp=8), None, f"{MC0}.moe_tp",
     ["moe_tp defaults to tp (8)", "set moe_ep (e.g. 2) or moe_tp (e.g. 16)"], f"{MC0}.tp"),
    ("mtp-k2-with-sp", {**lay(2, tp=2, sp=2), PP: mtp(2)}, None, NST,
     ["MTP with sp 2", "num_speculative_tokens must be 1", "1 with cp or sp > 1"], f"{MC0}.sp"),
    ("mtp-k2-with-cp", {**lay(4, tp=2, sp=2, cp=2, moe_ep=4), PP: mtp(2)}, None, NST,
     ["MTP with cp 2 and sp 2", "num_speculative_tokens must be 1"], f"{MC0}.cp"),
    # with MoE EP only the P node supports cp and sp (MindIE)
    ("cp-on-a-D-node-with-moe_ep", {**lay(4, tp=2, sp=2, cp=2, moe_ep=4), **D_NODE}, None,
     f"{MC0}.cp", ["cp 2 on a PD decode node with moe_ep 4", "only the P node supports cp "
                   "and sp", "1 on a D node with moe_ep > 1"], "ServerConfig.pdRole"),
    ("sp-on-a-D-node-with-moe_ep", {**lay(2, tp=2, sp=2, moe_ep=2, moe_tp=1), **D_NODE}, None,
     f"{MC0}.sp", ["sp 2 on a PD decode node with moe_ep 2", "serve the D node with cp 1 "
                   "and sp 1"], f"{MC0}.moe_ep"),
    ("pp-two", {f"{MC0}.pp": 2}, None, f"{MC0}.pp", ["pp (pipeline parallelism)", "not implemented"], None),
    ("dp-zero", {f"{MC0}.dp": 0}, None, f"{MC0}.dp", ["dp must not be 0", "-1 (unset) or >= 1"], None),
    # several nodes of worldSize / NNODES ranks: a tp or moe_tp group fits in one or is all
    ("tp-spans-nodes", {**lay(48, dp=2, tp=24, moe_ep=48), "BackendConfig.multiNodesInferEnabled": True,
                        "BackendConfig.interNodeTLSEnabled": False}, {"NNODES": "3"}, f"{MC0}.tp",
     ["tp 24 spans more than one node (16 ranks each)", "<= 16 (one node's devices) or worldSize (48)"],
     "BackendConfig.multiNodesInferEnabled"),
    ("moe_tp-spans-nodes", {**lay(48, moe_tp=24), "BackendConfig.multiNodesInferEnabled": True,
                            "BackendConfig.interNodeTLSEnabled": False}, {"NNODES": "3"},
     f"{MC0}.moe_tp", ["moe_tp 24 spans more than one node"], f"{MC0}.worldSize"),
]


@pytest.mark.parametrize("case_id,edits,env,path,texts,related", REFUSED, ids=[c[0] for c in REFUSED])
def test_each_broken_rule_is_refused_at_its_key(case_id, edits, env, path, texts, related, tmp_path):
    issues = refused(edits, tmp_path, env)
    assert [i.path for i in issues] == [path], [str(i) for i in issues]   # one mistake, one report
    [issue] = issues
    for text in texts:
        assert text in issue.message or text in issue.allowed, str(issue)
    if related:
        assert related in issue.related, issue.related


def test_independent_broken_rules_are_all_reported(tmp_path):
    """cp 2 on one rank breaks the product rule and 'cp needs sp' at once: both are said
    (at cp, the key written: tp is left at its default)."""
    issues = refused(lay(1, cp=2), tmp_path)
    assert [i.path for i in issues] == [f"{MC0}.cp", f"{MC0}.cp"], [str(i) for i in issues]
    assert "1 x 2 x 1 = 2, not worldSize (1)" in issues[0].message
    assert "needs sp > 1" in issues[1].message


def test_multi_node_layout_within_one_node_is_accepted(tmp_path):
    cfg = load({**lay(32, dp=2, tp=16, moe_ep=32), "BackendConfig.multiNodesInferEnabled": True,
                "BackendConfig.interNodeTLSEnabled": False}, tmp_path, {"NNODES": "2"})
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.nnodes) == (16, 2, 2)
    assert cfg.unserved == []


def test_rank_groups():
    """tp, moe_tp, sp: contiguous ranks; dp, cp, moe_ep: strided."""
    from server.config.parallel_layout import ParallelLayout
    p = ParallelLayout(world_size=16, dp=2, moe_tp=4, moe_ep=4)
    assert p.tp == 8
    assert p.groups("tp") == (tuple(range(8)), tuple(range(8, 16)))
    assert p.groups("dp") == tuple((j, j + 8) for j in range(8))
    assert p.groups("moe_tp") == tuple(tuple(range(g * 4, g * 4 + 4)) for g in range(4))
    assert p.groups("moe_ep") == tuple((j, j + 4, j + 8, j + 12) for j in range(4))
    c = ParallelLayout(world_size=4, cp=2, sp=2, moe_tp=1, moe_ep=4)
    assert c.groups("cp") == ((0, 2), (1, 3))
    assert c.groups("sp") == c.groups("tp") == ((0, 1), (2, 3))
    assert c.groups("moe_tp") == ((0,), (1,), (2,), (3,))
    with pytest.raises(ValueError):
        c.groups("pp")


# Sizes the layout refuses: cp without sp, sp not tp, cp with dp (and dp with sp), MoE
# ranks not covering the world, dp x cp not dividing it.
BROKEN_SIZES = [dict(world_size=4, moe_ep=4, cp=2), dict(world_size=4, moe_ep=4, sp=2),
                dict(world_size=8, moe_ep=8, dp=2, cp=2, sp=2), dict(world_size=4, moe_tp=3),
                dict(world_size=4, moe_ep=4, dp=3)]


@pytest.mark.parametrize("sizes", BROKEN_SIZES,
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_the_model_and_the_executor_refuse_a_layout_in_its_words(sizes):
    """One type owns the layout's rules (server/config/parallel_layout.py): the model's
    shard plan and the engine's executor refuse what it refuses, with its message."""
    import re

    from server.config.parallel_layout import LayoutError, ParallelLayout
    from server.engine.config import EngineConfig, EngineError, ParallelConfig
    from server.engine.executor.base import check_layout
    from server.model.parallel.plan import ParallelPlan
    with pytest.raises(LayoutError) as refused:
        ParallelLayout(**sizes).check()
    words = re.escape(str(refused.value))
    with pytest.raises(LayoutError, match=words):
        ParallelPlan(**sizes, rank=0)
    with pytest.raises(EngineError, match=words):
        check_layout(EngineConfig(parallel=ParallelConfig(**sizes)))


def test_a_layout_that_holds_is_taken_by_all_three():
    from server.config.parallel_layout import ParallelLayout
    from server.engine.config import EngineConfig, ParallelConfig
    from server.engine.executor.base import check_layout
    from server.model.parallel.plan import ParallelPlan
    sizes = dict(world_size=4, moe_tp=1, moe_ep=4, sp=2, cp=2)
    assert ParallelLayout(**sizes).problems() == [] and ParallelLayout(**sizes).tp == 2
    assert ParallelPlan(**sizes, rank=3).cp_rank == 1
    check_layout(EngineConfig(parallel=ParallelConfig(**sizes)))


DP_SP_NOTE = ("sp 2 (sequence parallel) with dp 2 (attention data parallel) is a valid "
              "MindIE layout but this build does not serve the two together yet; serve "
              "with sp 1")


def test_check_reports_a_valid_but_unserved_layout(build):
    """dp2/tp2/sp2/moe_ep4 on 4 devices: the rules pass, the config prints, and --check
    exits 1 because the daemon would refuse to start on it."""
    path = build(lay(4, dp=2, tp=2, sp=2, moe_ep=4))
    proc = run_cli("--check", "--config-file", str(path))
    assert proc.returncode == 1, proc.stderr
    out = json.loads(proc.stdout)
    assert out["Derived"]["parallel"] == {
        "worldSize": 4, "tp": 2, "dp": 2, "cp": 1, "sp": 2, "moe_tp": 1, "moe_ep": 4,
        "followsMindIERules": True, "notServed": [DP_SP_NOTE]}
    assert ("parallel layout follows MindIE's rules: worldSize 4 = tp 2 x cp 1 x dp 2 (sp 2); "
            "MoE moe_tp 1 x moe_ep 4") in proc.stderr
    assert "not served by this build" in proc.stderr
    assert f"{MC0}.sp: {DP_SP_NOTE}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_passes_tp2_sp2_cp2_on_4_devices(build):
    """Context parallel is served: --check exits 0 on MindIE's tp2/sp2/cp2 layout."""
    proc = run_cli("--check", "--config-file", str(build(lay(4, tp=2, sp=2, cp=2, moe_ep=4))))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["Derived"]["parallel"] == {
        "worldSize": 4, "tp": 2, "dp": 1, "cp": 2, "sp": 2, "moe_tp": 1, "moe_ep": 4,
        "followsMindIERules": True, "notServed": []}
    assert ("parallel layout follows MindIE's rules: worldSize 4 = tp 2 x cp 2 x dp 1 (sp 2); "
            "MoE moe_tp 1 x moe_ep 4") in proc.stderr
    assert "not served" not in proc.stderr and "Traceback" not in proc.stderr


def test_check_passes_a_served_layout_and_fails_a_broken_one(build):
    ok = run_cli("--check", "--config-file", str(build(lay(2, tp=2, moe_ep=2, moe_tp=1))))
    assert ok.returncode == 0, ok.stderr
    assert "parallel layout follows MindIE's rules" in ok.stderr
    assert "not served" not in ok.stderr
    bad = run_cli("--check", "--config-file", str(build(lay(16, dp=2, tp=8), name="bad.json")))
    assert bad.returncode == 2
    assert f"{MC0}.moe_tp" in bad.stderr and "follows MindIE's rules" not in bad.stderr


def test_daemon_refuses_an_unserved_layout_before_loading_anything(build):
    """The start path (server.__main__.main without --check) refuses with the message and
    exit 1, and has imported neither the daemon nor torch."""
    path = build(lay(4, dp=2, tp=2, sp=2, moe_ep=4))
    code = ("import sys; from server.__main__ import main; "
            f"rc = main(['--config-file', {str(path)!r}], env={{}}); "
            "print('loaded:', 'server.daemon' in sys.modules, 'server.node' in sys.modules, "
            "'torch' in sys.modules); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=REPO, timeout=60, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 1, proc.stderr
    assert "loaded: False False False" in proc.stdout
    assert "the daemon refuses to start on it" in proc.stderr
    assert f"{MC0}.sp: {DP_SP_NOTE}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_instance_with_cp_and_moe_ep_takes_only_the_prefill_role(tmp_path):
    """MindIE's rule for a D node (only P supports cp/sp with MoE EP) also holds for a role
    the management API assigns later: POST /v1/role/decode is refused with the reason."""
    from server.pd.instance import pd_settings
    from server.pd.roles import RoleError, RoleState
    no_role = {"ServerConfig.inferMode": "dmi", "ServerConfig.interCommPort": 1300}
    body = {"local": {}, "peers": [{"server_ip": "10.0.0.2"}]}
    settings = pd_settings(load({**lay(4, tp=2, sp=2, cp=2, moe_ep=4), **no_role}, tmp_path))
    roles = RoleState(refused=dict(settings.refused_roles))
    with pytest.raises(RoleError, match=r"cp 2 and sp 2 with moe_ep 4: with MoE expert "
                                        r"parallel only the P node supports cp and sp"):
        roles.assign("decode", body)
    assert roles.role is None
    roles.assign("prefill", body)
    assert roles.role == "prefill"
    for served in (lay(2, dp=2, tp=1, moe_ep=2), lay(2, tp=2, sp=2)):
        assert pd_settings(load({**served, **no_role}, tmp_path)).refused_roles == {}
