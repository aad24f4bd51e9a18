"""How worldSize, tp, dp, moe_tp, moe_ep, npuDeviceIds and the multi-node keys fit.

MindIE's rules: ``tp * dp == worldSize`` (tp defaults to worldSize, dp to 1), and the MoE
layers use ``moe_tp * moe_ep == worldSize`` (moe_tp defaults to tp, or to worldSize /
moe_ep when only moe_ep is given).  One node's ranks run on the devices of
``npuDeviceIds[0]``, one per rank; with ``multiNodesInferEnabled`` the group spans
``$NNODES`` nodes of ``worldSize / NNODES`` ranks each (npuDeviceIds is then ignored, as
MindIE ignores it for multi-node), meeting at ``$MASTER_ADDR:$MASTER_PORT`` (the port
defaults to ``multiNodesInferPort``).  dp > 1 (attention data parallel), cp, sp and pp are
refused by the field validators in sections.py.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping

from server.config.errors import ConfigIssue
from server.config.sections import MindIEConfig, ModelConfig

BC = "BackendConfig"


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    world_size: int = 1
    tp: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None   # None: this node alone, rendezvous on loopback
    master_port: int | None = None   # None: any free loopback port
    device_ids: tuple[int, ...] = ()


def _moe_sizes(mc: ModelConfig, tp: int) -> tuple[int, int]:
    world = mc.world_size
    if mc.moe_tp is None and mc.moe_ep is None:
        return world, 1            # MindIE: moe_tp = tp, which must be worldSize here
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
    tp = mc.tp if mc.tp is not None else mc.world_size
    moe_tp, moe_ep = _moe_sizes(mc, tp)
    if not b.multi_nodes_infer_enabled:
        return ParallelLayout(mc.world_size, tp, moe_tp, moe_ep,
                              device_ids=b.npu_device_ids[0] if mc.world_size > 1 else ())
    return ParallelLayout(mc.world_size, tp, moe_tp, moe_ep, nnodes=int(env.get("NNODES", "1")),
                          node_rank=int(env.get("NODE_RANK", "0")),
                          master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                          master_port=int(env.get("MASTER_PORT", b.multi_nodes_infer_port)))


def parallel_issues(doc: MindIEConfig, env: Mapping[str, str] | None = None) -> Iterator[ConfigIssue]:
    env = env or {}
    b = doc.backend
    if not b.model_deploy.model_configs:
        return
    mc = b.model_deploy.model_configs[0]
    p = "BackendConfig.ModelDeployConfig.ModelConfig[0]"
    world = mc.world_size
    tp = mc.tp if mc.tp is not None else world
    if tp != world:
        yield ConfigIssue(f"{p}.tp", tp, f"worldSize ({world}): tp * dp == worldSize, dp is 1",
                          "tp must equal worldSize (attention data parallelism, dp > 1, is "
                          "not implemented)", related=(f"{p}.worldSize", f"{p}.dp"))
    moe_tp, moe_ep = _moe_sizes(mc, tp)
    if moe_tp * moe_ep != world:
        yield ConfigIssue(f"{p}.moe_ep" if mc.moe_ep is not None else f"{p}.moe_tp",
                          {"moe_tp": moe_tp, "moe_ep": moe_ep},
                          f"moe_tp * moe_ep == worldSize ({world})",
                          "the MoE layers' ranks must cover the group",
                          related=(f"{p}.worldSize", f"{p}.moe_tp", f"{p}.moe_ep"))
    if not b.multi_nodes_infer_enabled:
        ids = b.npu_device_ids[0]
        if len(ids) != world:
            yield ConfigIssue(f"{BC}.npuDeviceIds", [list(ids)],
                              f"one list of worldSize ({world}) device ids, e.g. "
                              f"{[list(range(world))]}",
                              "each rank runs on one device of npuDeviceIds[0]",
                              related=(f"{p}.worldSize",))
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
            return
    nnodes = int(env.get("NNODES", "1"))
    node_rank = int(env.get("NODE_RANK", "0"))
    if nnodes < 1 or world % nnodes:
        yield ConfigIssue("$NNODES", nnodes, f"a divisor of worldSize ({world})",
                          "every node runs worldSize / NNODES ranks")
    elif node_rank >= nnodes:
        yield ConfigIssue("$NODE_RANK", node_rank, f"0 .. NNODES - 1 ({nnodes - 1})",
                          "node rank outside the group")
    port = int(env.get("MASTER_PORT", b.multi_nodes_infer_port))
    if not 1024 <= port <= 65535:
        yield ConfigIssue("$MASTER_PORT", port, "1024..65535", "not a usable port")
