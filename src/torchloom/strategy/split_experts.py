"""How ``split`` scopes around experts become expert parallelism (docs/annotations.md, rule 6).

EPL configures M6 with ``with epl.split(N):`` around the MoE layer's expert variables: the experts are spread
over N devices, everything else is replicated (data parallel). Here an *experts module*
(:mod:`torchloom.moe.protocol`: HF ``MixtralExperts``/``Qwen2MoeExperts``/``Qwen3MoeExperts``, torchloom's
``GroupedExperts``) inside a ``split`` scope means the same: expert parallel with ``ep`` = the scope's
``device_count``, ``ep`` carved out of the data-parallel ranks (``parallel/mesh.py``).

The *MoE block* of an experts module is its parent (the module that routes tokens to it: router, shared
experts, shared-expert gate) when the parent is in the same split scope, else the experts module alone. The
block stays out of the tensor-parallel rule: its dense modules are replicated over the expert-parallel ranks
(data parallel, as EPL's M6), so a router that is an ``nn.Linear`` is never split column-wise. Other
modules of the scope (attention, when a whole decoder layer is split) get tensor-parallel styles as before.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ..errors import StrategyError


@dataclass
class ExpertSplit:
    """The experts in ``split`` scopes of one model.

    Attributes:
        ep: expert-parallel degree (1: no experts module in a split scope).
        experts: ``{FQN: split scope}`` of the experts modules in split scopes (module order).
        replicated: FQNs kept out of the tensor-parallel rule: every module of each experts module's MoE block.
        classes: class names of ``experts`` (module order, each once): ``expert_parallel``'s ``experts_cls``.
    """

    ep: int = 1
    experts: dict[str, Any] = field(default_factory=dict)
    replicated: set[str] = field(default_factory=set)
    classes: list[str] = field(default_factory=list)

    @property
    def scopes(self) -> list[Any]:
        """The split scopes holding experts, each once."""
        return list(dict.fromkeys(self.experts.values()))


def expert_split(model: nn.Module, split_of: dict[str, Any]) -> ExpertSplit:
    """Find the experts modules in ``split`` scopes and check their degree.

    Args:
        model: the annotated model.
        split_of: every module FQN (module order) -> its split scope (``label``, ``device_count``), or None.

    Raises:
        StrategyError: split scopes around experts with different device counts; a device count that does not
            divide an experts module's ``num_experts``; experts modules of an annotated class left outside every
            split scope (``expert_parallel`` selects experts by class, so it would shard them too).
    """
    from ..moe.protocol import is_experts_module

    mods = dict(model.named_modules())
    out = ExpertSplit()
    for fqn, m in mods.items():
        if split_of.get(fqn) is not None and is_experts_module(m):
            out.experts[fqn] = split_of[fqn]
    if not out.experts:
        return out
    counts = sorted({s.device_count for s in out.scopes})
    if len(counts) > 1:
        raise StrategyError(
            "split scopes around experts have different device counts ("
            + ", ".join(f"'{s.label}': {s.device_count}" for s in out.scopes)
            + "); the expert-parallel degree is one number, so give every split scope around experts the same "
            "device_count."
        )
    out.ep = counts[0]
    for fqn, scope in out.experts.items():
        e = mods[fqn].num_experts
        if e % out.ep:
            ok = [d for d in range(2, e + 1) if e % d == 0]
            raise StrategyError(
                f"split scope '{scope.label}' spreads {fqn} ({type(mods[fqn]).__name__}, {e} experts) over "
                f"device_count={out.ep} expert-parallel ranks, but {e} experts do not divide evenly over {out.ep}; "
                f"use a device_count among {ok or 'none (a single expert cannot be split)'}."
            )
        parent = fqn.rpartition(".")[0]
        block = parent if parent in split_of and split_of[parent] == scope else fqn
        out.replicated.update(n for n in mods if _inside(n, block))
    out.classes = list(dict.fromkeys(type(mods[f]).__name__ for f in out.experts))
    left = [n for n, m in mods.items() if n not in out.experts and type(m).__name__ in out.classes
            and is_experts_module(m)]
    if left:
        shown = ", ".join(left[:4]) + (" ..." if len(left) > 4 else "")
        raise StrategyError(
            f"split scopes hold {type(mods[next(iter(out.experts))]).__name__} experts, but {shown} of the same "
            f"class {'is' if len(left) == 1 else 'are'} outside every split scope; expert_parallel selects experts "
            "modules by class, so it would spread those too. Put every experts module of that class in a split "
            "scope (e.g. torchloom.split(*[l.mlp.experts for l in model.model.layers], device_count=N)), or pass "
            "('expert_parallel', {...}) explicitly with a plain model."
        )
    return out


def _inside(name: str, root: str) -> bool:
    return root == "" or name == root or name.startswith(root + ".")
