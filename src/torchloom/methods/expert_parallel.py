"""`expert_parallel`: experts placed across the ``ep`` ranks, tokens dispatched and combined with all-to-all."""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.expert_cost import estimate_expert_parallel
from ..errors import StrategyError
from ..strategy.registry import Method, Stage, register_method


@dataclass
class ExpertParallelConfig:
    """experts_cls: class names of the experts modules to shard (each must follow
    ``torchloom.moe.protocol``); None = every module that follows the protocol (Hugging Face's
    ``MixtralExperts``/``Qwen2MoeExperts``/``Qwen3MoeExperts``, ``torchloom.moe.GroupedExperts``)."""

    experts_cls: list[str] | None = None


@register_method
class ExpertParallel(Method):
    """Expert parallelism (GShard, Lepikhin et al. 2020; Switch Transformer, Fedus et al. 2021) on the expert
    view of the mesh: ``ep`` is carved out of the data-parallel ranks (``dp = edp x ep``), so dense layers
    still see all ``dp`` ranks reading different data.

    Every experts module's fused parameters ``[E, ...]`` become DTensors ``Shard(0)`` on ``mesh["ep"]`` (rank
    ``r`` keeps experts ``[r E/ep, (r+1) E/ep)``); its forward dispatches each (token, choice) to the rank
    holding the expert with a variable-split all-to-all and combines the outputs at the source
    (``torchloom.parallel.expert``). The modules are recorded as the ``expert`` parameter group
    (``ctx.param_groups``): ``ddp`` leaves them out and reduces their gradients over ``edp`` (divided by
    ``dp``), ``fsdp`` shards them over ``edp``. Runs after tensor parallelism and before activation
    checkpointing and data parallelism. docs/expert_parallel.md.
    """

    name = "expert_parallel"
    aliases = {"ep": {}}
    Config = ExpertParallelConfig
    stage = Stage.TENSOR + 2
    mesh_dims = ("ep",)
    conflicts = {"zero1": "ZeroRedundancyOptimizer partitions and broadcasts every parameter over all of dp, but "
                          "expert parameters differ across the ep ranks (each holds other experts). Use fsdp "
                          "(zero2/zero3: experts are sharded over edp) or ddp without zero1."}

    search_configs = ({},)

    def validate(self, info, dims) -> None:
        """``apply``'s checks on the (meta) model and degrees: with ``ep > 1`` the model has experts modules
        (of ``experts_cls`` when given), each ``num_experts`` divisible by ``ep``, and the strategy has no
        ``sequence_parallel`` and no tensor-parallel plan that splits an experts module.

        Raises:
            StrategyError: naming the failing module, ``E``, ``ep`` and the valid degrees.
        """
        strategy = getattr(self, "planning_strategy", None)
        if dims.ep > 1 and strategy is not None:
            _check_strategy(strategy, dims.ep)
        if dims.ep > 1 and info.module is not None:
            found = self.experts_modules(info.module, dims.ep)
            if dims.tp > 1 and strategy is not None and "tensor_parallel" in strategy:
                _check_tp_plan(info.module, strategy.config("tensor_parallel"), found)

    def configure(self, ctx) -> None:
        if ctx.dims.ep > 1:
            _check_strategy(ctx.strategy, ctx.dims.ep)

    def estimate(self, info, dims, hw, step):
        """The all-to-all dispatch/combine per MoE layer, expert parameter memory 1/ep
        (``torchloom.cost.expert_cost.estimate_expert_parallel``)."""
        return estimate_expert_parallel(self.config, info, dims, hw, step)

    def experts_modules(self, model, ep: int, required: bool = True) -> list[tuple[str, object]]:
        """``(qualname, module)`` of the experts modules to shard in ``model`` (a model or one pipeline stage).

        Raises:
            StrategyError: none found with ``ep > 1`` and ``required``; a ``num_experts`` not divisible by
                ``ep``; a class in ``experts_cls`` not following the protocol, or (``required``) absent.
        """
        from ..moe.protocol import find_experts_modules, is_experts_module

        if required or self.config.experts_cls is None:
            found = find_experts_modules(model, self.config.experts_cls)
        else:  # a pipeline stage may hold none of the named classes
            names = set(self.config.experts_cls)
            found = [(q, m) for q, m in model.named_modules() if type(m).__name__ in names]
            if any(not is_experts_module(m) for _, m in found):
                found = find_experts_modules(model, self.config.experts_cls)  # raises the protocol error
        if not found and ep > 1 and required:
            raise StrategyError(
                f"expert_parallel with ep={ep}: the model ({type(model).__name__}) has no experts module (an int "
                "`num_experts` and fused parameters whose dim 0 is num_experts, forward(hidden, top_k_index, "
                "top_k_weights); see torchloom.moe.protocol). Use an MoE model, name its experts class in "
                "experts_cls, or set ep=1.")
        for q, m in found:
            e = int(m.num_experts)
            if e % ep:
                raise StrategyError(
                    f"expert_parallel: {q} ({type(m).__name__}) has num_experts={e}, not divisible by ep={ep}: every "
                    f"ep rank must hold the same number of experts. Choose ep among "
                    f"{[d for d in range(1, e + 1) if e % d == 0]} (it must also divide dp).")
        return found

    def apply(self, ctx) -> None:
        from ..parallel.expert.shard import shard_experts
        from ..parallel.param_groups import EXPERT

        ep = ctx.mesh.dims.ep
        if ep == 1:
            ctx.note("expert_parallel: ep=1, experts stay whole on every rank (nothing changed)")
            return
        parts = ctx.model_parts
        per_part = [self.experts_modules(p, ep, required=False) for p in parts]  # check all before changing any
        if not _any_rank_has_experts(ctx, sum(map(len, per_part))):  # a pipeline stage may hold none
            self.experts_modules(parts[0], ep)  # raises the "no experts module" error on every rank
        ctx.mesh["sparse"]  # collective: every rank builds the expert views here, at the same point
        n, classes = 0, set()
        for found in per_part:
            for q, m in found:
                shard_experts(m, ctx.mesh)
                ctx.param_groups.add(EXPERT, q, m)
                n += 1
                classes.add(type(m).__name__)
        e = {int(m.num_experts) for found in per_part for _, m in found}
        ctx.note(f"expert_parallel: {n} experts modules of {sorted(classes)} sharded over ep={ep} "
                 f"({'/'.join(map(str, sorted(e)))} experts, {'/'.join(str(x // ep) for x in sorted(e))} per rank), "
                 f"all-to-all dispatch; expert gradients reduced over edp={ctx.mesh.dims.edp}")


