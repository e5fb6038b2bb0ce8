"""`fsdp`: fully sharded data parallel with FSDP2 ``fully_shard`` (ZeRO-3; ZeRO-2 via ``zero2``)."""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import Shard

from ..cost.effects import (Collective, Effects, GROUPED, block_params, blocks_per_rank, dense_params,
                            dtype_bytes, expert_params, moe_layers_per_rank, rank_params)
from ..cost.memo import memo_model_check
from ..errors import StrategyError
from ..parallel.blocks import find_blocks, shared_parameter_owners
from ..parallel.buffers import broadcast_module_states, install_buffer_sync
from ..parallel.expert.reduce import broadcast_states_by_group, expert_tensor_ids
from ..parallel.materialize import materialize_meta_model
from ..parallel.precision import fp32_norm_modules, keeps_fp32
from ..strategy.registry import Method, Stage, register_method
from ..utils import has_accelerator


@dataclass
class FSDPConfig:
    """FSDP2 options.

    reshard_after_forward: True = ZeRO-3 (parameters freed after forward, gathered again for backward);
        False = ZeRO-2 (kept unsharded between forward and backward; alias ``zero2``).
    wrap_cls: class names sharded as their own unit (default: the model's repeated blocks).
    cpu_offload: keep sharded parameters, gradients and optimizer state in host memory.
    reduce_dtype: gradient reduction dtype under amp (default float32).
    sync_buffers: average the running statistics of BatchNorm-like layers over the data-parallel ranks after
        every optimizer step (FSDP never synchronises buffers; see ``torchloom.parallel.buffers``).
    sync_module_states: broadcast parameters and buffers from data-parallel rank 0 before sharding, so
        ranks that built differently initialised models train one model (as DDP does at wrap time).
    accumulate_sharded: under gradient accumulation, reduce-scatter the gradients after every micro-batch and
        accumulate the shards (torchtitan's, Composer's and NeMo AutoModel's FSDP behaviour): gradient memory
        stays 1/dp_shard of the model, at ``grad_accum`` x the reduce-scatters. False (default): the
        micro-batches before the last accumulate unsharded gradients (``set_requires_gradient_sync(False)``),
        one reduce-scatter per step, a whole unsharded gradient per rank. No effect without accumulation;
        refused with pipeline parallelism (its schedule reduces once per step).
    """

    reshard_after_forward: bool = True
    wrap_cls: list[str] | None = None
    cpu_offload: bool = False
    reduce_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    sync_buffers: bool = True
    sync_module_states: bool = True
    accumulate_sharded: bool = False


