"""`zero1`: shard optimizer state across data-parallel ranks (ZeRO stage 1)."""
from __future__ import annotations

import inspect
from dataclasses import dataclass

from ..cost.effects import Collective, Effects, dtype_bytes, rank_params
from ..errors import StrategyError
from ..strategy.registry import Method, Stage, register_method

#: why zero1 refuses expert parameters, and the fix (validate and wrap_optimizer say the same)
_EXPERTS = ("ZeroRedundancyOptimizer partitions the parameters over all of dp and, after each step, broadcasts "
            "every parameter from its owner rank to the whole dp group, which would overwrite the expert "
            "parameters that differ across ep ranks (experts are sharded over ep and must be reduced over edp "
            "only). Use fsdp (or zero2, the fsdp mode) for sharded optimizer state with experts: it shards "
            "experts over edp; or use ddp without zero1.")


@dataclass
class Zero1Config:
    """No options yet: the shard group is the data-parallel mesh dimension."""


@register_method
class Zero1(Method):
    """ZeRO-1 (Rajbhandari et al., "ZeRO", SC 2020) with PyTorch's ``ZeroRedundancyOptimizer``: each
    data-parallel rank keeps the optimizer state of 1/dp of the parameters, steps them, and broadcasts
    the updated parameters. Gradients are still all-reduced by ``ddp`` (implied)."""

    name = "zero1"
    Config = Zero1Config
    stage = Stage.OPTIMIZER
    implies = ("ddp",)
    requires = ("ddp",)
    conflicts = {"fsdp": "fsdp already shards optimizer state (and gradients/parameters); zero1 would shard "
                         "it twice. Use fsdp alone (zero2/zero3 are fsdp modes).",
                 "pipeline_parallel": "zero1 trains under pipelining, but its checkpoints cannot be loaded: the "
                                      "ZeroRedundancyOptimizer state is saved consolidated on global rank 0 "
                                      "(per parameter-group index), and rank 0 holds only its own stage's "
                                      "parameters, so the other stages' optimizer state is lost. Use ('fsdp', "
                                      "{'reshard_after_forward': False}) (alias 'zero2'): it shards the optimizer "
                                      "state under pipelining and saves it by parameter name."}

    search_configs = ({},)

    def validate(self, info, dims) -> None:
        """Refuse expert parallelism (``ep > 1``): see :meth:`wrap_optimizer`."""
        if dims.ep > 1:
            raise StrategyError(f"zero1 with ep={dims.ep}: {_EXPERTS}")

    def estimate(self, info, dims, hw, step):
        """Optimizer state 1/dp per rank; after the step each rank broadcasts its updated shard
        (``dp`` broadcasts of 1/dp of the parameters, on the critical path)."""
        dp = dims.dp
        e = Effects(self.name, memory_scale={"optimizer": 1.0 / dp})
        if dp > 1:
            shard = rank_params(info, dims) * dtype_bytes(step.param_dtype) / dp
            e.collectives.append(Collective("broadcast", shard, "dp", calls=dp, label="zero1.broadcast"))
        return e

    def apply(self, ctx) -> None:
        """Refuse expert parameters before the optimizer is built (``expert_parallel`` recorded them)."""
        _refuse_experts(ctx)

    def wrap_optimizer(self, ctx) -> None:
        """Replace ``ctx.optimizer`` by a ``ZeroRedundancyOptimizer`` over ``dp``.

        Raises:
            StrategyError: the model has expert parameters (``ctx.param_groups``) or ``ep > 1``.
            NotImplementedError: a two-pass optimizer, or several parameter groups.
        """
        _refuse_experts(ctx)
        opt = ctx.optimizer
        if hasattr(opt, "first_step") and hasattr(opt, "second_step"):
            raise NotImplementedError(
                f"zero1 cannot shard {type(opt).__name__}: a two-pass (SAM-style) optimizer wraps a base optimizer, "
                "and ZeroRedundancyOptimizer rebuilds the optimizer from its class alone. Use fsdp (zero2/zero3), "
                "which shards the base optimizer's state, or ddp without zero1."
            )
        if len(opt.param_groups) > 1:
            raise NotImplementedError(
                "zero1 supports a single parameter group (ZeroRedundancyOptimizer rebuilds the optimizer from one "
                "list); pass one group, or use fsdp (zero2/zero3) for per-group options."
            )
        params = [p for g in opt.param_groups for p in g["params"]]
        opt_cls = type(opt)
        # the group's own values (they override the defaults); keep only constructor arguments
        # (defaults may hold derived keys the constructor does not take, e.g. AdamW's decoupled_weight_decay)
        accepted = inspect.signature(opt_cls.__init__).parameters
        group = {**opt.defaults, **{k: v for k, v in opt.param_groups[0].items() if k != "params"}}
        defaults = {k: v for k, v in group.items() if k in accepted}
        # imported here: torch.distributed.optim scripts its functional optimizers on import (~0.3 s), which
        # `loom plan` and every method lookup would otherwise pay
        from torch.distributed.optim import ZeroRedundancyOptimizer

        zero = ZeroRedundancyOptimizer(
            params, optimizer_class=opt_cls, process_group=ctx.mesh.group(ctx.mesh.grad_view), **defaults
        )
        ctx.optimizer = zero
        view = ctx.mesh.grad_view
        ctx.note(f"zero1: optimizer state sharded over {view}={ctx.mesh.degree(view)} ({opt_cls.__name__})")


def _refuse_experts(ctx) -> None:
    if ctx.param_groups.has_experts or ctx.mesh.dims.ep > 1:
        n = len(ctx.param_groups.params("expert"))
        raise StrategyError(f"zero1 with expert parameters ({n} in {len(ctx.param_groups.members('expert'))} "
                            f"experts modules, ep={ctx.mesh.dims.ep}): {_EXPERTS}")
