"""`ddp`: DistributedDataParallel over the data-parallel mesh dimension."""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..cost.effects import Collective, Effects, dense_params, dtype_bytes, expert_params, rank_params
from ..parallel.buffers import install_buffer_sync, running_stat_buffers
from ..parallel.comm_hooks import register_comm_hook
from ..parallel.expert.reduce import (ExpertGradReducer, broadcast_states_by_group, ddp_ignore_names,
                                      expert_tensor_ids)
from ..parallel.unused_params import check_ddp_reduced, record_ddp_params
from ..strategy.registry import Method, Stage, register_method


@dataclass
class DDPConfig:
    """DDP options (see ``torch.nn.parallel.DistributedDataParallel``); sizes in MiB.

    sync_buffers: average the running statistics of BatchNorm-like layers over the data-parallel ranks after
        every optimizer step (``torchloom.parallel.buffers``), so evaluation is the same on every rank.
    broadcast_buffers: DDP's copy of rank 0's buffers before each forward. None (default) = off when
        ``sync_buffers`` averages running statistics (rank 0's copy would discard the other ranks'), else on.
    """

    bucket_cap_mb: float = 25.0
    static_graph: bool = False
    find_unused_parameters: bool = False
    gradient_as_bucket_view: bool = True
    broadcast_buffers: bool | None = None
    sync_buffers: bool = True
    comm_hook: Literal["fp16", "bf16", "powersgd"] | None = None
    powersgd_rank: int = 1
    powersgd_start_iter: int = 2