@register_method
class FSDP(Method):
    """Fully sharded data parallel (Zhao et al., "PyTorch FSDP", VLDB 2023; ZeRO, SC 2020) on FSDP2.

    Each repeated block becomes one FSDP unit, then the root. Modules that share a parameter (tied
    embedding/head) are grouped into one unit so the tie survives sharding. With ``dp_replicate > 1`` the
    mesh is 2-D and this is hybrid sharding (HSDP): shard within ``dp_shard``, replicate across
    ``dp_replicate``. Meta-device models are sharded first and materialised shard by shard.

    Expert parameters (``ctx.param_groups``: DTensors ``Shard(0)`` on ``mesh["ep"]``, placed by
    ``expert_parallel``) make each experts module its own unit on ``mesh["edp"]`` before the blocks, with
    gradient divide factor ``dp`` (summed over edp, divided by dp: see ``torchloom.parallel.param_groups``),
    sharded on dim 1 when ``edp x ep > num_experts`` (torchtitan's ``_experts_shard_placement_fn``: dim 0 would
    leave ranks with padding only).
    """

    name = "fsdp"
    aliases = {"zero3": {}, "fsdp2": {}, "zero2": {"reshard_after_forward": False}}
    key_aliases = {"atorch_wrap_cls": "wrap_cls"}
    Config = FSDPConfig
    stage = Stage.DATA_PARALLEL
    data_parallel = True
    mesh_dims = ("dp_replicate", "dp_shard")

    search_configs = ({"reshard_after_forward": True}, {"reshard_after_forward": False},
                      {"reshard_after_forward": True, "cpu_offload": True})

    def configure(self, ctx) -> None:
        ctx.data_parallel = self.name
        if self.config.accumulate_sharded:
            _check_accumulate_sharded(ctx.strategy)
            ctx.sync_every_microbatch = True

    def validate(self, info, dims) -> None:
        """``apply``'s model checks: the wrap classes exist in the (meta) model; with the whole strategy known,
        ``accumulate_sharded`` is not combined with pipeline parallelism."""
        strategy = getattr(self, "planning_strategy", None)
        if strategy is not None and self.config.accumulate_sharded:
            _check_accumulate_sharded(strategy)
        if info.module is not None:  # memoised: a search checks thousands of candidates on one model
            wrap = tuple(self.config.wrap_cls) if self.config.wrap_cls is not None else None
            memo_model_check(info.module, ("fsdp.wrap_cls", wrap), lambda: find_blocks(info.module, wrap and list(wrap)))

    def estimate(self, info, dims, hw, step):
        """FSDP2 per rank (each block one unit, the rest the root unit):

        * parameters, gradients and optimizer state 1/``dp_shard`` (HSDP replicates across ``dp_replicate``);
        * transient at the peak (backward starts): the last block gathered again in the compute dtype
          (ZeRO-2: every block of the rank stays gathered from forward to backward) and the root's gathered
          parameters (FSDP2 never reshards the root after forward);
        * per micro-batch, an all-gather per unit in forward (ZeRO-3: again per block in backward),
          prefetched behind the previous unit's compute except the first of each pass (under pipeline
          parallelism the units stay gathered between micro-batches: ZeRO-2 gathers once per step, ZeRO-3
          in the warm-up forwards and every backward); per optimizer step
          a reduce-scatter per unit overlapping the backward except the last (HSDP: then an all-reduce of the
          shard over ``dp_replicate``); under gradient accumulation the gradients accumulate unsharded;
        * ``cpu_offload`` on an accelerator: sharded state in host memory (off the device), the shards
          copied in before each all-gather and the gradients out after each reduce-scatter over the host
          link, the optimizer step on the host. On a CPU device offload moves nothing.

        Under expert parallelism (``ep > 1`` and a model with experts) the dense units are priced as above
        without the experts, and every experts module is its own unit on the 1-D ``edp`` view (``apply``,
        :func:`_shard_experts`), see :func:`_expert_units`.
        """
        c = self.config
        # under context parallelism FSDP shards over dp_shard x cp (torchtitan's dp_shard_cp): the cp ranks hold
        # the same parameters and their gradients are reduced together
        n, r = dims.dp_shard * dims.cp, dims.dp_replicate
        shard_view = "dp_shard_cp" if dims.cp > 1 else "dp_shard"
        cd, pd = dtype_bytes(step.compute_dtype), dtype_bytes(step.param_dtype)
        rd = dtype_bytes(c.reduce_dtype) if step.compute_dtype != step.param_dtype else pd
        tp, nb = max(dims.tp, 1), blocks_per_rank(info, dims)
        block = block_params(info) / tp  # elements of one gathered unit
        total = rank_params(info, dims)
        rest = max(total - block * nb, 0.0)
        zero3 = c.reshard_after_forward
        ex = _expert_units(info, dims)
        if ex is not None:  # the blocks' units without their experts (those are units of their own)
            block, total = ex.dense_block, ex.dense
            rest = max(total - block * nb, 0.0)
        # at the peak (backward starts: all activations alive) ZeRO-3 holds the last block, gathered again
        # for its backward, and the root; ZeRO-2 every block of the rank. The forward's current + prefetched
        # pair and the backward's unsharded block gradient come when fewer activations are alive.
        # the blocks' Linear weights gathered in FP8 under float8's FSDP all-gather (their norms' few elements
        # stay bf16: priced FP8 too); the root unit (embedding, head) stays in the compute dtype
        bcd = 1 if step.fp8_gathered_weights else cd
        gathered = (min(nb, 1) if zero3 else nb) * block * bcd
        accum = step.grad_accum
        # accumulating unsharded: the micro-batches before the last keep a whole gradient per rank; sharded:
        # every micro-batch reduce-scatters (accum x the calls), the shards accumulate
        sharded_accum = c.accumulate_sharded and accum > 1
        rs_calls = accum if sharded_accum else 1
        # FSDP2's own work: each block unit and the root (its share spread over the rank's blocks)
        reducing = rs_calls / accum
        block_tensors, rest_tensors = _unit_tensors(info)
        unit_ops = _unit_ops(hw, n * r, reducing, block_tensors)
        if _calibrated(hw, n * r):  # (the uncalibrated dozen dispatches count the blocks' units only)
            unit_ops += _unit_ops(hw, n * r, reducing, rest_tensors) / max(nb, 1)
        e = Effects(self.name, memory_scale={k: 1.0 / n for k in ("params", "grads", "optimizer")},
                    ops_add=unit_ops, dtensor_params=True)
        e.memory_add["temporary"] = gathered + rest * cd
        e.grads_unsharded_accum = 0.0 if sharded_accum else total * rd
        # forward passes that find the units sharded: every micro-batch's, except under pipeline parallelism:
        # torch.distributed.pipelining turns off resharding after backward until the step's last one
        # (stage.backward_maybe_with_nosync), so ZeRO-2 gathers once per step and ZeRO-3 only in the
        # schedule's warm-up forwards (a forward after a backward finds the units gathered)
        fwd_gathers = accum
        if dims.pp > 1 and "pipeline_parallel" in step.methods:
            fwd_gathers = min(accum, dims.pp) if zero3 else 1
        if n > 1:
            e.collectives.append(Collective("all_gather", (block * nb * bcd + rest * cd) / (nb + 1), shard_view,
                                            calls=fwd_gathers * (nb + 1), overlap="forward",
                                            exposed_calls=fwd_gathers, label="fsdp.all_gather"))
            if zero3 and nb:
                e.collectives.append(Collective("all_gather", block * bcd, shard_view, calls=accum * nb,
                                                overlap="backward", label="fsdp.all_gather_bwd"))
            e.collectives.append(Collective("reduce_scatter", (block * nb + rest) * rd / (nb + 1), shard_view,
                                            calls=rs_calls * (nb + 1), overlap="backward", exposed_calls=rs_calls,
                                            label="fsdp.reduce_scatter"))
        if r > 1:
            e.collectives.append(Collective("all_reduce", (block * nb + rest) * rd / (nb + 1) / n, "dp_replicate",
                                            calls=rs_calls * (nb + 1), overlap="backward", exposed_calls=rs_calls,
                                            label="fsdp.all_reduce_replicate"))
        if ex is not None:
            _price_expert_units(e, ex, dims, nb, cd, rd, accum, zero3, rs_calls, hw)
        if c.cpu_offload:
            if hw.device_type == "cpu":
                e.notes.append("cpu_offload on a CPU device: state already in host memory, nothing moves")
            else:
                for k in ("params", "grads", "optimizer"):
                    e.memory_scale[k] = 0.0
                link = hw.sources.get("host_link_bw")
                bw = float(link) if link else HOST_LINK_BW
                copies = (accum * (nb + 1) * (2 if zero3 else 1) * (total / (nb + 1)) * cd / n + total * rd / n)
                if ex is not None:  # the expert units' shards (1/edp) in and their gradients out
                    for k in e.group_memory_scale["expert"]:
                        e.group_memory_scale["expert"][k] = 0.0
                    copies += (accum * (2 if zero3 else 1) * cd + rd) * ex.elements / dims.edp
                e.time_add["host_copies"] = copies / bw
                e.notes.append(f"cpu_offload: host link {bw / 1e9:.0f} GB/s; optimizer step runs on the host")
        if not n > 1 and r <= 1:
            e.notes.append("fsdp over one rank: gathers are local copies")
        return e

    def apply(self, ctx) -> None:
        c = self.config
        # under a sequence split (cp > 1) FSDP shards over dp_shard x cp: cp peers hold the same parameters
        shard = ctx.mesh.shard_view
        mesh = ctx.mesh["dp_replicate", shard] if ctx.mesh.dims.dp_replicate > 1 else ctx.mesh[shard]
        mp = MixedPrecisionPolicy()
        if ctx.autocast_dtype is not None:
            mp = MixedPrecisionPolicy(param_dtype=ctx.autocast_dtype, reduce_dtype=getattr(torch, c.reduce_dtype))
        # pinned host memory needs an accelerator (pinning fails on CPU-only builds)
        offload = CPUOffloadPolicy(pin_memory=has_accelerator()) if c.cpu_offload else OffloadPolicy()
        kw = dict(mesh=mesh, mp_policy=mp, offload_policy=offload)
        # BatchNorm-like layers keep fp32 parameters next to their fp32 running statistics (under amp and half;
        # torchloom.parallel.precision): they become units of their own with a policy that casts nothing
        low_precision = ctx.autocast_dtype is not None or ctx.param_dtype is not None
        fp32_mp = MixedPrecisionPolicy(reduce_dtype=getattr(torch, c.reduce_dtype) if ctx.autocast_dtype else None)

        units_total, shared_all, block_classes, norms_kept = 0, [], set(), 0
        expert_mods = ctx.param_groups.members("expert")
        expert_ids = expert_tensor_ids(ctx.param_groups.params("expert"), [m for _, m in expert_mods])
        expert_units = 0
        for model in ctx.model_parts:
            mine = [m for m in model.modules() if any(m is e for _, e in expert_mods)]
            if c.sync_module_states and not ctx.on_meta and ctx.mesh.degree(ctx.mesh.grad_view) > 1:
                if not c.cpu_offload:
                    model.to(ctx.device)  # NCCL broadcasts device tensors only (fully_shard would move them anyway)
                if expert_mods:  # experts differ across ep ranks: broadcast them over edp only
                    broadcast_states_by_group(model, ctx.mesh.group("dp"), ctx.mesh.group("edp"), expert_ids)
                else:
                    broadcast_module_states(model, ctx.mesh.group(ctx.mesh.grad_view))
            # (found before fully_shard renames the experts' class; an experts class named in wrap_cls is
            # its own unit already, on edp)
            blocks = [(q, m) for q, m in find_blocks(model, c.wrap_cls) if not any(m is e for e in mine)]
            # experts first: the enclosing block's unit must not take their ep-mesh DTensors on the dense mesh
            for mod in mine:
                _shard_experts(mod, ctx, c, kw)
            expert_units += len(mine)
            block_classes |= {type(m).__name__ for _, m in blocks}
            shared = shared_parameter_owners(model)
            shared_all += shared
            units = _plan_units([q for q, _ in blocks], shared)
            units_total += len(units)
            modules = dict(model.named_modules())
            if low_precision:
                norms_kept += _shard_fp32_norms(model, units, shared, c, {**kw, "mp_policy": fp32_mp})
            for unit in units:
                mods = [modules[q] for q in unit]
                fp32_unit = low_precision and len(mods) == 1 and keeps_fp32(mods[0])
                unit_kw = {**kw, "mp_policy": fp32_mp} if fp32_unit else kw
                fully_shard(mods if len(mods) > 1 else mods[0], reshard_after_forward=c.reshard_after_forward,
                            **unit_kw)
            # the root keeps everything else (embeddings, final norm, head; tied weights stay in one unit). Only
            # the root casts its outputs to fp32 (as the autocast path returns them); inner units stay low precision.
            root_kw = dict(kw)
            if ctx.autocast_dtype is not None:
                root_kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=ctx.autocast_dtype, output_dtype=torch.float32,
                                                            reduce_dtype=getattr(torch, c.reduce_dtype))
            fully_shard(model, reshard_after_forward=c.reshard_after_forward, **root_kw)
            model.register_forward_hook(_check_output_reaches_backward)
            if ctx.on_meta:
                materialize_meta_model(model, ctx.device if not c.cpu_offload else torch.device("cpu"))
        ctx.on_meta = False
        if expert_units and ctx.mesh.dims.edp == 1:
            _expert_divider(ctx, [m for _, m in expert_mods])
        ctx.block_classes = sorted(block_classes)
        units, shared = range(units_total), shared_all
        if c.sync_buffers:
            install_buffer_sync(ctx, "fsdp")
        mode = "ZeRO-3" if c.reshard_after_forward else "ZeRO-2"
        hsdp = f"HSDP {ctx.mesh.dims.dp_replicate}x{ctx.mesh.dims.dp_shard}" if ctx.mesh.dims.dp_replicate > 1 \
            else f"dp_shard={ctx.mesh.dims.dp_shard}"
        ctx.note(f"fsdp: {mode}, {hsdp}, {_units_note(len(units), ctx.block_classes)}"
                 + (", CPU offload" if c.cpu_offload else "")
                 + (", gradients reduce-scattered every micro-batch (accumulate_sharded)" if c.accumulate_sharded
                    else "")
                 + (f", tied groups {shared}" if shared else "")
                 + (f", {norms_kept} BatchNorm-like units in fp32" if norms_kept else "")
                 + (f", {expert_units} experts units on edp={ctx.mesh.dims.edp} (gradients / dp={ctx.mesh.dims.dp})"
                    if expert_units else ""))


