"""Drive ``torch.distributed.pipelining`` schedules for ``train_step``.

* Stage placement: ``loop`` (stage ``s`` on pipeline rank ``s % pp``) or ``v`` (ZB-V: rank ``r`` holds stages
  ``r`` and ``2 pp - 1 - r``).
* Keyword routing: ``schedule.step(*args, **kwargs)`` hands a rank's kwargs to *its* stages only (the
  first-stage-only behaviour of pytorch/pytorch 130055 is the tracer frontend's). Every pipeline rank reads
  the same batch, so each rank passes exactly the inputs its stages use (masks, ``position_ids``), split into
  micro-batches by the schedule. Only hidden states travel between stages.
* Loss: the last stage's schedule loss is an adapter that slices the user's batch to the micro-batch (rows
  identified by the ``target`` index tensor), builds the model output (HF ``loss`` from ``labels``), and calls
  ``train_step``'s loss function. ``scale_grads=False``: ``train_step`` scales means by
  ``1 / (num_microbatches x grad_accum_steps)`` itself, so gradients accumulate correctly across calls.
* Shapes: stages infer their send/receive buffers from the first micro-batch (dynamic metadata inference) and
  keep them, so one schedule runs one input shape. Schedules are cached per shape (LRU); a new sequence
  length costs one metadata pass.
"""
from __future__ import annotations

import inspect
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.nn.parallel import DistributedDataParallel

from ..context.sequence import activate_rows
from .families import Family
from .placement import SCHEDULES
from .split import StageSpec