@register_method
class DDP(Method):
    """Data parallel with gradient all-reduce (Li et al., "PyTorch Distributed", VLDB 2020).

    Gradients are averaged over ``dp_replicate x dp_shard`` (the flattened ``dp`` mesh); tensor/pipeline
    peers are excluded. Optional gradient compression hooks: fp16, bf16 (gloo-safe), PowerSGD
    (Vogels et al., NeurIPS 2019).

    Expert parameters (``ctx.param_groups``, written by ``expert_parallel``) differ across ep ranks, so DDP
    ignores them: they are broadcast over ``edp`` at wrap time and their gradients summed over ``edp`` and
    divided by ``dp`` once per step by :class:`~torchloom.parallel.expert.reduce.ExpertGradReducer`.
    """

    name = "ddp"
    aliases = {"data_parallel": {}}
    Config = DDPConfig
    stage = Stage.DATA_PARALLEL
    data_parallel = True
    mesh_dims = ("dp_replicate", "dp_shard")
    conflicts = {"fsdp": "both own gradient synchronisation for data parallelism; fsdp already averages "
                         "gradients (and shards them). Use one."}

    search_configs = ({},)

    def configure(self, ctx) -> None:
        ctx.data_parallel = self.name

    def validate(self, info, dims) -> None:
        """DDP cannot hold tensor-parallel DTensor parameters: with ``tp > 1`` it raises the conflict that the
        strategy check gives for ``tensor_parallel`` with ``ddp``."""
        if dims.tp > 1:
            from ..errors import StrategyError
            from ..strategy.registry import get_method

            raise StrategyError(f"ddp with tp={dims.tp}: {get_method('tensor_parallel').conflicts['ddp']}")

    def estimate(self, info, dims, hw, step):
        """Gradients all-reduced over ``dp`` once per optimizer step (``no_sync`` while accumulating) in
        ``bucket_cap_mb`` buckets that overlap the backward, except the last; the bucket storage holds the
        gradients across steps (``gradient_as_bucket_view``: the gradients are views into it, else a copy).

        Under expert parallelism (``ep > 1``, a model with experts) DDP holds only the dense parameters
        (:func:`~torchloom.cost.effects.dense_params`): the buckets and their all-reduce over ``dp`` are
        the dense gradients', and the expert gradients (the rank's ``1/ep``,
        :func:`~torchloom.cost.effects.expert_params`) are summed over ``edp`` by one flat all-reduce per
        dtype at the step, after the backward (``ExpertGradReducer``): not overlapped, uncompressed (the comm
        hook is DDP's), none when ``edp == 1``. The reducer's flat copy exists only between the backward and
        the optimizer step and is not counted."""
        c = self.config
        pd = dtype_bytes(step.param_dtype)
        experts = getattr(info, "experts", None) is not None and dims.ep > 1
        held = dense_params if experts else rank_params  # what DDP's buckets hold
        grad_bytes = held(info, dims, trainable=True) * pd
        e = Effects(self.name, grads_persistent=True)
        if not c.gradient_as_bucket_view:
            e.memory_add["temporary"] = grad_bytes
        wire = grad_bytes
        if c.comm_hook in ("fp16", "bf16"):
            wire = grad_bytes / 2 if pd == 4 else grad_bytes
        elif c.comm_hook == "powersgd":
            e.notes.append("powersgd compression not modelled: priced as an uncompressed all-reduce")
        if dims.dp * dims.cp > 1 and wire > 0:  # under a sequence split the cp peers reduce together
            n = max(1, math.ceil(grad_bytes / (c.bucket_cap_mb * 2**20)))
            e.collectives.append(Collective("all_reduce", wire / n, "dp_cp" if dims.cp > 1 else "dp", calls=n,
                                            overlap="backward", exposed_calls=1, label="ddp.all_reduce"))
        if experts:
            expert_bytes = expert_params(info, dims) * pd
            if dims.edp > 1 and expert_bytes > 0:
                e.collectives.append(Collective("all_reduce", expert_bytes, "edp", calls=1, overlap="none",
                                                label="ddp.expert_all_reduce"))
        return e

    def apply(self, ctx) -> None:
        c = self.config
        # dp, or dp x cp under a sequence split: cp peers hold the same parameters and different tokens
        view = ctx.mesh.grad_view
        group = ctx.mesh.group(view)
        dev = ctx.device
        averaged = c.sync_buffers and any(running_stat_buffers(p) for p in ctx.model_parts)
        broadcast = (not averaged) if c.broadcast_buffers is None else c.broadcast_buffers
        notes = []
        experts = ctx.param_groups.params("expert")
        expert_ids = expert_tensor_ids(experts, [m for _, m in ctx.param_groups.members("expert")])
        edp_group = ctx.mesh.group("edp") if experts else None

        def wrap(module):
            ignored = ddp_ignore_names(module, expert_ids) if experts else []
            if ignored:
                # DDP neither broadcasts nor all-reduces these: over dp it would overwrite/mix experts that
                # differ across ep ranks. They start equal over edp; ExpertGradReducer reduces them.
                DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
                broadcast_states_by_group(module, None, edp_group, expert_ids)  # DDP broadcasts the dense ones
            with _broadcast_buffers_on_purpose():
                model = DistributedDataParallel(
                    module,
                    device_ids=[dev.index] if dev.type != "cpu" and dev.index is not None else None,
                    process_group=group,
                    bucket_cap_mb=c.bucket_cap_mb,
                    static_graph=c.static_graph,
                    find_unused_parameters=c.find_unused_parameters,
                    gradient_as_bucket_view=c.gradient_as_bucket_view,
                    **_buffer_sync_kwargs(broadcast),
                )
            record_ddp_params(model)  # DDP fixes its parameter list now; later requires_grad changes are caught
            notes.append(register_comm_hook(model, c.comm_hook, group, c.powersgd_rank, c.powersgd_start_iter))
            return model

        ctx.map_parts(wrap)
        note = notes[0] if notes else ""
        ctx.note(f"ddp: DistributedDataParallel over {view}={ctx.mesh.degree(view)}" + (f"; {note}" if note else ""))
        if c.sync_buffers:
            install_buffer_sync(ctx, "ddp")
        guard = ReductionGuard()
        ctx.pre_step_hooks.insert(0, guard.check)  # train_step: before any other collective of the step
        ctx.post_optimizer.append(guard.attach)  # a plain loop: optimizer.step() checks first
        if experts:
            reducer = ExpertGradReducer(experts, edp_group, ctx.mesh.dims.dp)
            ctx.pre_step_hooks.append(reducer)  # after the guard, before unscaling and clipping
            # a plain loop: optimizer.step() reduces first (registered after the guard's pre-hook)
            ctx.post_optimizer.append(lambda c: reducer.attach(c.model_parts, c.optimizer))
            ctx.note(f"ddp: {len(experts)} expert parameters left out of DDP, broadcast over "
                     f"edp={ctx.mesh.dims.edp} and reduced over edp / dp={ctx.mesh.dims.dp} before each step")