def _units_note(n_units: int, block_classes: list[str]) -> str:
    """What the FSDP note says was wrapped: ``"4 block units of ['Block']"``, or, with no block unit, that the
    whole model is one unit and why (no repeated blocks found, or the blocks share weights with the root),
    with the ``wrap_cls`` option that shards it per module."""
    if n_units:
        return f"{n_units} block units of {block_classes}"
    why = ("no repeated blocks found (no nn.ModuleList of >= 2 modules of one class, no Hugging Face "
           "_no_split_modules)" if not block_classes else
           f"the {block_classes} blocks share parameters with modules outside them and stay in the root unit")
    return (f"{why}: the whole model is one FSDP unit, gathered whole for every forward and backward; to shard "
            "it per module, name the classes: {'fsdp': {'wrap_cls': ['MyBlock']}}")


#: extra dispatched ops per FSDP unit per forward (pre/post hooks, copy-in/out, views) when the calibration has
#: no measured ``fsdp_unit_s`` (the GPU tables)
_FSDP_OPS_PER_UNIT = 12.0


def _unit_tensors(info) -> tuple[float, float]:
    """Parameter tensors of one block unit and of the root unit (the analysis' ``PartInfo.tensors``)."""
    block = next((p.tensors for p in info.parts if p.name != "rest"), 0)
    rest = sum(p.tensors for p in info.parts if p.name == "rest")
    return float(block), float(rest)


