"""ParallelState: the process groups of one TP × PP × DP job, built from a :class:`ParallelConfig`.

    dist.init_process_group("nccl")                       # torchrun (env://) or any other init
    state = ParallelState.create(ParallelConfig(tp=4, pp=2, dp=8))
    state.tp_group, state.pp_group, state.dp_group        # this rank's groups
    state.ep_group, state.edp_group                       # with experts (ep > 1): EP and expert-DP groups
    state.tp_rank, state.pp_rank, state.dp_rank           # this rank's coordinates
    state.device_mesh                                     # DeviceMesh ("pp", "dp", "tp") for DTensor code

Rank order is ParallelConfig's (Megatron's): global rank = (pp_rank · dp + dp_rank) · tp + tp_rank,
so a TP group is ``tp`` consecutive ranks (inside one node with ``tp`` ≤ GPUs per node).

Every rank first checks that all ranks passed the same config (one ``all_gather_object``) and
validates it; a broken rule raises the same :class:`ParallelConfigError` on every rank before any
group exists, so no rank is left waiting in ``new_group`` for a rank that raised. Without an
initialised ``torch.distributed`` (a plain script) a world of one rank gets ``None`` groups,
which every layer of the package treats as a group of one.

Expert parallelism folds into DP × CP (ParallelConfig's module docstring): an EP group is ``ep``
consecutive ranks of a "dp_cp" group, the expert-data-parallel ("edp") group the ranks of that
"dp_cp" group at the same EP rank (stride ``ep``): they hold the same experts.

The embedding group joins the first and last pipeline stage of each pipeline (same TP and DP
rank): tied input/output embeddings live on both and their gradients are summed over it.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tpkernels.parallel import control

from tpkernels.parallel.config import ParallelConfig, ParallelConfigError


def _initialised() -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree_on_config(config: ParallelConfig, model_rules: dict) -> None:
    """Raise the same error on every rank when the ranks hold different configs."""
    if not _initialised() or dist.get_world_size() == 1:
        return
    mine = (config, sorted(model_rules.items()))
    every = control.all_gather_objects(mine)
    differ = [r for r, other in enumerate(every) if other != every[0]]
    if differ:
        (c0, rules0), (c1, rules1) = every[0], every[differ[0]]
        fields = [f"{f.name} ({getattr(c0, f.name)!r} on rank 0, {getattr(c1, f.name)!r} on rank {differ[0]})"
                  for f in dataclasses.fields(ParallelConfig) if getattr(c0, f.name) != getattr(c1, f.name)]
        r0, r1 = dict(rules0), dict(rules1)
        fields += [f"{k} ({r0.get(k)!r} on rank 0, {r1.get(k)!r} on rank {differ[0]})"
                   for k in sorted(set(r0) | set(r1)) if r0.get(k) != r1.get(k)]
        raise ParallelConfigError([f"ranks disagree on the layout: {'; '.join(fields)}; every rank must pass the "
                                   "same config"])


def layout_ranks(config: ParallelConfig) -> dict[str, list[list[int]]]:
    """Every group of the layout, as lists of global ranks: "tp", "cp", "dp", "pp", "dp_cp" (the
    replicas of a weight: gradients are reduced over DP and CP together), "ep" (``ep`` consecutive
    ranks of a dp_cp group: they split the experts), "edp" (the dp_cp ranks at one EP rank: the
    replicas of an expert shard) and "embedding". Rank order tp-cp-dp-pp:
    ``rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank``."""
    tp, cp, dp, pp = config.tp, config.cp, config.dp, config.pp

    def rank(p, d, c, t):
        return ((p * dp + d) * cp + c) * tp + t

    groups = {
        "tp": [[rank(p, d, c, t) for t in range(tp)] for p in range(pp) for d in range(dp) for c in range(cp)],
        "cp": [[rank(p, d, c, t) for c in range(cp)] for p in range(pp) for d in range(dp) for t in range(tp)],
        "dp": [[rank(p, d, c, t) for d in range(dp)] for p in range(pp) for c in range(cp) for t in range(tp)],
        "pp": [[rank(p, d, c, t) for p in range(pp)] for d in range(dp) for c in range(cp) for t in range(tp)],
        "dp_cp": [[rank(p, d, c, t) for d in range(dp) for c in range(cp)] for p in range(pp) for t in range(tp)],
    }
    ep = config.ep
    groups["ep"] = [g[i:i + ep] for g in groups["dp_cp"] for i in range(0, len(g), ep)]
    groups["edp"] = [g[j::ep] for g in groups["dp_cp"] for j in range(ep)]
    groups["embedding"] = [[g[0], g[-1]] if pp > 1 else [g[0]] for g in groups["pp"]]
    return groups


GROUP_NAMES = ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp", "embedding")


@dataclass
class ParallelState:
    """This rank's place in a TP × PP × DP layout and its process groups (see the module docstring).

    Groups are ``None`` when torch.distributed is not initialised (one rank). ``rank`` is the
    global rank; coordinates follow ``rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp + tp_rank``.
    """

    config: ParallelConfig
    rank: int = 0
    tp_group: object = None
    cp_group: object = None
    dp_group: object = None
    dp_cp_group: object = None
    pp_group: object = None
    embedding_group: object = None
    ep_group: object = None
    edp_group: object = None
    backend: str | None = None
    _ranks: dict = field(default_factory=dict, repr=False)
    _mesh: object = field(default=None, repr=False)

    @classmethod
    def create(cls, config: ParallelConfig, *, backend: str | None = None, key_prefix: str = "",
               **model_rules) -> "ParallelState":
        """Build the groups of ``config`` on an initialised world (collective: every rank calls it).

        backend: the groups' backend (default: the world's). model_rules: keyword arguments of
        :meth:`ParallelConfig.validate` about the model (num_layers, num_attention_heads, …), checked
        with the layout. A ``dp`` of None becomes what the world size leaves. Raises
        ParallelConfigError on every rank when a rule is broken (``key_prefix``: how the messages
        name the keys, e.g. "parallel.")."""
        if not isinstance(config, ParallelConfig):
            raise TypeError(f"config must be a ParallelConfig, not {type(config).__name__}")
        world = dist.get_world_size() if _initialised() else 1
        _agree_on_config(config, model_rules)
        # the same verdict on every rank: no group yet
        config.validate(world_size=world, key_prefix=key_prefix, **model_rules)
        config = config.for_world(world)
        state = cls(config, rank=dist.get_rank() if _initialised() else 0, backend=backend)
        state._ranks = layout_ranks(config)
        if not _initialised():
            return state
        for name in GROUP_NAMES:
            if name in ("cp", "dp_cp") and config.cp == 1:  # the same ranks as none / dp: no new groups
                continue
            if name in ("ep", "edp") and config.ep == 1:  # none / dp_cp's ranks
                continue
            mine = None
            for ranks in state._ranks[name]:  # every rank creates every group, in the same order
                group = dist.new_group(ranks, backend=backend)
                if state.rank in ranks:
                    mine = group
            setattr(state, f"{name}_group", mine)
        if config.cp == 1:
            state.dp_cp_group = state.dp_group
        if config.ep == 1:
            state.edp_group = state.dp_cp_group
        return state

    # ---- coordinates ----
    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def cp_rank(self) -> int:
        return self.rank // self.config.tp % self.config.cp

    @property
    def dp_rank(self) -> int:
        return self.rank // (self.config.tp * self.config.cp) % self.config.dp

    @property
    def pp_rank(self) -> int:
        return self.rank // (self.config.tp * self.config.cp * self.config.dp)

    @property
    def ep_rank(self) -> int:
        """This rank's place in its EP group: its experts are ep_rank · E/ep ... (ep_rank + 1) · E/ep - 1."""
        return (self.dp_rank * self.config.cp + self.cp_rank) % self.config.ep

    @property
    def ep_size(self) -> int:
        return self.config.ep

    @property
    def edp_size(self) -> int:
        """Replicas of each expert shard (dp · cp / ep)."""
        return self.config.dp * self.config.cp // self.config.ep

    @property
    def cp_size(self) -> int:
        return self.config.cp

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def dp_size(self) -> int:
        return self.config.dp

    @property
    def pp_size(self) -> int:
        return self.config.pp

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.config.pp - 1

    def group_ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's ``name`` group (one of :data:`GROUP_NAMES`)."""
        if name not in GROUP_NAMES:
            raise ValueError(f"name ({name!r}) must be one of {', '.join(GROUP_NAMES)}")
        ranks = self._ranks or layout_ranks(self.config)
        return next(g for g in ranks[name] if self.rank in g)

    def subgroups_of_tp(self, members: list[list[int]]) -> object:
        """A group per list of TP ranks (every TP group builds the same partition; collective over the
        world): this rank's group, or None without torch.distributed. Used for replicated KV heads."""
        if not _initialised():
            return None
        mine = None
        for tp_ranks in self._ranks["tp"]:
            for part in members:
                ranks = [tp_ranks[i] for i in part]
                group = dist.new_group(ranks, backend=self.backend)
                if self.rank in ranks:
                    mine = group
        return mine

    @property
    def device_mesh(self):
        """A ``DeviceMesh`` over the same groups, dims ("pp", "dp", "cp", "tp") ("cp" only when cp > 1),
        for DTensor interop (built on first use; no new groups)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

            if not _initialised():
                raise RuntimeError("device_mesh needs an initialised torch.distributed")
            c = self.config
            dims = [("pp", c.pp, self.pp_group), ("dp", c.dp, self.dp_group)] + \
                ([("cp", c.cp, self.cp_group)] if c.cp > 1 else []) + [("tp", c.tp, self.tp_group)]
            mesh = torch.arange(c.world_size).reshape(*(n for _, n, _ in dims))
            device_type = "cuda" if dist.get_backend() == "nccl" else "cpu"
            self._mesh = DeviceMesh.from_group([g for _, _, g in dims], device_type, mesh=mesh,
                                               mesh_dim_names=tuple(name for name, _, _ in dims))
        return self._mesh

    def describe(self) -> str:
        cp = f", cp {self.cp_rank}/{self.cp_size}" if self.cp_size > 1 else ""
        cp += f", ep {self.ep_rank}/{self.ep_size}" if self.ep_size > 1 else ""
        return (f"rank {self.rank}: tp {self.tp_rank}/{self.tp_size}{cp}, dp {self.dp_rank}/{self.dp_size}, "
                f"pp {self.pp_rank}/{self.pp_size} ({self.config.short()})")


__all__ = ["GROUP_NAMES", "ParallelState", "layout_ranks"]
