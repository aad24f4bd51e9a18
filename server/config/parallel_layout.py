"""A parallel layout's sizes and the rules between them, in one torch-free type.

``ParallelLayout`` is worldSize ranks cut for DeepSeek-V3/R1 as MindIE cuts them:

* tp x cp x dp == worldSize: dp attention data parallel groups, or cp context parallel
  ranks (never both), of tp contiguous ranks that split the attention heads.  tp is not
  a size of its own here: it is what is left, worldSize / (dp x cp).
* cp > 1 needs sp > 1 (context parallel runs on sequence parallel's striped cache).
* sp, when above 1, equals tp: the latent KV cache striped over a tp group's ranks.
* moe_tp x moe_ep == worldSize: the routed experts over moe_ep groups of moe_tp ranks.

One pair of sizes follows the rules and is still not run by this build: dp above 1 with
sp above 1 (``unserved``).

Why one type: the rules used to be written three times, by the config check, the model's
shard plan and the executor, each in its own words and error type.  Each now asks this
type and adds only what it alone knows:

  server/config/parallel.py       MindIE's keys (the tp written or left unset, the MoE
                                  defaults), nodes, PD roles, MTP; issues at key paths
  server/model/parallel/plan.py   ParallelPlan: a layout plus the rank a shard is cut for
  server/engine/config.py         ParallelConfig: a layout plus the rendezvous; the
                                  executor refuses a broken one and the KV tiers beside a
                                  striped pool (engine/executor/base.py)
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

CONTIGUOUS_GROUPS = ("tp", "moe_tp", "sp")
STRIDED_GROUPS = ("dp", "cp", "moe_ep")


class LayoutError(ValueError):
    """Sizes that break a layout rule or that this build does not serve (the message says
    which)."""


class Rule(enum.Enum):
    """The rule a ``LayoutProblem`` breaks (the config check words two of them itself:
    it knows which keys the operator wrote)."""
    COVERS_WORLD = "tp x cp x dp == worldSize"
    CP_WITHOUT_DP = "cp > 1 only with dp 1"
    CP_NEEDS_SP = "cp > 1 only with sp > 1"
    SP_IS_TP = "sp 1 or tp"
    MOE_COVERS_WORLD = "moe_tp x moe_ep == worldSize"
    DP_WITH_SP = "dp > 1 and sp > 1 not served together"


@dataclass(frozen=True, slots=True)
class LayoutProblem:
    rule: Rule
    key: str                          # the size to change: "cp", "sp", "moe_ep" ...
    value: object                     # its value (the sizes involved, for a product)
    allowed: str
    message: str
    related: tuple[str, ...] = ()     # the other sizes the rule read


@dataclass(frozen=True, slots=True)
class KvStriping:
    """What keeps the KV pool from being one device pool: its blocks live on different
    ranks (sp > 1: each block on one rank of the stripe) or in different dp groups."""
    key: str                          # "sp" or "dp"
    size: int
    does: str

    def __str__(self) -> str:
        return f"{self.key} {self.size} {self.does}"


@dataclass(frozen=True, slots=True)
class ParallelLayout:
    world_size: int = 1
    moe_tp: int = 1
    moe_ep: int = 1
    sp: int = 1                       # 1 (latent cache replicated) or tp (striped over it)
    dp: int = 1                       # attention data parallel groups (MindIE's -1 is 1)
    cp: int = 1                       # context parallel ranks (on top of sp)

    @property
    def tp(self) -> int:
        """Ranks that split one dp group's (or cp rank's) attention heads."""
        return self.world_size // max(1, self.dp * self.cp)

    def problems(self) -> list[LayoutProblem]:
        """Each rule these sizes break, once, in the order above (empty: they hold)."""
        world, tp, dp, cp, sp = self.world_size, self.tp, self.dp, self.cp, self.sp
        out = []
        if dp < 1 or cp < 1 or world % (dp * cp):
            key = "dp" if dp > 1 else "cp"
            out.append(LayoutProblem(
                Rule.COVERS_WORLD, key, getattr(self, key), f"tp * cp * dp == worldSize ({world})",
                f"dp {dp} x cp {cp} does not divide worldSize ({world}): no tp makes "
                "tp x cp x dp cover the ranks", ("worldSize", "cp", "dp")))
        if cp > 1 and dp > 1:
            out.append(LayoutProblem(
                Rule.CP_WITHOUT_DP, "cp", cp, "1 when dp > 1",
                f"cp {cp} (context parallel) cannot be combined with dp {dp} (attention data "
                "parallel): with cp > 1, dp must be 1", ("dp",)))
        if cp > 1 and sp <= 1:
            out.append(LayoutProblem(
                Rule.CP_NEEDS_SP, "cp", cp, "1 unless sp > 1",
                f"cp {cp} (context parallel) needs sp > 1 (sequence parallel, sp equal to "
                "tp): cp cannot be enabled on its own", ("sp", "tp")))
        if sp > 1 and sp != tp:
            out.append(LayoutProblem(
                Rule.SP_IS_TP, "sp", sp, f"1 or tp ({tp})",
                f"sp {sp} (sequence parallel) must equal tp ({tp}) when above 1", ("tp",)))
        moe_tp, moe_ep = self.moe_tp, self.moe_ep
        if moe_tp * moe_ep != world:
            out.append(LayoutProblem(
                Rule.MOE_COVERS_WORLD, "moe_ep", {"moe_tp": moe_tp, "moe_ep": moe_ep},
                f"moe_tp * moe_ep == worldSize ({world})",
                f"the MoE layers' ranks must cover the group: moe_tp x moe_ep is {moe_tp} x "
                f"{moe_ep} = {moe_tp * moe_ep}, not worldSize ({world})",
                ("worldSize", "moe_tp", "moe_ep")))
        return out

    def unserved(self) -> list[LayoutProblem]:
        """What these sizes need that this build does not run, though MindIE's rules allow
        it (the config check reports it apart; the daemon, model and executor refuse it)."""
        if self.dp > 1 and self.sp > 1:
            return [LayoutProblem(
                Rule.DP_WITH_SP, "sp", self.sp, "1 with dp > 1 (served by this build)",
                f"sp {self.sp} (sequence parallel) with dp {self.dp} (attention data "
                "parallel) is a valid MindIE layout but this build does not serve the two "
                "together yet; serve with sp 1", ("dp", "tp"))]
        return []

    def check(self) -> None:
        """Raise LayoutError naming every broken rule and every pair of sizes not served."""
        found = self.problems() + self.unserved()
        if found:
            raise LayoutError("; ".join(p.message for p in found))

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """The rank groups of one kind ("tp", "moe_tp", "sp": contiguous ranks 0..n-1,
        n..2n-1, ...; "dp", "cp", "moe_ep": strided, group j holding j, j + s, j + 2s, ...
        with s = worldSize / size), each group's ranks in order."""
        if kind not in CONTIGUOUS_GROUPS + STRIDED_GROUPS:
            raise ValueError(f"no such group kind: {kind!r}")
        size, world = getattr(self, kind), self.world_size
        if size < 1 or world % size:
            raise ValueError(f"{kind} {size} does not divide worldSize {world}")
        count = world // size
        if kind in CONTIGUOUS_GROUPS:
            return tuple(tuple(range(g * size, (g + 1) * size)) for g in range(count))
        return tuple(tuple(range(j, world, count)) for j in range(count))

    @property
    def kv_stripes(self) -> int:
        """Stripes the KV pool is cut into by block (global block b in stripe b % n):
        sp > 1 over the tp ranks (each cp rank holding a copy), dp > 1 one per dp group
        (they never combine), else 1."""
        return self.sp * self.dp

    def kv_stripe(self, rank: int) -> int:
        """The stripe rank ``rank`` holds: its place among the sp ranks, or its dp group."""
        return rank % self.sp if self.sp > 1 else rank // self.tp

    def kv_striping(self) -> KvStriping | None:
        """Why the KV pool is not one device pool (None: it is), in the words the config
        check and the executor both use when they refuse what moves whole blocks of one."""
        if self.sp > 1:
            return KvStriping("sp", self.sp, "(sequence parallel) stripes the KV pool over the "
                                             "ranks")
        if self.dp > 1:
            return KvStriping("dp", self.dp, "(attention data parallel) splits the KV pool over "
                                             "its groups")
        return None