def _calibrated(hw, ranks: int) -> bool:
    """Whether ``hw`` measured FSDP2's own work per unit (and there is a collective to wait on)."""
    return ranks > 1 and hw.fsdp_unit_s > 0 and hw.op_overhead_s > 0


def _unit_ops(hw, ranks: int, reducing: float, tensors: float = 0.0) -> float:
    """FSDP2's own work per unit of ``tensors`` parameter tensors per forward, in bare dispatches
    (``Effects.ops_add``: the backward counts twice): the calibrated ``hw.fsdp_unit_s + tensors x
    hw.fsdp_tensor_s`` per forward + backward, plus ``fsdp_unit_reduce_s`` on the share ``reducing`` of
    micro-batches whose backward reduce-scatters, spread 1:2 over forward and backward;
    :data:`_FSDP_OPS_PER_UNIT` when not calibrated or over one rank (no collective to wait on)."""
    if _calibrated(hw, ranks):
        seconds = hw.fsdp_unit_s + tensors * hw.fsdp_tensor_s + reducing * hw.fsdp_unit_reduce_s
        return seconds / (3 * hw.op_overhead_s)
    return _FSDP_OPS_PER_UNIT


#: host<->device bandwidth for CPU offload when the hardware does not give one: PCIe Gen4 x16 achieved
#: (~25 GB/s of the 32 GB/s raw; PCI-SIG PCIe 4.0 specification), bytes/s
HOST_LINK_BW = 25e9