class _LossAdapter:
    """The schedule's ``loss_fn(output, rows)``; see the module docstring."""

    def __init__(self, family: Family):
        self.family = family
        self.inferring = False  # set while a stage runs metadata inference (its loss call is not a micro-batch)
        self.records: list[tuple[float, float, float, bool]] = []
        self.batch = self.inputs = self.loss_fn = self.module = None
        self.rows = 0
        self.chunks = 1  # micro-batches of this call (the schedule splits ``rows`` into that many, in order)

    def begin(self, batch, inputs, rows, loss_fn, module, chunks: int = 1) -> None:
        self.batch, self.inputs, self.rows, self.loss_fn, self.module = batch, inputs, rows, loss_fn, module
        self.chunks = chunks
        self.records = []

    def __call__(self, output: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        if self.inferring:  # only shapes matter there; keep it cheap and out of the statistics
            return output.float().sum() * 0.0
        start, stop = int(rows[0]), int(rows[-1]) + 1
        sub_batch = slice_rows(self.batch, start, stop, self.rows)
        sub_inputs = slice_rows(self.inputs, start, stop, self.rows)
        out = self.family.output(self.module, output, sub_inputs)
        loss, num, den, count, is_sum = self.loss_fn(sub_batch, out)
        self.records.append((float(num), float(den), float(count), bool(is_sum)))
        return loss


class _Stage(PipelineStage):
    """``PipelineStage`` that tells the loss adapter when it runs metadata inference, and runs that inference
    forward of a DDP stage under ``no_sync``: it is followed by no parameter backward, and DDP's reducer,
    prepared for one, fails at the first real step (torch 2.13: "rebuilt parameter indices size is not same as
    original model parameters size")."""

    def __init__(self, *args, adapter: _LossAdapter, **kwargs):
        super().__init__(*args, **kwargs)
        self._loom_adapter = adapter

    def _prepare_backward_infra(self, *args, **kwargs):
        self._loom_adapter.inferring = True
        try:
            with self._chunk_rows(0):  # (a sequence split's masks: the inference's micro-batch)
                return super()._prepare_backward_infra(*args, **kwargs)
        finally:
            self._loom_adapter.inferring = False

    # a sequence split (context parallel / Ulysses): attention inside a stage sees one micro-batch, so the split
    # batch's per-sample masks must be those of its rows (the schedule splits every input along dim 0 in order)
    def _chunk_rows(self, chunk: int):
        per = self._loom_adapter.rows // max(self._loom_adapter.chunks, 1)
        return activate_rows(chunk * per, (chunk + 1) * per)

    def _prepare_forward_infra(self, *args, **kwargs):  # shape inference runs on the first micro-batch
        with self._chunk_rows(0):
            return super()._prepare_forward_infra(*args, **kwargs)

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        with self._chunk_rows(fwd_chunk_id):
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self._chunk_rows(bwd_chunk_id):
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        with self._chunk_rows(bwd_chunk_id):
            return super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _compute_outputs(self, *args, module, **kwargs):
        if isinstance(module, DistributedDataParallel):
            with module.no_sync():
                return super()._compute_outputs(*args, module=module, **kwargs)
        return super()._compute_outputs(*args, module=module, **kwargs)


def slice_rows(obj: Any, start: int, stop: int, rows: int) -> Any:
    """Rows ``start:stop`` of every tensor in a (nested) batch whose first dimension is ``rows``."""
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == rows else obj
    if isinstance(obj, Mapping):
        out = {k: slice_rows(v, start, stop, rows) for k, v in obj.items()}
        try:
            return type(obj)(out)
        except TypeError:
            return out
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(slice_rows(v, start, stop, rows) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(slice_rows(v, start, stop, rows) for v in obj)
    return obj


#: ``loss_fn(sub_batch, output) -> (loss to backpropagate, report numerator, report denominator, item count,
#: is SumLoss)``, supplied by ``train_step``
LossFn = Callable[[Any, Any], tuple[torch.Tensor, float, float, float, bool]]


class PipelineDriver:
    """Runs one ``train_step``/``eval_loss`` call through the pipeline on this rank's stages.

    Args:
        family: the stage runner (input binding, routing table, output building).
        specs: this rank's stages (``StageSpec``), in stage order.
        parts: ``{stage index: final stage module}`` (DDP-wrapped, FSDP-sharded, ... as the methods left it).
        modules: ``{stage index: unwrapped stage module}`` (for the last stage's loss).
        signature: the original model's ``forward`` signature (how the batch binds to inputs).
        schedule: a :data:`SCHEDULES` name; ``num_microbatches``: pipeline micro-batches per call.
        pp_group / device: the pipeline process group and this rank's device.
        ties: the :class:`~torchloom.parallel.pipeline.tied.TiedWeights` of weights tied across stages, or None
            (``train_step`` counts their copies once in the gradient norm).
        mesh: the :class:`~torchloom.parallel.mesh.ParallelMesh`: stages exchanging DTensor activations
            (sequence parallel) look their sub-mesh up by dimension names there.
        cache_size: schedules (one per input shape) kept.
    """

    def __init__(self, *, family: Family, specs: list[StageSpec], parts: dict[int, nn.Module],
                 modules: dict[int, nn.Module], signature: inspect.Signature, schedule: str, num_microbatches: int,
                 pp_group, device: torch.device, ties: Any = None, cache_size: int = 8, mesh: Any = None):
        self.family, self.specs, self.parts, self.modules, self.ties = family, specs, parts, modules, ties
        self.signature, self.schedule_name, self.num_microbatches = signature, schedule, num_microbatches
        self.pp_group, self.device, self.cache_size, self.mesh = pp_group, device, cache_size, mesh
        self.num_stages = specs[0].num_stages
        self.has_first = any(s.is_first for s in specs)
        self.last = next((s.index for s in specs if s.is_last), None)
        self.adapter = _LossAdapter(family)
        self._schedules: OrderedDict[tuple, Any] = OrderedDict()
        #: keyword inputs each local stage used in the last call: ``{stage: sorted names}``
        self.routed: dict[int, list[str]] = {}
        self.loss_inputs_seen: list[str] = []

    def _get_mesh(self, mesh_dim_names: tuple[str, ...], mesh_layout: Any = None):
        """``PipelineStage``'s DTensor metadata names a mesh by its dimensions (``("tp",)`` for sequence-parallel
        activations); the mesh object owns it, so no new process group is created."""
        if self.mesh is None:
            raise RuntimeError(f"a pipeline stage received a DTensor on mesh {mesh_dim_names} but no mesh was given")
        return self.mesh[mesh_dim_names[0] if len(mesh_dim_names) == 1 else tuple(mesh_dim_names)]

    # ------------------------------------------------------------------------------------------------
    def run(self, batch: Any, model_input_format: str | None, loss_fn: LossFn, backward: bool) -> dict[str, Any]:
        """Forward (and backward) every micro-batch of ``batch`` through the pipeline.

        Returns (identical on every pipeline rank): ``report`` (fp32 0-dim: mean loss, or total / count for
        SumLoss), ``count`` (SumLoss items in this call), ``sum_mode`` (bool or None), ``num``/``den``
        (floats, ``report = num / den``).

        Raises:
            ValueError: the batch size does not divide into ``num_microbatches``, or an input cannot be routed.
        """
        if not backward and self.schedule_name == "zbv":
            raise NotImplementedError(
                "pipeline_parallel: forward-only evaluation under schedule 'zbv' is not supported by "
                "torch.distributed.pipelining (its eval still runs the backward actions); train with "
                "'zero_bubble' or 'interleaved_1f1b' to evaluate through the pipeline."
            )
        inputs = self.family.bind_inputs(self.signature, batch, model_input_format)
        x = inputs[self.family.primary]
        rows = x.shape[0]
        n = self.num_microbatches
        if rows % n:
            raise ValueError(
                f"pipeline_parallel: the per-rank batch has {rows} rows, which does not split into num_microbatches="
                f"{n} equal micro-batches; make the micro-batch size (per train_step call) a multiple of {n} or "
                f"change num_microbatches."
            )
        wanted = {k for s in self.specs for k in self.family.inputs_for(s)}
        kwargs = {k: self._batched(k, v, rows) for k, v in inputs.items() if k in wanted}
        self.routed = {s.index: sorted(k for k in self.family.inputs_for(s) if k in kwargs) for s in self.specs}
        self.loss_inputs_seen = [] if self.last is None else sorted(k for k in self.family.loss_inputs if k in inputs)
        shapes = sorted((k, tuple(v.shape), str(v.dtype)) for k, v in kwargs.items() if isinstance(v, torch.Tensor))
        key = (backward, tuple(x.shape), str(x.dtype), tuple(shapes))
        schedule = self._schedule(key)
        target = torch.arange(rows) if self.last is not None else None
        self.adapter.begin(batch, inputs, rows, loss_fn, self.modules.get(self.last), chunks=n)
        args = (x,) if self.has_first else ()
        if backward:
            schedule.step(*args, target=target, return_outputs=False, **kwargs)
        else:
            with torch.no_grad():
                schedule.eval(*args, target=target, return_outputs=False, **kwargs)
        records = self.adapter.records
        if self.last is not None and len(records) != n:
            raise RuntimeError(
                f"pipeline_parallel: the last stage computed {len(records)} micro-batch losses, expected {n} (the "
                "installed torch.distributed.pipelining computes losses differently than this driver assumes)."
            )
        return self._share(records)

    def _batched(self, name: str, v: Any, rows: int) -> Any:
        """A keyword input the schedule can split along dim 0 (a broadcast first dim of 1 is expanded)."""
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return v
        if v.shape[0] == rows:
            return v
        if v.shape[0] == 1:
            return v.expand(rows, *v.shape[1:])
        raise ValueError(
            f"pipeline_parallel: input {name!r} has first dimension {v.shape[0]} but the batch has {rows} rows; "
            f"pipeline micro-batches split every input along dim 0."
        )

    def _share(self, records) -> dict[str, Any]:
        """Sum the last stage's loss statistics over the pipeline group (zeros elsewhere)."""
        num = sum(r[0] for r in records)
        den = sum(r[1] for r in records)
        count = sum(r[2] for r in records)
        n_sum = sum(1 for r in records if r[3])
        stats = torch.tensor([num, den, count, len(records) - n_sum, n_sum], dtype=torch.float64, device=self.device)
        if dist.get_world_size(self.pp_group) > 1:
            dist.all_reduce(stats, group=self.pp_group)
        num, den, count, n_mean, n_sum = stats.tolist()
        sum_mode = True if n_sum else (False if n_mean else None)
        return {"report": torch.tensor(num / max(den, 1e-30), dtype=torch.float32), "count": count,
                "sum_mode": sum_mode, "num": num, "den": den}  # num/den: train_step's dp-global loss

    def _schedule(self, key: tuple):
        if key in self._schedules:
            self._schedules.move_to_end(key)
            return self._schedules[key]
        name, kind, _ = SCHEDULES[self.schedule_name]
        cls = getattr(pipelining, name)
        stages = [_Stage(self.parts[s.index], s.index, self.num_stages, self.device, group=self.pp_group,
                         adapter=self.adapter, get_mesh=self._get_mesh) for s in self.specs]
        common = dict(n_microbatches=self.num_microbatches, loss_fn=self.adapter, scale_grads=False)
        schedule = cls(stages[0], **common) if kind == "single" else cls(stages, **common)
        self._schedules[key] = schedule
        while len(self._schedules) > self.cache_size:
            self._schedules.popitem(last=False)
        return schedule