class ReductionGuard:
    """Stops an optimizer step whose DDP gradients were not all all-reduced (parameters without a gradient
    and ``find_unused_parameters=False``, or a static graph whose used set changed), with
    :class:`~torchloom.errors.GradientSyncError` naming them; see ``torchloom.parallel.unused_params``.

    Runs as ``train_step``'s first pre-step hook, as an optimizer step pre-hook (for loops that call
    ``loss.backward(); optimizer.step()`` themselves) and as a DDP forward pre-hook (a loop that runs
    backward on every micro-batch without ``no_sync`` meets the unreduced buckets at the next forward); a
    flag read per step and forward.
    """

    def __init__(self):
        self.models: list = []
        self.steps = 0  # optimizer steps taken (for the advice: a set that changes needs find_unused)

    def attach(self, ctx) -> None:
        self.models = [m for part in ctx.model_parts for m in part.modules() if isinstance(m, DistributedDataParallel)]
        for m in self.models:  # a loop that runs backward again before stepping: before DDP's own raw error
            m.register_forward_pre_hook(self._before_forward)
        ctx.optimizer.register_step_pre_hook(lambda *_: self.check())
        ctx.optimizer.register_step_post_hook(lambda *_: self._stepped())

    def check(self, *_params) -> None:
        check_ddp_reduced(self.models, self.steps, dist.get_rank())

    def _before_forward(self, module, _args) -> None:
        """A previous backward that left buckets unreduced makes DDP's next forward raise "Expected to have
        finished reduction in the prior iteration" with parameter indices; name the parameters instead."""
        if torch.is_grad_enabled():
            check_ddp_reduced([module], self.steps, dist.get_rank())

    def _stepped(self) -> None:
        self.steps += 1


def _buffer_sync_kwargs(sync: bool) -> dict:
    """DDP's buffer-sync argument: ``forward_sync_buffers=True`` where torch has it (``broadcast_buffers`` is
    deprecated there), but ``broadcast_buffers=False`` to turn syncing off: ``forward_sync_buffers=False`` would
    still broadcast the buffers at construction (:func:`_broadcast_buffers_on_purpose`)."""
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    if "forward_sync_buffers" in params and sync:
        return {"forward_sync_buffers": True}
    return {"broadcast_buffers": sync}


@contextlib.contextmanager
def _broadcast_buffers_on_purpose():
    """Silence exactly torch's ``FutureWarning: `broadcast_buffers` is deprecated`` around the DDP constructor.

    :func:`_buffer_sync_kwargs` passes ``broadcast_buffers=False`` on purpose: its replacement
    ``forward_sync_buffers=False`` still broadcasts rank 0's buffers when DDP is built (torch 2.13
    ``DistributedDataParallel.__init__``: ``init_sync_buffers`` is True whenever ``forward_sync_buffers`` is
    given), while ``broadcast_buffers=False`` leaves each rank's buffers as they are, which the running
    statistics ``sync_buffers`` averages (and any rank-local buffer) rely on. Other warnings still show."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`broadcast_buffers` is deprecated", category=FutureWarning)
        yield