@dataclass
class _ExpertUnits:
    """The cost model's view of the experts under expert parallelism, per rank (elements; see
    :func:`_expert_units`)."""

    layers: float  # experts units (MoE layers) on the most loaded pipeline rank
    elements: float  # expert elements the rank holds before FSDP (1/ep of its layers' experts)
    dense: float  # the rank's other elements (the dense units: blocks without experts, the root)
    dense_block: float  # mean elements of one block's unit without its experts


def _expert_units(info, dims) -> _ExpertUnits | None:
    """The experts as FSDP units of their own, or None when FSDP treats them as dense: a model without
    experts, or ``ep == 1`` (``expert_parallel`` then records no expert group, so the experts stay in their
    blocks' units on the dense mesh, as the estimate prices them without this)."""
    ex = getattr(info, "experts", None)
    if ex is None or dims.ep <= 1:
        return None
    tp = max(dims.tp, 1)
    # the experts' share of the mean block (the experts modules live inside the blocks)
    dense_block = max(block_params(info) - ex.params / max(info.num_blocks, 1), 0.0) / tp
    return _ExpertUnits(moe_layers_per_rank(info, dims), expert_params(info, dims), dense_params(info, dims),
                        dense_block)


def _check_accumulate_sharded(strategy) -> None:
    if "pipeline_parallel" in strategy:
        raise StrategyError(
            "fsdp: accumulate_sharded reduces the gradients after every micro-batch, but under pipeline_parallel the "
            "schedule runs the micro-batches and reduces once per step (the units stay unsharded between them); "
            "drop accumulate_sharded.")


