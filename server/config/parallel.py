"""How worldSize, tp, dp, cp, sp, moe_tp, moe_ep, npuDeviceIds and the multi-node keys fit.

MindIE's layout rules for DeepSeek-V3/R1 (keys of ``ModelConfig[0]``), checked by
``parallel_issues``; each broken rule is one ConfigIssue at the key to edit.  The rules
between the sizes are the layout's own (parallel_layout.py: tp x cp x dp == worldSize,
cp with sp and without dp, sp 1 or tp, moe_tp x moe_ep == worldSize); this module adds
what only the keys tell:

* tp as written: it defaults to worldSize, dp to -1 (unset, counted as 1), cp and sp to
  1, and the product rule is said of the keys the operator wrote (a broken tp is named
  once: the rule "sp equals tp" is not judged against it).
* The MoE layers' defaults: with neither key given moe_tp is tp (so tp < worldSize needs
  moe_ep or moe_tp); with only moe_ep given moe_tp is worldSize / moe_ep, with only
  moe_tp, moe_ep is worldSize / moe_tp.
* tp and moe_tp each fit on one node (at most its devices) or span the whole world.
* MTP with cp > 1 or sp > 1 drafts one token (num_speculative_tokens 1).
* With MoE expert parallel (moe_ep > 1) in PD disaggregation only the P node supports cp
  and sp: a D node (``ServerConfig.pdRole`` "decode") has them at 1.
* pp > 1 (pipeline parallel) is refused by the field validator in mindie/sections.py.

Rank groups (``ParallelLayout.groups``): tp, moe_tp and sp groups are runs of contiguous
ranks (0..n-1, n..2n-1, ...); dp, cp and moe_ep groups are strided: group j holds
j, j + s, j + 2s, ... with s = worldSize / size.  (server/model/parallel/plan.py places expert
groups the same way: rank r is in expert group r // moe_tp, slice r % moe_tp.)
``NodeLayout`` is the layout as this node runs it: the sizes, the node's place and the
rendezvous.

One node's ranks run on the devices of ``npuDeviceIds[0]``, one per rank; with
``multiNodesInferEnabled`` the group spans ``$NNODES`` nodes of ``worldSize / NNODES``
ranks each (npuDeviceIds is then ignored, as MindIE ignores it for multi-node), meeting
at ``$MASTER_ADDR:$MASTER_PORT`` (the port defaults to ``multiNodesInferPort``).

What this build serves is a separate question, answered by ``unserved_parallel``: a
layout can follow MindIE's rules and still need a kind of parallelism the engine does not
run (today dp above 1 together with sp above 1), or sp or dp above 1 next to a feature
that moves whole KV blocks of one device pool (``unserved_with_striped_kv``: the host/disk
KV tier, swap preemption; a striped pool has each block on one rank, a dp pool each
request's blocks in one group).  PD disaggregation's KV transfer is served beside them:
it reads and writes blocks by global id over the stripes (engine/kv/transfer/striped.py).
cp above 1 is served (server/model/parallel/context.py) and always comes with sp above
1, so those refusals cover it too.  Those are not rule violations: ``--check`` reports
them apart, and the daemon refuses to start on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from server.config.errors import ConfigIssue
from server.config.mindie.sections import MindIEConfig, ModelConfig
from server.config.parallel_layout import LayoutProblem, ParallelLayout, Rule

BC = "BackendConfig"
MC0 = "BackendConfig.ModelDeployConfig.ModelConfig[0]"


@dataclass(frozen=True, slots=True)
class NodeLayout(ParallelLayout):
    """The layout as one node runs it: its sizes (and rules), and where its ranks meet."""
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None   # None: this node alone, rendezvous on loopback
    master_port: int | None = None   # None: the engine opens the store on a port it binds
    device_ids: tuple[int, ...] = ()


def _dp(mc: ModelConfig) -> int:
    return 1 if mc.dp == -1 else mc.dp


def _tp(mc: ModelConfig) -> int:
    return mc.tp if mc.tp is not None else mc.world_size


def _moe_sizes(mc: ModelConfig, tp: int) -> tuple[int, int]:
    """MindIE's (moe_tp, moe_ep): neither given -> (tp, 1); one given -> the other is
    worldSize divided by it."""
    world = mc.world_size
    if mc.moe_tp is None and mc.moe_ep is None:
        return tp, 1
    if mc.moe_tp is None:
        return max(1, world // mc.moe_ep), mc.moe_ep
    if mc.moe_ep is None:
        return mc.moe_tp, max(1, world // mc.moe_tp)
    return mc.moe_tp, mc.moe_ep


def _sizes(mc: ModelConfig) -> ParallelLayout:
    """The sizes the keys set (tp is the layout's: worldSize / (dp x cp))."""
    moe_tp, moe_ep = _moe_sizes(mc, _tp(mc))
    return ParallelLayout(mc.world_size, moe_tp, moe_ep, sp=mc.sp, dp=_dp(mc), cp=mc.cp)


def parallel_layout(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> NodeLayout:
    """The layout the rules below accept (call after they passed)."""
    env = env or {}
    b = doc.backend
    mc = b.model_deploy.model_configs[0]
    s = _sizes(mc)
    sizes = dict(world_size=s.world_size, moe_tp=s.moe_tp, moe_ep=s.moe_ep, sp=s.sp, dp=s.dp,
                 cp=s.cp)
    if not b.multi_nodes_infer_enabled:
        return NodeLayout(**sizes, device_ids=b.npu_device_ids[0] if mc.world_size > 1 else ())
    return NodeLayout(**sizes, nnodes=int(env.get("NNODES", "1")),
                      node_rank=int(env.get("NODE_RANK", "0")),
                      master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(env.get("MASTER_PORT", b.multi_nodes_infer_port)))


def _issue(problem: LayoutProblem) -> ConfigIssue:
    """A broken layout rule, at the key of ModelConfig[0] to edit."""
    return ConfigIssue(f"{MC0}.{problem.key}", problem.value, problem.allowed, problem.message,
                       related=tuple(f"{MC0}.{k}" for k in problem.related))


# What the engine runs today (server/model/parallel/plan.py): attention tensor parallel over
# the tp ranks of each of dp attention data parallel groups (server/model/parallel/data.py),
# dense layers over all ranks, experts over moe_ep groups of moe_tp ranks, the latent KV
# striped over the tp ranks with sp = tp (server/model/parallel/sequence.py) when dp is 1,
# a step's tokens split over cp ranks (server/model/parallel/context.py).  One entry per
# kind of parallelism the engine does not run (none today): serving one of them later
# removes its entry.
_UNSERVED: dict[str, tuple[str, str]] = {}


def unserved_parallel(layout: ParallelLayout) -> list[ConfigIssue]:
    """The parts of a rule-abiding layout this build does not serve (empty: all served).

    Not rule violations: the layout is a valid MindIE layout.  The daemon refuses to start
    on any of them, and ``--check`` reports them apart from the rule check."""
    out = []
    for key, (what, advice) in _UNSERVED.items():
        size = getattr(layout, key)
        if size > 1:
            out.append(ConfigIssue(
                f"{MC0}.{key}", size, "1 (served by this build)",
                f"{key} {size} ({what}) is a valid MindIE layout but this build does not "
                f"serve it yet; {advice.format(world=layout.world_size)}",
                related=(f"{MC0}.worldSize", f"{MC0}.tp")))
    return out + [_issue(p) for p in layout.unserved()]


def unserved_with_striped_kv(layout: ParallelLayout, *, kv_pool_backend: str,
                             max_preempt_count: int) -> list[ConfigIssue]:
    """sp > 1 or dp > 1 next to what moves whole KV blocks of one device pool (the host
    and disk tiers, swap preemption): a striped pool holds each block on one rank only, a
    dp pool each request's blocks in one group's ranks, so these are refused.  (PD's KV
    transfer is served: engine/kv/transfer/striped.py.)"""
    striping = layout.kv_striping()
    if striping is None:
        return []
    key = striping.key
    found = [(f"{BC}.kvPoolConfig.backend", kv_pool_backend, bool(kv_pool_backend),
              "the host KV pool (and its disk tier)", "an empty kvPoolConfig.backend"),
             (f"{BC}.ScheduleConfig.maxPreemptCount", max_preempt_count, max_preempt_count > 0,
              "preemption by swapping to host memory", "maxPreemptCount 0")]
    return [ConfigIssue(path, value, f"{fix} (with {key} > 1)",
                        f"{striping}, and {what} moves whole blocks of one pool: "
                        f"not served together by this build; serve with {fix} or {key} 1",
                        related=(f"{MC0}.{key}",))
            for path, value, on, what, fix in found if on]


def describe_layout(layout: ParallelLayout) -> str:
    """One line for --check and the logs: the sizes and how they cover worldSize."""
    return (f"worldSize {layout.world_size} = tp {layout.tp} x cp {layout.cp} x dp {layout.dp}"
            f" (sp {layout.sp}); MoE moe_tp {layout.moe_tp} x moe_ep {layout.moe_ep}")


def _layout_issues(doc: MindIEConfig, per_node: int | None) -> Iterator[ConfigIssue]:
    """MindIE's rules on tp, dp, cp, sp, moe_tp, moe_ep (and MTP with cp/sp)."""
    mc = doc.backend.model_deploy.model_configs[0]
    p = MC0
    world, tp, dp, cp, sp = mc.world_size, _tp(mc), _dp(mc), mc.cp, mc.sp
    sizes = {"worldSize": world, "tp": tp, "cp": cp, "dp": dp}
    product_ok = tp * cp * dp == world
    if not product_ok:
        # Point at the key the operator most likely has to change: tp when written (or
        # when nothing else is above 1), else the dp/cp they wrote next to a default tp.
        key = "tp" if mc.tp is not None or (dp == 1 and cp == 1) else ("dp" if dp > 1 else "cp")
        hint = ""
        if world % (cp * dp) == 0:
            hint = f"; with cp {cp} and dp {dp}, tp is {world // (cp * dp)}"
        tp_unset = " (unset: worldSize)" if mc.tp is None else ""
        dp_unset = " (unset: 1)" if mc.dp == -1 else ""
        yield ConfigIssue(
            f"{p}.{key}", sizes, f"tp * cp * dp == worldSize ({world})",
            f"tp{tp_unset} x cp x dp{dp_unset} is {tp} x {cp} x {dp} = {tp * cp * dp}, not "
            f"worldSize ({world}){hint}",
            related=(f"{p}.worldSize", f"{p}.tp", f"{p}.cp", f"{p}.dp"))
    for problem in _sizes(mc).problems():
        if problem.rule is Rule.COVERS_WORLD:       # said above, of the keys as written
            continue
        if problem.rule is Rule.SP_IS_TP and not product_ok:   # the tp named above
            continue
        if problem.rule is Rule.MOE_COVERS_WORLD:
            issue = _moe_issue(mc, problem, product_ok)
            if issue is not None:
                yield issue
            continue
        yield _issue(problem)
    moe_tp, moe_ep = _moe_sizes(mc, tp)
    if per_node is not None and per_node < world:
        for key, size in (("tp", tp), ("moe_tp", moe_tp)):
            if per_node < size < world:
                yield ConfigIssue(
                    f"{p}.{key}", size, f"<= {per_node} (one node's devices) or worldSize ({world})",
                    f"{key} {size} spans more than one node ({per_node} ranks each) but not "
                    "the whole group: a group must fit on one node or be the whole world",
                    related=(f"{p}.worldSize", f"{BC}.multiNodesInferEnabled"))
    sv = doc.server
    if (cp > 1 or sp > 1) and moe_ep > 1 and sv.infer_mode == "dmi" and sv.pd_role == "decode":
        key, size = ("cp", cp) if cp > 1 else ("sp", sp)
        yield ConfigIssue(
            f"{p}.{key}", size, "1 on a D node with moe_ep > 1",
            f"{key} {size} on a PD decode node with moe_ep {moe_ep}: with MoE expert "
            "parallel only the P node supports cp and sp; serve the D node with cp 1 and sp 1",
            related=("ServerConfig.pdRole", f"{p}.moe_ep", f"{p}.sp"))
    mtp = mc.plugin_params.mtp
    if mtp is not None and (cp > 1 or sp > 1) and mtp.num_speculative_tokens != 1:
        with_ = " and ".join(f"{k} {v}" for k, v in (("cp", cp), ("sp", sp)) if v > 1)
        yield ConfigIssue(
            f"{p}.plugin_params.num_speculative_tokens", mtp.num_speculative_tokens,
            "1 with cp or sp > 1",
            f"MTP with {with_} drafts one token: num_speculative_tokens must be 1",
            related=(f"{p}.cp", f"{p}.sp", f"{p}.plugin_params.plugin_type"))


def _moe_issue(mc: ModelConfig, problem: LayoutProblem, product_ok: bool) -> ConfigIssue | None:
    """moe_tp x moe_ep not covering the world, said of the keys the operator wrote: with
    neither given, of their defaults (unless tp itself is broken: the product rule's
    report already covers the moe_tp it gives); else at the key given."""
    world, tp = mc.world_size, _tp(mc)
    p = MC0
    if mc.moe_tp is None and mc.moe_ep is None:
        if not product_ok:
            return None
        return ConfigIssue(
            f"{p}.moe_tp", problem.value, problem.allowed,
            f"with neither moe_tp nor moe_ep set, moe_tp defaults to tp ({tp}) and moe_ep "
            f"to 1, which do not cover worldSize ({world}): set moe_ep (e.g. "
            f"{max(1, world // tp)}) or moe_tp (e.g. {world})",
            related=(f"{p}.tp", f"{p}.worldSize", f"{p}.moe_ep"))
    return ConfigIssue(f"{p}.moe_ep" if mc.moe_ep is not None else f"{p}.moe_tp", problem.value,
                       problem.allowed, problem.message,
                       related=tuple(f"{MC0}.{k}" for k in problem.related))


def parallel_issues(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> Iterator[ConfigIssue]:
    env = env or {}
    b = doc.backend
    if not b.model_deploy.model_configs:
        return
    mc = b.model_deploy.model_configs[0]
    world = mc.world_size
    if not b.multi_nodes_infer_enabled:
        ids = b.npu_device_ids[0]
        yield from _layout_issues(doc, len(ids) if len(ids) == world else None)
        if len(ids) != world:
            yield ConfigIssue(f"{BC}.npuDeviceIds", [list(ids)],
                              f"one list of worldSize ({world}) device ids, e.g. "
                              f"{[list(range(world))]}",
                              "each rank runs on one device of npuDeviceIds[0]",
                              related=(f"{MC0}.worldSize",))
        return
    if b.inter_node_tls_enabled:
        yield ConfigIssue(f"{BC}.interNodeTLSEnabled", True, "false",
                          "inter-node traffic (torch.distributed over TCP) is not encrypted "
                          "here; say so explicitly with interNodeTLSEnabled: false and keep "
                          "the nodes on a private network")
    for var in ("NNODES", "NODE_RANK", "MASTER_PORT"):
        raw = env.get(var)
        if raw is not None and not raw.strip().isdecimal():
            yield ConfigIssue(f"${var}", raw, "a non-negative integer", "unrecognised value")
            yield from _layout_issues(doc, None)
            return
    nnodes = int(env.get("NNODES", "1"))
    node_rank = int(env.get("NODE_RANK", "0"))
    nodes_ok = nnodes >= 1 and world % nnodes == 0
    yield from _layout_issues(doc, world // nnodes if nodes_ok else None)
    if not nodes_ok:
        yield ConfigIssue("$NNODES", nnodes, f"a divisor of worldSize ({world})",
                          "every node runs worldSize / NNODES ranks")
    elif node_rank >= nnodes:
        yield ConfigIssue("$NODE_RANK", node_rank, f"0 .. NNODES - 1 ({nnodes - 1})",
                          "node rank outside the group")
    port = int(env.get("MASTER_PORT", b.multi_nodes_infer_port))
    if not 1024 <= port <= 65535:
        yield ConfigIssue("$MASTER_PORT", port, "1024..65535", "not a usable port")
