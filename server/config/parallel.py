"""How worldSize, tp, dp, cp, sp, moe_tp, moe_ep, npuDeviceIds and the multi-node keys fit.

MindIE's layout rules for DeepSeek-V3/R1 (keys of ``ModelConfig[0]``), checked by
``parallel_issues``; each broken rule is one ConfigIssue at the key to edit:

* ``tp * cp * dp == worldSize``.  tp defaults to worldSize, dp to -1 (unset, counted as
  1), cp and sp to 1.
* cp > 1 is never combined with dp > 1, and needs sp > 1 (CP runs on top of SP).
* sp, when > 1, equals tp.
* The MoE layers: ``moe_tp * moe_ep == worldSize`` (moe_ep 1: moe_tp == worldSize).
  With neither key given moe_tp is tp (so tp < worldSize needs moe_ep or moe_tp); with
  only moe_ep given moe_tp is worldSize / moe_ep, with only moe_tp, moe_ep is
  worldSize / moe_tp.
* tp and moe_tp each fit on one node (at most its devices) or span the whole world.
* MTP with cp > 1 or sp > 1 drafts one token (num_speculative_tokens 1).
* With MoE expert parallel (moe_ep > 1) in PD disaggregation only the P node supports cp
  and sp: a D node (``ServerConfig.pdRole`` "decode") has them at 1.
* pp > 1 (pipeline parallel) is refused by the field validator in sections.py.

Rank groups (``ParallelLayout.groups``): tp, moe_tp and sp groups are runs of contiguous
ranks (0..n-1, n..2n-1, ...); dp, cp and moe_ep groups are strided: group j holds
j, j + s, j + 2s, ... with s = worldSize / size.  (server/model/parallel/plan.py places expert
groups the same way: rank r is in expert group r // moe_tp, slice r % moe_tp.)

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
it reads and writes blocks by global id over the stripes (engine/kv/transfer/striped.py).  cp above 1 is served (server/model/parallel/context.py)
and always comes with sp above 1, so those refusals cover it too.  Those are not rule violations: ``--check``
reports them apart, and the daemon refuses to start on them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from server.config.errors import ConfigIssue
from server.config.sections import MindIEConfig, ModelConfig

BC = "BackendConfig"
MC0 = "BackendConfig.ModelDeployConfig.ModelConfig[0]"

CONTIGUOUS_GROUPS = ("tp", "moe_tp", "sp")
STRIDED_GROUPS = ("dp", "cp", "moe_ep")


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    world_size: int = 1
    tp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None   # None: this node alone, rendezvous on loopback
    master_port: int | None = None   # None: the engine opens the store on a port it binds
    device_ids: tuple[int, ...] = ()
    dp: int = 1                      # attention data parallel (MindIE's -1 = unset = 1)
    cp: int = 1                      # context parallel
    sp: int = 1                      # sequence parallel

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The rank groups of one kind ("tp", "moe_tp", "sp": contiguous; "dp", "cp",
        "moe_ep": strided), each group's ranks in order."""
        if kind not in CONTIGUOUS_GROUPS + STRIDED_GROUPS:
            raise ValueError(f"no such group kind: {kind!r}")
        size, world = getattr(self, kind), self.world_size
        if size < 1 or world % size:
            raise ValueError(f"{kind} {size} does not divide worldSize {world}")
        count = world // size
        if kind in CONTIGUOUS_GROUPS:
            return tuple(tuple(range(g * size, (g + 1) * size)) for g in range(count))
        return tuple(tuple(range(j, world, count)) for j in range(count))


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