def _price_expert_units(e, ex: _ExpertUnits, dims, nb: int, cd: int, rd: int, accum: int,
                        zero3: bool, rs_calls: int = 1, hw=None) -> None:
    """Add the experts units to FSDP's ``Effects`` ``e``: each is sharded over the whole ``edp`` (the 1-D
    ``mesh["edp"]``, whatever ``dp_replicate``/``dp_shard`` are), so its parameters, gradients and Adam state
    are ``1/edp`` of the rank's ``1/ep`` (``group_memory_scale``, not the dense ``1/dp_shard``); per micro-
    batch one all-gather per unit in forward (ZeRO-3: again in backward) and per step one reduce-scatter per
    unit, on ``edp``, each prefetched/overlapped behind the dense units of the same pass (the first and last
    collective of a pass are the root's, already counted exposed); none when ``edp == 1``. Transient: ZeRO-3
    the last block's experts gathered with it, ZeRO-2 all of the rank's. The extra units' hooks add to
    ``ops_add`` per block instance. ``rs_calls``: reduce-scatters per step (``accum`` under
    ``accumulate_sharded``, whose shards accumulate: no unsharded expert gradient then)."""
    edp = dims.edp
    e.group_memory_scale["expert"] = {k: 1.0 / edp for k in GROUPED}
    if rs_calls == 1:
        e.grads_unsharded_accum += ex.elements * rd
    layers = ex.layers
    unit = ex.elements / layers if layers else 0.0
    e.memory_add["temporary"] += (min(layers, 1) * unit if zero3 else ex.elements) * cd
    if nb:  # the experts units' hooks and copies, spread over the rank's block instances
        unit_ops = _unit_ops(hw, dims.edp, rs_calls / accum) if hw is not None else _FSDP_OPS_PER_UNIT
        e.ops_add += unit_ops * layers / nb
    if edp <= 1 or unit <= 0:
        e.notes.append("experts units on edp=1: no communication for the experts")
        return
    e.collectives.append(Collective("all_gather", unit * cd, "edp", calls=accum * layers, overlap="forward",
                                    label="fsdp.expert_all_gather"))
    if zero3:
        e.collectives.append(Collective("all_gather", unit * cd, "edp", calls=accum * layers, overlap="backward",
                                        label="fsdp.expert_all_gather_bwd"))
    e.collectives.append(Collective("reduce_scatter", unit * rd, "edp", calls=rs_calls * layers, overlap="backward",
                                    label="fsdp.expert_reduce_scatter"))