def _any_rank_has_experts(ctx, local: int) -> bool:
    """Whether any rank's model parts hold an experts module. Under pipelining a stage may have none (dense
    first layers) while others do; the count is summed over the world (a collective, as ``apply`` is)."""
    if ctx.parts is None:
        return local > 0
    import torch
    import torch.distributed as dist

    n = torch.tensor([float(local)], device=ctx.device)
    dist.all_reduce(n)
    return n.item() > 0


def _check_tp_plan(model, tp_config, found) -> None:
    """The tensor-parallel plan must leave the experts modules whole (they are split over ep, replicated
    over tp); the built-in Mixtral plan splits every expert over tp ('moe_experts')."""
    from ..parallel.tensor.apply import resolve_plan
    from ..parallel.tensor.plans import auto_plan, custom_plan
    from ..parallel.tensor.styles import SHARDING_STYLES

    plan = auto_plan(model) if tp_config.plan == "auto" else custom_plan(model, tp_config.plan)
    targets = resolve_plan(model, plan).targets
    split = [q for q, _ in found if targets.get(q) in SHARDING_STYLES]
    if split:
        raise StrategyError(
            f"expert_parallel with tensor_parallel: the tensor-parallel plan splits the experts modules {split[:2]} "
            f"over tp ('{targets[split[0]]}'); splitting experts over tp and ep at once is not supported yet. Pass a "
            "tensor_parallel plan without the experts entry (experts then split over ep and replicated over tp), "
            "or use ep=1.")


def _check_strategy(strategy, ep: int) -> None:
    """Combinations refused with ``ep > 1``."""
    if "sequence_parallel" in strategy:
        raise StrategyError(
            f"expert_parallel with ep={ep} and sequence_parallel is not supported yet: sequence parallelism shards the "
            "tokens over tp, so each tp rank would route other tokens and the expert gradients would also need a "
            "reduction over tp. Drop sequence_parallel (tensor_parallel alone composes) or use ep=1.")