def parallel_layout(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> ParallelLayout:
    """The layout the rules below accept (call after they passed)."""
    env = env or {}
    b = doc.backend
    mc = b.model_deploy.model_configs[0]
    tp = _tp(mc)
    moe_tp, moe_ep = _moe_sizes(mc, tp)
    sizes = dict(dp=_dp(mc), cp=mc.cp, sp=mc.sp)
    if not b.multi_nodes_infer_enabled:
        return ParallelLayout(mc.world_size, tp, moe_tp, moe_ep, **sizes,
                              device_ids=b.npu_device_ids[0] if mc.world_size > 1 else ())
    return ParallelLayout(mc.world_size, tp, moe_tp, moe_ep, **sizes,
                          nnodes=int(env.get("NNODES", "1")),
                          node_rank=int(env.get("NODE_RANK", "0")),
                          master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=int(env.get("MASTER_PORT", b.multi_nodes_infer_port)))


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
    if layout.dp > 1 and layout.sp > 1:
        out.append(ConfigIssue(
            f"{MC0}.sp", layout.sp, "1 with dp > 1 (served by this build)",
            f"sp {layout.sp} (sequence parallel) with dp {layout.dp} (attention data "
            "parallel) is a valid MindIE layout but this build does not serve the two "
            "together yet; serve with sp 1", related=(f"{MC0}.dp", f"{MC0}.tp")))
    return out


def unserved_with_striped_kv(layout: ParallelLayout, *, kv_pool_backend: str,
                             max_preempt_count: int) -> list[ConfigIssue]:
    """sp > 1 or dp > 1 next to what moves whole KV blocks of one device pool (the host
    and disk tiers, swap preemption): a striped pool holds each block on one rank only, a
    dp pool each request's blocks in one group's ranks, so these are refused.  (PD's KV
    transfer is served: engine/kv/transfer/striped.py.)"""
    if layout.sp > 1:
        key, size, does = "sp", layout.sp, "(sequence parallel) stripes the KV pool over the ranks"
    elif layout.dp > 1:
        key, size, does = "dp", layout.dp, "(attention data parallel) splits the KV pool over its groups"
    else:
        return []
    found = [(f"{BC}.kvPoolConfig.backend", kv_pool_backend, bool(kv_pool_backend),
              "the host KV pool (and its disk tier)", "an empty kvPoolConfig.backend"),
             (f"{BC}.ScheduleConfig.maxPreemptCount", max_preempt_count, max_preempt_count > 0,
              "preemption by swapping to host memory", "maxPreemptCount 0")]
    return [ConfigIssue(path, value, f"{fix} (with {key} > 1)",
                        f"{key} {size} {does}, and {what} moves whole blocks of one pool: "
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
    if cp > 1 and dp > 1:
        yield ConfigIssue(f"{p}.cp", cp, "1 when dp > 1",
                          f"cp {cp} (context parallel) cannot be combined with dp {dp} "
                          "(attention data parallel): with cp > 1, dp must be 1",
                          related=(f"{p}.dp",))
    if cp > 1 and sp <= 1:
        yield ConfigIssue(f"{p}.cp", cp, "1 unless sp > 1",
                          f"cp {cp} (context parallel) needs sp > 1 (sequence parallel, sp "
                          "equal to tp): cp cannot be enabled on its own",
                          related=(f"{p}.sp", f"{p}.tp"))
    if sp > 1 and sp != tp:
        yield ConfigIssue(f"{p}.sp", sp, f"1 or tp ({tp})",
                          f"sp {sp} (sequence parallel) must equal tp ({tp}) when above 1",
                          related=(f"{p}.tp",))
    moe_tp, moe_ep = _moe_sizes(mc, tp)
    moe = {"moe_tp": moe_tp, "moe_ep": moe_ep}
    moe_given = mc.moe_tp is not None or mc.moe_ep is not None
    if moe_tp * moe_ep != world and not moe_given and product_ok:
        # (when tp itself is broken, the report above already covers its moe_tp default)
        yield ConfigIssue(
            f"{p}.moe_tp", moe, f"moe_tp * moe_ep == worldSize ({world})",
            f"with neither moe_tp nor moe_ep set, moe_tp defaults to tp ({tp}) and moe_ep "
            f"to 1, which do not cover worldSize ({world}): set moe_ep (e.g. "
            f"{max(1, world // tp)}) or moe_tp (e.g. {world})",
            related=(f"{p}.tp", f"{p}.worldSize", f"{p}.moe_ep"))
    elif moe_tp * moe_ep != world and moe_given:
        yield ConfigIssue(
            f"{p}.moe_ep" if mc.moe_ep is not None else f"{p}.moe_tp", moe,
            f"moe_tp * moe_ep == worldSize ({world})",
            f"the MoE layers' ranks must cover the group: moe_tp x moe_ep is {moe_tp} x "
            f"{moe_ep} = {moe_tp * moe_ep}, not worldSize ({world})",
            related=(f"{p}.worldSize", f"{p}.moe_tp", f"{p}.moe_ep"))
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