class _QuietStridedGather(logging.Filter):
    """Drops torch's "N sequential all_gather operations will be performed. This is suboptimal" warning:
    gathering an FSDP-sharded expert parameter ((_StridedShard over edp, Shard over ep): checkpoints, export,
    clipping's full norm) needs one all-gather per mesh dimension by construction, and torch would print the
    hint on every rank for every such tensor."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "sequential all_gather operations" not in record.getMessage()


def _quiet_strided_gather_warning() -> None:
    logger = logging.getLogger("torch.distributed.tensor._redistribute")
    if not any(isinstance(f, _QuietStridedGather) for f in logger.filters):
        logger.addFilter(_QuietStridedGather())


def _shard_experts(mod, ctx, c: FSDPConfig, kw: dict) -> None:
    """One FSDP unit on ``mesh["edp"]`` for an experts module (its parameters are ``Shard(0)`` on
    ``mesh["ep"]``, so FSDP's placements become ``(Shard(0) or Shard(1) over edp, Shard(0) over ep)`` on the
    ``(edp, ep)`` mesh); FSDP sums its gradients over edp and divides by ``dp``."""
    dims = ctx.mesh.dims
    _quiet_strided_gather_warning()
    experts = int(getattr(mod, "num_experts", 0) or 0)
    dim1 = dims.edp > 1 and dims.edp * dims.ep > experts and all(p.dim() > 1 for p in mod.parameters(recurse=False))
    fully_shard(mod, reshard_after_forward=c.reshard_after_forward,
                shard_placement_fn=(lambda _p: Shard(1)) if dim1 else None, **{**kw, "mesh": ctx.mesh["edp"]})
    if dims.edp == 1:
        # no communication over a one-rank edp; torch 2.13's FSDP2 then divides by the factor in its
        # world-size-1 copy AND again by its post-divide factor (force-sum, or an fp16 reduce dtype): dp^2.
        # Let FSDP divide by 1 and divide by dp at the step instead (_expert_divider).
        mod.set_gradient_divide_factor(1.0)
        return
    mod.set_gradient_divide_factor(float(dims.dp))
    if dist.get_backend(ctx.mesh.group("edp")) == "gloo":
        # a factor other than the group size is NCCL's PREMUL_SUM, which gloo lacks: sum, then divide
        mod.set_force_sum_reduction_for_comms(True)


def _check_output_reaches_backward(module, _args, output) -> None:
    """FSDP2 finds the tensors of the root's output with ``torch.utils._pytree`` to hook its pre-backward
    (re-gathering the parameters it freed after forward). An output object pytree cannot look into (a plain
    class with a ``.loss`` attribute) hides them: the backward then reads freed storage and fails with
    "setStorage: sizes ... out of bounds for storage of size 0". Say so at the forward instead."""
    if not torch.is_grad_enabled():
        return
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves(output)
    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in leaves):
        return
    hidden = [k for k, v in vars(output).items() if isinstance(v, torch.Tensor)] if hasattr(output, "__dict__") else []
    if hidden:
        raise TypeError(
            f"fsdp: the model returned a {type(output).__name__} whose tensors ({', '.join(hidden)}) FSDP cannot see "
            "(torch.utils._pytree does not look inside that class), so its backward would read freed parameters. "
            "Return a tensor, a tuple/dict of tensors, a dataclass registered with torch.utils._pytree, or a Hugging "
            "Face ModelOutput.")


def _expert_divider(ctx, modules) -> None:
    """With edp == 1 the expert units' gradients come out of FSDP summed, not divided: divide them by dp once
    per step, before clipping (an ExpertGradReducer over a one-rank group divides without communicating)."""
    from ..parallel.expert.reduce import ExpertGradReducer

    params = [p for m in modules for p in m.parameters(recurse=False)]
    if not params or ctx.mesh.dims.dp == 1:
        return
    divider = ExpertGradReducer(params, ctx.mesh.group("edp"), ctx.mesh.dims.dp)
    ctx.pre_step_hooks.append(divider)
    ctx.post_optimizer.append(lambda c: divider.attach(c.model_parts, c.optimizer))


def _shard_fp32_norms(model, units: list[list[str]], shared: list[list[str]], c: FSDPConfig, fp32_kw: dict) -> int:
    """``fully_shard`` every BatchNorm-like module (running statistics) as its own unit whose policy casts
    nothing (FSDP1's ``MixedPrecision._module_classes_to_ignore``): its parameters stay fp32 for compute, as its
    statistics are, and it takes the low-precision input of the layer before it. Skipped: the model itself, a
    module that is a unit anyway (it gets the same policy), and one sharing a parameter with another module (the
    tie's unit owns it). Returns the number of units made."""
    unit_tops = {q for unit in units for q in unit}
    tied = {o for owners in shared for o in owners}
    n = 0
    for name, mod in fp32_norm_modules(model):
        if name == "" or name in unit_tops or name in tied:
            continue
        fully_shard(mod, reshard_after_forward=c.reshard_after_forward, **fp32_kw)
        n += 1
    return n


def _plan_units(block_names: list[str], shared: list[list[str]]) -> list[list[str]]:
    """Blocks become units; a block that shares a parameter with modules outside it is merged with them.

    A shared parameter must live in exactly one FSDP unit (recent torch refuses the split; pytorch PR
    176257). Owners inside the same block need nothing; owners in different blocks are grouped into one
    multi-module unit; owners outside every block stay with the root.
    """
    def block_of(owner: str) -> str | None:
        for b in block_names:
            if owner == b or owner.startswith(b + "."):
                return b
        return None

    merged: dict[str, set[str]] = {b: {b} for b in block_names}
    to_root: set[str] = set()
    for owners in shared:
        bs = {block_of(o) for o in owners}
        if len(bs) == 1:
            continue  # all owners in one block (or all in the root)
        if None in bs:  # shared with a module outside any block: the block joins the root
            to_root |= {b for b in bs if b is not None}
            continue
        group = set().union(*(merged[b] for b in bs))
        for b in group:
            merged[b] = group
    units, seen = [], set()
    for b in block_names:
        if b in to_root or any(m in to_root for m in merged[b]):
            continue
        key = frozenset(merged[b])
        if key not in seen:
            seen.add(key)
            units.append(sorted(key, key=block_names.index))
    return units
