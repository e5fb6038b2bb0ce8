"""`TrainStep`: forward, backward, gradient accumulation (with no-sync), loss scaling, global-norm
clipping and the optimizer step, for any strategy."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .moe.aux import aux_loss_scale
from .moe.load import frozen_windows, moe_layers, window_load, window_metrics
from .parallel.grad_norm import clip_grad_norm_
from .parallel.loss_scaler import DynamicLossScaler


@dataclass
class SumLoss:
    """Return this from ``loss_func`` to normalise by the *global* number of items (e.g. valid tokens).

    ``total`` is the summed (not averaged) loss of the micro-batch (0-dim tensor) and ``count`` the number
    of items it sums over. ``train_step`` backpropagates the sums and, at the optimizer step, divides the
    gradients by the count summed over all accumulation steps and data-parallel ranks, so the update is
    identical however the global batch is split (huggingface/transformers PR 34191).
    """

    total: torch.Tensor
    count: int | torch.Tensor

    @classmethod
    def from_hf(cls, output: Any, labels: torch.Tensor, num_items_in_batch: Any = None, ignore_index: int = -100,
                shift: bool = True) -> "SumLoss":
        """Token-exact causal-LM loss from a Hugging Face output and its ``ignore_index``-padded labels.

        ``total`` is the cross-entropy (computed in fp32) summed over the valid targets, ``count`` their number
        (int64 0-dim tensor): ``train_step`` then divides by the count over all accumulation steps and
        data-parallel ranks, i.e. the update is the whole global batch's per-token mean however it is split.
        Same numerics as ``transformers.loss.loss_utils.ForCausalLMLoss`` (docs/hf.md, "Loss normalisation").

        Args:
            output: a causal-LM output (``.logits`` ``[B, T, V]``, any float dtype), a mapping with "logits",
                a ``(loss?, logits, ...)`` tuple, or the logits tensor.
            labels: ``[B, T]`` int64, ``ignore_index`` where there is no target (padding, prompt tokens).
            num_items_in_batch: what ``transformers.Trainer`` passes its loss functions (the valid tokens of
                the whole accumulation window, possibly of all devices). Accepted so HF-style loss functions
                port unchanged, but it does NOT divide the loss: torchloom's train_step already divides by
                the global count, so using it too would normalise twice. An int (or CPU tensor) smaller than
                this micro-batch's own count cannot be such a total and raises.
            ignore_index: the label value without a target (HF: -100).
            shift: True (HF causal LM): position t predicts ``labels[:, t + 1]``; False: labels already aligned.

        Raises:
            TypeError: no logits in ``output``. ValueError: logits/labels shapes differ, or
            ``num_items_in_batch`` is below this micro-batch's count.
        """
        from .hf.loss import causal_lm_logits, causal_lm_sum

        total, count = causal_lm_sum(causal_lm_logits(output), labels, ignore_index=ignore_index, shift=shift)
        if num_items_in_batch is not None:
            _check_num_items(num_items_in_batch, count)
        return cls(total, count)


def _check_num_items(num_items: Any, count: torch.Tensor) -> None:
    """``num_items_in_batch`` is a total over a window that includes this micro-batch: at least its count.
    Checked only where it costs no device sync (an int, or both on the CPU)."""
    if isinstance(num_items, torch.Tensor) and (num_items.device.type != "cpu" or count.device.type != "cpu"):
        return
    n, mine = float(num_items), int(count)
    if n < mine:
        raise ValueError(
            f"SumLoss.from_hf: num_items_in_batch={n:g} is smaller than this micro-batch's {mine} valid tokens, so "
            "it is not the token count of a window containing it. It is not needed: train_step divides by the "
            "global count itself (docs/hf.md); drop the argument.")


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to ``device``: through mappings (their type kept when it can be
    rebuilt from a dict), dataclasses (``dataclasses.replace``), namedtuples, tuples and lists. Dtypes never
    change: precision methods do not cast inputs here (docs/methods/amp.md, "Inputs")."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):  # dict, HF BatchEncoding (a UserDict), ...
        moved = {k: move_to_device(v, device) for k, v in batch.items()}
        try:
            return type(batch)(moved)
        except TypeError:
            return moved
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        return dataclasses.replace(batch, **{f.name: move_to_device(getattr(batch, f.name), device)
                                             for f in dataclasses.fields(batch) if f.init})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(move_to_device(v, device) for v in batch)
    return batch


def call_model(model: nn.Module, batch: Any, model_input_format: str | None) -> Any:
    """``None`` -> ``model(batch)``; ``"unpack_sequence"`` -> ``model(*batch)``; ``"unpack_dict"`` ->
    ``model(**batch)``.

    Raises:
        TypeError: the batch's type does not fit the format (a mapping for "unpack_sequence", a non-mapping
            for "unpack_dict"), or the batch does not bind to the model's ``forward`` (a key it has no parameter
            for, a required one missing: the message names the batch keys, the parameters and the formats). A
            TypeError raised inside ``forward`` propagates unchanged.
    """
    if model_input_format is None:
        return model(batch)
    if model_input_format == "unpack_sequence":
        if isinstance(batch, Mapping) or not isinstance(batch, (list, tuple)):
            raise TypeError(
                f"model_input_format='unpack_sequence' calls model(*batch) and needs a list/tuple batch, got "
                f"{type(batch).__name__}; use 'unpack_dict' for mapping batches or None to pass the batch as is."
            )
        try:
            return model(*batch)
        except TypeError as e:
            _raise_if_batch_does_not_fit(e, model, tuple(batch), {}, model_input_format)
            raise
    if model_input_format == "unpack_dict":
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"model_input_format='unpack_dict' calls model(**batch) and needs a mapping batch, got "
                f"{type(batch).__name__}; use 'unpack_sequence' for tuple batches or None to pass it as is."
            )
        try:
            return model(**batch)
        except TypeError as e:
            _raise_if_batch_does_not_fit(e, model, (), dict(batch), model_input_format)
            raise
    raise ValueError(
        f"model_input_format={model_input_format!r} is not valid; use None, 'unpack_sequence' or 'unpack_dict'."
    )


def _raise_if_batch_does_not_fit(error: TypeError, model: nn.Module, args: tuple, kwargs: dict,
                                  model_input_format: str) -> None:
    """After ``model(*args, **kwargs)`` raised ``error``: if the batch does not bind to the model's ``forward``
    signature (a key it has no parameter for, a required one missing, too many items), raise a TypeError naming
    the batch, the forward's parameters and the ``model_input_format`` options. Returns when the batch binds
    (the TypeError came from inside forward: the caller re-raises it unchanged) or the signature is unknown."""
    inner = model
    while True:  # wrappers that pass the arguments on unchanged: DDP (.module), torch.compile (._orig_mod)
        nxt = getattr(inner, "_orig_mod", None)
        if nxt is None and isinstance(inner, DistributedDataParallel):
            nxt = inner.module
        if not isinstance(nxt, nn.Module):
            break
        inner = nxt
    try:
        sig = inspect.signature(inner.forward)
    except (TypeError, ValueError):  # no signature to check against: leave the error as it is
        return
    try:
        sig.bind(*args, **kwargs)
        return
    except TypeError as bind_error:
        why = str(bind_error)
    kinds = inspect.Parameter
    params = [n for n, p in sig.parameters.items() if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    extra = any(p.kind == kinds.VAR_KEYWORD for p in sig.parameters.values())
    unexpected = [] if extra else [k for k in kwargs if k not in sig.parameters]
    if model_input_format == "unpack_dict":
        got = f"model(**batch) with the batch keys {list(kwargs)}"
        fix = ("make the batch's keys the forward's parameter names (drop or rename the others in the dataset, the "
               "collate_fn or prepare_input=), or use model_input_format='unpack_sequence' (model(*batch)) or None "
               "(model(batch))")
    else:
        got = f"model(*batch) with {len(args)} batch items"
        fix = ("make the batch's items the forward's positional parameters, or use model_input_format='unpack_dict' "
               "(model(**batch), for mapping batches) or None (model(batch))")
    raise TypeError(
        f"model_input_format={model_input_format!r} calls {got}, but {type(inner).__name__}.forward takes "
        f"{params}" + (" and **kwargs" if extra else "") + f": {why}"
        + (f" (unexpected keys: {unexpected})" if unexpected else "") + f". Fix: {fix}.") from error


def _sequence_scope(batch: Any, check: bool = True):
    """A split batch's attention scope (``SequenceBatch.activate``: forward, loss and backward see its
    sequence facts), else nothing. ``check=False`` for pipelined models (a stage may hold no attention)."""
    activate = getattr(batch, "activate", None)
    return activate(check) if callable(activate) and hasattr(batch, "sequence") else contextlib.nullcontext()


def _sequence_sum(batch: Any, total: torch.Tensor, count: float) -> tuple[torch.Tensor, float]:
    """``(total, count)`` summed over the cp ranks that hold the split sample's tokens."""
    stat = torch.stack([total.double(), torch.tensor(count, dtype=torch.float64, device=total.device)])
    dist.all_reduce(stat, group=batch.sequence.group)
    return stat[0].float(), float(stat[1])


def _local(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor for reporting: a (replicated) DTensor loss, as loss parallel returns, is gathered."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _output_loss(output: Any) -> torch.Tensor:
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if loss is None:
        raise TypeError(
            f"no loss_func was given and the model output ({type(output).__name__}) has no 'loss'; pass "
            "loss_func=lambda batch, output: ... to auto_accelerate (or give a Hugging Face model `labels`)."
        )
    return loss


class TrainStep:
    """Callable ``train_step(batch) -> loss`` for one per-rank micro-batch.

    Steps the optimizer (and scheduler) every ``grad_accum_steps`` calls; between them gradients
    accumulate locally (DDP ``no_sync`` / FSDP2 ``set_requires_gradient_sync(False)``). Returns the
    micro-batch loss as a detached fp32 0-dim tensor on the loss's device, unscaled, the same on every rank:
    with ``loss_report="global"`` (default) the mean over the data-parallel ranks' micro-batches of this call
    (for :class:`SumLoss` token-exact: the ranks' totals summed / their counts summed; tensor- and
    pipeline-parallel peers hold the same value). It costs one 2-element all-reduce over the dp group per call,
    issued asynchronously as soon as the loss is known (it overlaps the backward and the optimizer step;
    pipelined: the step) and waited before returning (on NCCL the wait is a stream dependency, not a host
    sync). ``loss_report="local"`` (constructor argument or attribute) returns this rank's own micro-batch
    loss without communication; ``last_local_loss`` always holds it. ``last_loss_stat`` is the fp64
    ``[numerator, denominator]`` the returned loss is the ratio of (summed over the dp ranks when the loss
    is global): ``[summed loss, item count]`` for :class:`SumLoss`, ``[sum of the micro-batch means, number
    of them]`` otherwise; summed over a window it gives the window's item-weighted (resp. plain) mean.

    Attributes after an optimizer step: ``last_grad_norm`` (fp32, global, before clipping, or None),
    ``last_step_skipped`` (fp16 overflow), ``optimizer_steps``; with :class:`torchloom.moe.MoE` layers
    ``last_moe_metrics`` (dict of floats: the weighted aux losses of the window averaged over its
    micro-batches, their sum ``aux_loss``, ``dropped_fraction``) and ``last_expert_load`` ([layers, E] int64
    assignments per expert over the window, before dropping), this rank's layers only; both None without MoE.
    ``step_observers``: callables ``observer(train_step)`` run after each optimizer step, once the call's loss
    is reported (``auto_accelerate(check_prediction=True)`` adds its step-time check here).

    MoE aux losses (docs/moe.md, "train_step"): their gradient gets exactly the factor the main loss gets:
    ``1 / grad_accum_steps`` (pipeline: also ``/ num_microbatches``) times the fp16 loss scale; with
    :class:`SumLoss` the per-token-mean aux of a micro-batch is multiplied by that micro-batch's count, so after
    the global normalisation it is the token-weighted mean (not supported under pipeline parallelism: the
    count is known on the last stage only; NotImplementedError). The returned loss stays the main loss.

    Two-pass optimizers (:class:`torchloom.optim.WSAM`, SAM-like ones with ``first_step``/``second_step``):
    the window's micro-batches are kept and replayed once more at the perturbed weights at the optimizer
    step (2x forward/backward; docs/optim/wsam.md). Not supported with pipeline parallelism or fp16 loss
    scaling (NotImplementedError at construction).
    """

    def __init__(self, *, model: nn.Module, optimizer: torch.optim.Optimizer, loss_func: Callable,
                 device: torch.device, grad_accum_steps: int = 1, max_grad_norm: float | None = None,
                 lr_scheduler: Any = None, loss_scaler: DynamicLossScaler | None = None,
                 model_input_format: str | None = None, prepare_input: Callable | None = None,
                 dp_group: dist.ProcessGroup | None = None, dp_size: int = 1,
                 step_contexts: Sequence[Callable[[], Any]] = (), grad_norm_groups: Sequence[dist.ProcessGroup] = (),
                 pre_step_hooks: Sequence[Callable[[list], None]] = (), loss_report: str = "global",
                 sequence_split: Callable[[Any], Any] | None = None, sync_every_microbatch: bool = False):
        if grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be >= 1, got {grad_accum_steps}")
        #: reduce gradients on every micro-batch (fsdp ``accumulate_sharded``), not only the window's last
        self.sync_every_microbatch = sync_every_microbatch
        self.loss_report = loss_report  # validated per call too: it is a public attribute users may set
        _check_loss_report(loss_report)
        self.model = model
        self.optimizer = optimizer
        self.loss_func = loss_func
        self.device = device
        self.grad_accum_steps = grad_accum_steps
        self.max_grad_norm = max_grad_norm
        self.lr_scheduler = lr_scheduler
        self.loss_scaler = loss_scaler
        self.model_input_format = model_input_format
        self.prepare_input = prepare_input or move_to_device
        # context parallel / Ulysses: this rank's tokens of every sample (torchloom.parallel.context)
        self.sequence_split = sequence_split
        self.dp_group = dp_group
        self.dp_size = dp_size
        self.step_contexts = list(step_contexts)  # entered around forward + loss + backward (loss_parallel)
        self.grad_norm_groups = list(grad_norm_groups)  # disjoint-parameter groups for the global norm (pp)
        self.pre_step_hooks = list(pre_step_hooks)  # before unscale/clip (tied weights across stages)
        self.micro_step = 0
        self.optimizer_steps = 0
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_skipped = False
        self.last_local_loss: torch.Tensor | None = None  # this rank's micro-batch loss of the last call
        self.last_loss_stat: torch.Tensor | None = None  # [numerator, denominator] of the last returned loss
        self._report_stat: torch.Tensor | None = None
        self._count: float | torch.Tensor = 0.0  # items summed over the current accumulation window (SumLoss)
        self._sum_mode: bool | None = None
        self._pipeline = _pipeline_driver(model)  # drives the schedule when the model is pipelined
        self._two_pass = _is_two_pass(optimizer)  # WSAM/SAM: the window is replayed at perturbed weights
        self._window: list[Any] = []  # this window's prepared micro-batches (two-pass optimizers only)
        if self._two_pass:
            self._check_two_pass()
        self._moe = moe_layers(model)  # torchloom.moe.MoE layers: aux-loss scale and metrics
        self._moe_aux = any(m.config.aux_loss_weight > 0 or m.config.z_loss_weight > 0 for m in self._moe)
        self.last_moe_metrics: dict[str, float] | None = None
        self.last_expert_load: torch.Tensor | None = None
        self.step_observers: list[Callable[["TrainStep"], None]] = []  # called after each optimizer step

    def _notify_step(self) -> None:
        for observer in self.step_observers:
            observer(self)

    # ------------------------------------------------------------------------------------------------
    def __call__(self, batch: Any) -> torch.Tensor:
        if self._pipeline is not None:
            return self._pipeline_call(batch)
        sync = (self.micro_step + 1) % self.grad_accum_steps == 0
        batch = self._prepare(batch)
        if self._two_pass:
            self._window.append(batch)
            report, reduced = self._forward_backward(batch, self._first_pass_sync(sync), report=True)
        else:
            report, reduced = self._forward_backward(batch, self._maybe_no_sync(sync), report=True)
        self.micro_step += 1
        if sync:
            self.step()
        out = self._reported(report, reduced)
        if sync:
            self._notify_step()
        return out

    def _prepare(self, batch: Any) -> Any:
        """``prepare_input`` (to the device), then this rank's tokens under a sequence split."""
        batch = self.prepare_input(batch, self.device)
        return self.sequence_split(batch) if self.sequence_split is not None else batch

    # ------------------------------------------------------------------------------------------------ report
    def _start_report(self, stat: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
        """Start the all-reduce of ``[numerator, denominator]`` over dp (``loss_report="global"`` with dp > 1),
        asynchronously: it runs during the backward (and the optimizer step). Every dp rank issues it at the
        same point of every call, before the backward's gradient collectives."""
        _check_loss_report(self.loss_report)
        if self.loss_report != "global" or self.dp_size <= 1:
            return None
        return stat, dist.all_reduce(stat, group=self.dp_group, async_op=True)

    def _reported(self, local: torch.Tensor, reduced: tuple[torch.Tensor, Any] | None) -> torch.Tensor:
        """The loss to return (class docstring): this rank's, or the dp-global one once its all-reduce is done
        (on NCCL ``wait`` orders the current stream after it; no host sync)."""
        self.last_local_loss = local
        self.last_loss_stat = self._report_stat  # reduced in place by the all-reduce waited below
        if reduced is None:
            return local
        stat, work = reduced
        work.wait()
        return (stat[0] / stat[1].clamp(min=1.0)).float()

    def _forward_backward(self, batch: Any, sync_context: Any, report: bool = False) -> tuple[torch.Tensor, Any]:
        """Forward, loss and backward of one prepared micro-batch; returns this rank's loss to report and, with
        ``report``, the in-flight global report (``_start_report``)."""
        with sync_context, contextlib.ExitStack() as stack:
            for make_context in self.step_contexts:
                stack.enter_context(make_context())
            stack.enter_context(_sequence_scope(batch))
            output = call_model(self.model, batch, self.model_input_format)
            count_before = self._count
            loss, local, stat = self._loss(batch, output)
            if report:
                self._report_stat = stat
            reduced = self._start_report(stat) if report else None
            # the output (logits: micro-batch x seq x vocab) is not needed for backward: a plain loop's
            # `loss = model(x).loss` drops it here too; keeping it raised the peak by one logits tensor
            del output
            added = self._count - count_before
            # a tensor count is read back (a host sync) only for MoE layers, whose aux scale is a float
            aux_factor = self._aux_factor(float(added) if self._moe or not isinstance(added, torch.Tensor) else 0.0)
            if loss.grad_fn is None:
                raise RuntimeError(
                    "the loss does not depend on any trainable parameter (no grad_fn): loss_func must compute it "
                    "from the model output without .detach()/.item()/torch.tensor(...), and not under no_grad."
                )
            if self.loss_scaler is not None:
                loss = self.loss_scaler.scale_loss(loss)
            try:
                with aux_loss_scale(aux_factor):  # read by the MoE layers' aux-loss autograd function
                    loss.backward()
            except RuntimeError as e:
                from .parallel.unused_params import explain_ddp_backward_error

                hint = explain_ddp_backward_error(e)
                if hint is not None:
                    raise RuntimeError(f"{e}\n{hint}") from e
                raise
        return local, reduced

    def _loss(self, batch, output) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(loss to backpropagate, this rank's loss to report, [numerator, denominator])``: the last is fp64
        on the loss's device, ``[total, count]`` for SumLoss and ``[mean, 1]`` otherwise (summed over dp ranks
        it gives the global report)."""
        out = self.loss_func(batch, output) if self.loss_func is not None else _output_loss(output)
        is_sum = isinstance(out, SumLoss)
        if self._sum_mode is not None and self._sum_mode != is_sum:
            raise TypeError("loss_func must return SumLoss every time or never (gradients of sums and of means "
                            "cannot be accumulated together).")
        self._sum_mode = is_sum
        if is_sum:
            total = _local(out.total.detach()).float()
            if isinstance(out.count, torch.Tensor):  # kept on its device: no host sync per micro-batch
                count = out.count.detach().to(total.device, torch.float64)
                report = total / count.float().clamp(min=1.0)
            else:
                count = float(out.count)
                report = total / max(count, 1.0)
            self._count = self._count + count
            return out.total, report, torch.stack([total.double(), torch.as_tensor(count, dtype=torch.float64,
                                                                                    device=total.device)])
        if isinstance(out, (tuple, list)):
            out = out[0]
        if not isinstance(out, torch.Tensor) or out.dim() != 0:
            raise TypeError(
                f"loss_func must return a scalar tensor, a tuple whose first item is one, or SumLoss; got {type(out).__name__}"
                + (f" of shape {tuple(out.shape)}" if isinstance(out, torch.Tensor) else "")
            )
        # mean over micro-batches: gradients of one global batch equal the full-batch mean
        report = _local(out.detach()).float()
        return out / self.grad_accum_steps, report, torch.stack([report.double(), torch.ones_like(report.double())])

    def _aux_factor(self, count: float, num_microbatches: int = 1) -> float:
        """The gradient factor of the MoE aux losses: the main loss's own (docstring of the class)."""
        scale = self.loss_scaler.scale if self.loss_scaler is not None else 1.0
        if self._sum_mode:
            return count * scale  # per-token mean x tokens: the global count normalisation makes it a mean
        return scale / (self.grad_accum_steps * num_microbatches)

    def _maybe_no_sync(self, sync: bool):
        if self.grad_accum_steps == 1:
            return contextlib.nullcontext()
        if self.sync_every_microbatch:  # fsdp accumulate_sharded: reduce-scatter each micro-batch, keep shards
            sync = True
        m = self.model
        if isinstance(m, DistributedDataParallel):
            # static_graph + no_sync crashes on the first backward and then silently stops all-reducing
            # (pytorch/pytorch PR 187732, open): all-reduce every micro-batch instead (same result).
            if sync or getattr(m, "static_graph", False):
                return contextlib.nullcontext()
            return m.no_sync()
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def eval_loss(self, batch: Any) -> torch.Tensor:
        """Loss of one micro-batch without backward (evaluation; call under ``torch.no_grad()``): 0-dim
        fp32 tensor, the mean per item for :class:`SumLoss`. Does not touch gradients or counters.
        Pipelined: a forward-only pass of the schedule, the same value on every rank."""
        if self._pipeline is not None:
            with frozen_windows(self._moe):
                return self._pipeline_eval(batch)
        return self.eval_output(batch)[0]

    def eval_output(self, batch: Any, with_loss: bool = True) -> tuple[torch.Tensor | None, Any]:
        """``(loss, output)`` of one micro-batch without backward, from one forward (evaluation with
        predictions; call under ``torch.no_grad()``): the loss as :meth:`eval_loss` gives it (None with
        ``with_loss=False``, e.g. a batch without labels) and the model's output as it returned it (tensors of
        a tensor-parallel model may be DTensors). Does not touch gradients or counters.

        Raises:
            NotImplementedError: a pipelined model (only its last stage holds the output).
        """
        if self._pipeline is not None:
            raise NotImplementedError("eval_output of a pipelined model: only the last stage holds the output; "
                                      "use eval_loss for the loss.")
        batch = self._prepare(batch)
        with contextlib.ExitStack() as stack, frozen_windows(self._moe):
            for make_context in self.step_contexts:
                stack.enter_context(make_context())
            stack.enter_context(_sequence_scope(batch))
            output = call_model(self.model, batch, self.model_input_format)
            if not with_loss:
                return None, output
            out = self.loss_func(batch, output) if self.loss_func is not None else _output_loss(output)
            if isinstance(out, SumLoss):
                total, count = _local(out.total.detach()).float(), float(out.count)
                if hasattr(batch, "sequence"):  # a split sample: its tokens are spread over the cp ranks
                    total, count = _sequence_sum(batch, total, count)
                return total / max(count, 1.0), output
            value = _local((out[0] if isinstance(out, (tuple, list)) else out).detach()).float()
            if hasattr(batch, "sequence"):  # each cp rank's loss is cp x its share of the mean (SequenceSplitter)
                value = _sequence_sum(batch, value, 0.0)[0] / batch.sequence.layout.cp
            return value, output

    # ------------------------------------------------------------------------------------------------ pipeline
    def _pipeline_call(self, batch: Any) -> torch.Tensor:
        """``__call__`` for a pipelined model: the schedule runs forward and backward of every pipeline
        micro-batch (DDP/FSDP stages reduce gradients at the schedule's last backward; reducing a partial
        accumulation early is exact, averaging is linear). Means are scaled by 1 / (num_microbatches x
        grad_accum_steps); the SumLoss count and the reported loss come from the last stage to every rank."""
        sync = (self.micro_step + 1) % self.grad_accum_steps == 0
        batch = self._prepare(batch)
        n_mb = self._pipeline.num_microbatches

        def loss_fn(sub_batch, output):
            before = self._count
            loss, report, _stat = self._loss(sub_batch, output)
            count, self._count = float(self._count - before), before  # counted once for every rank below
            if loss.grad_fn is None:
                raise RuntimeError(
                    "the loss does not depend on any trainable parameter (no grad_fn): loss_func must compute it "
                    "from the model output without .detach()/.item()/torch.tensor(...), and not under no_grad."
                )
            if not self._sum_mode:
                loss = loss / n_mb
            if self.loss_scaler is not None:
                loss = self.loss_scaler.scale_loss(loss)
            num = report * count if self._sum_mode else report
            return loss, num, (count if self._sum_mode else 1.0), count, bool(self._sum_mode)

        self._check_pipeline_sum_aux(self._sum_mode)
        with contextlib.ExitStack() as stack:
            for make_context in self.step_contexts:
                stack.enter_context(make_context())
            stack.enter_context(aux_loss_scale(self._aux_factor(0.0, n_mb)))
            stack.enter_context(_sequence_scope(batch, check=False))
            stats = self._pipeline.run(batch, self.model_input_format, loss_fn, backward=True)
        self._check_pipeline_sum_aux(stats["sum_mode"])
        if stats["sum_mode"] is not None:
            if self._sum_mode is not None and self._sum_mode != stats["sum_mode"]:
                raise TypeError("loss_func must return SumLoss every time or never (gradients of sums and of means "
                                "cannot be accumulated together).")
            self._sum_mode = stats["sum_mode"]
        self._count = self._count + stats["count"]
        self.micro_step += 1
        stat = torch.tensor([stats["num"], stats["den"]], dtype=torch.float64, device=self._pipeline.device)
        self._report_stat = stat
        reduced = self._start_report(stat)  # in flight during the optimizer step
        if sync:
            self.step()
        out = self._reported(stats["report"], reduced).cpu()
        if sync:
            self._notify_step()
        return out

    def _check_pipeline_sum_aux(self, sum_mode: bool | None) -> None:
        """SumLoss + MoE aux losses under pipeline parallelism: the aux factor would need each micro-batch's
        count on every stage, but only the last stage knows it. Decided on every pipeline rank alike (a flag
        max-reduced over the pipeline group once) so no rank is left waiting in a collective."""
        if not sum_mode:
            return
        if getattr(self, "_pipeline_any_aux", None) is None:
            flag = torch.tensor([1.0 if self._moe_aux else 0.0], device=self._pipeline.device)
            group = self._pipeline.pp_group
            if dist.is_initialized() and dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            self._pipeline_any_aux = bool(flag.item())
        if self._pipeline_any_aux:
            raise NotImplementedError(
                "SumLoss with torchloom.moe aux losses under pipeline parallelism: the aux gradient must be weighted "
                "by each micro-batch's item count, which only the last stage knows. Return a mean loss from "
                "loss_func, or set the MoE layers' aux_loss_weight and z_loss_weight to 0.")

    def _pipeline_eval(self, batch: Any) -> torch.Tensor:
        """``eval_loss`` for a pipelined model: a forward-only schedule pass; the mean over the pipeline
        micro-batches (total / count for SumLoss), the same on every rank (and cp rank)."""
        batch = self._prepare(batch)

        def loss_fn(sub_batch, output):
            out = self.loss_func(sub_batch, output) if self.loss_func is not None else _output_loss(output)
            if isinstance(out, SumLoss):
                total = _local(out.total.detach()).float()
                return total, total, float(out.count), float(out.count), True
            value = _local((out[0] if isinstance(out, (tuple, list)) else out).detach()).float()
            return value, value, 1.0, 0.0, False

        with contextlib.ExitStack() as stack:
            for make_context in self.step_contexts:
                stack.enter_context(make_context())
            stack.enter_context(_sequence_scope(batch, check=False))
            stats = self._pipeline.run(batch, self.model_input_format, loss_fn, backward=False)
        if not hasattr(batch, "sequence"):
            return stats["report"]
        num, den = _sequence_sum(batch, torch.tensor(stats["num"]), stats["den"])  # every cp rank's tokens
        return (num / max(den, 1e-30)).float()

    # ------------------------------------------------------------------------------------------------
    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def step(self) -> None:
        """Unscale, normalise (SumLoss), clip, step the optimizer and scheduler, zero the gradients."""
        self._collect_moe_metrics()
        if self._two_pass:
            return self._two_pass_step()
        params = self._params()
        for hook in self.pre_step_hooks:
            hook(params)
        if self._sum_mode:
            self._normalise_by_global_count(params)
        found_inf = self.loss_scaler.unscale_(params) if self.loss_scaler is not None else False
        self.last_step_skipped = found_inf
        if not found_inf:
            if self.max_grad_norm is not None and getattr(self._pipeline, "ties", None) is not None:
                # a weight tied across pipeline stages has one copy per stage: count it once, as unsplit
                from .parallel.pipeline.tied import clip_grad_norm_ as clip_tied

                self.last_grad_norm = clip_tied(params, self.max_grad_norm, self.grad_norm_groups,
                                                self._pipeline.ties.duplicate_ids())
            elif self.max_grad_norm is not None:
                self.last_grad_norm = clip_grad_norm_(params, self.max_grad_norm, extra_groups=self.grad_norm_groups)
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.optimizer_steps += 1
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        self.optimizer.zero_grad(set_to_none=True)

    def _collect_moe_metrics(self) -> None:
        """This window's MoE aux values and expert load (the layers' window sums), then reset them."""
        if not self._moe:
            return
        self.last_moe_metrics = window_metrics(self._moe) or None
        self.last_expert_load = window_load(self._moe)
        for m in self._moe:
            m.reset_window()

    def _normalise_by_global_count(self, params) -> None:
        # on the training device: an NCCL group has no CPU backend; one host sync per optimizer step
        count = torch.as_tensor(self._count, dtype=torch.float64, device=self.device).reshape(1).clone()
        if self.dp_size > 1:
            dist.all_reduce(count, group=self.dp_group)
        self._count = 0.0
        # DDP/FSDP averaged the summed gradients over dp ranks: undo that, then divide by the global count
        factor = self.dp_size / max(count.item(), 1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(factor)

    # ------------------------------------------------------------------------------------------------ two-pass
    # WSAM (torchloom.optim.WSAM) and SAM-like optimizers need the gradient at perturbed weights: the window's
    # micro-batches are kept and replayed at the optimizer step (docs/optim/wsam.md, "train_step").
    def _check_two_pass(self) -> None:
        name = type(self.optimizer).__name__
        if self._pipeline is not None:
            raise NotImplementedError(
                f"{name} (two forward/backward passes per step) is not supported with pipeline parallelism: the "
                "schedule runs forward and backward together, so the window cannot be replayed at perturbed "
                "weights. Use data/tensor parallelism, or a one-pass optimizer.")
        if self.loss_scaler is not None:
            raise NotImplementedError(
                f"{name} is not supported with fp16 loss scaling (an overflow in either pass would have to skip "
                "both); use amp with dtype bfloat16, which needs no loss scaler.")

    def _replicated_ddp(self) -> DistributedDataParallel | None:
        """The DDP model when the first pass can keep each replica's own gradient (``no_sync``; not with
        ``static_graph``, see ``_maybe_no_sync``), else None: the perturbation then uses averaged gradients
        (FSDP's sharded weights are one copy for all ranks, so they cannot be perturbed per replica)."""
        m = self.model
        if isinstance(m, DistributedDataParallel) and not getattr(m, "static_graph", False) and self.dp_size > 1 \
                and "replica_group" in inspect.signature(self.optimizer.first_step).parameters:
            return m
        return None

    def _first_pass_sync(self, sync: bool):
        ddp = self._replicated_ddp()
        return ddp.no_sync() if ddp is not None else self._maybe_no_sync(sync)

    def _two_pass_step(self) -> None:
        """First-pass gradients (accumulated) -> ``first_step`` -> replay the window at ``w + e`` (BatchNorm
        statistics frozen; gradients averaged over dp as usual) -> clip and update. SumLoss normalisation
        applies to both passes; ``max_grad_norm`` clips the gradient the base optimizer steps on."""
        from .optim.wsam import frozen_running_stats

        params, opt = self._params(), self.optimizer
        for hook in self.pre_step_hooks:
            hook(params)
        count = self._count
        if self._sum_mode:  # a global scalar: the perturbation direction does not change
            self._normalise_by_global_count(params)
        ddp = self._replicated_ddp()
        if ddp is not None:
            opt.first_step(zero_grad=True, replica_group=ddp.process_group)
        else:
            opt.first_step(zero_grad=True)
        window, self._window = self._window, []
        with frozen_running_stats(self.model), frozen_windows(self._moe):  # the replay is not a new window
            for i, batch in enumerate(window):
                self._forward_backward(batch, self._maybe_no_sync(i == len(window) - 1))
        for hook in self.pre_step_hooks:
            hook(params)
        if self._sum_mode:
            self._count = count
            self._normalise_by_global_count(params)
        if "max_norm" in inspect.signature(opt.step).parameters:  # torchloom WSAM: clips its final gradient
            opt.step(max_norm=self.max_grad_norm)
            self.last_grad_norm = opt.last_grad_norm
        else:  # a SAM-like optimizer: the second-pass gradient is the one it steps on
            if self.max_grad_norm is not None:
                self.last_grad_norm = clip_grad_norm_(params, self.max_grad_norm, extra_groups=self.grad_norm_groups)
            opt.second_step()
        self.last_step_skipped = False
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer_steps += 1
        opt.zero_grad(set_to_none=True)

    # ------------------------------------------------------------------------------------------------
    def set_grad_accum_steps(self, grad_accum_steps: int) -> None:
        """Micro-batches per optimizer step from now on (a batch-size change; normally through
        :meth:`torchloom.AccelerateResult.set_global_batch_size`, which changes the loader along). ``micro_step``
        is re-based to the windows done so far x the new value, so ``micro_step % grad_accum_steps`` stays the
        position in the window (as :meth:`load_state_dict` does).

        Raises:
            ValueError: not a positive int, or called inside an accumulation window (its gradients were
                accumulated for the old window size): call it right after an optimizer step.
        """
        if isinstance(grad_accum_steps, bool) or not isinstance(grad_accum_steps, int) or grad_accum_steps < 1:
            raise ValueError(f"grad_accum_steps must be a positive int, got {grad_accum_steps!r}")
        if self.micro_step % self.grad_accum_steps:
            raise ValueError(
                f"cannot change the accumulation inside a window: {self.micro_step % self.grad_accum_steps} of its "
                f"{self.grad_accum_steps} micro-batches have run (their gradients are scaled for that window). "
                "Change it right after an optimizer step.")
        self.micro_step = self.micro_step // self.grad_accum_steps * grad_accum_steps
        self.grad_accum_steps = grad_accum_steps

    # ------------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Counters and loss-scaler state (plain data; part of every torchloom checkpoint).

        Checkpoints are meant to be taken at optimizer-step boundaries: gradients accumulated inside a
        window are not saved.
        """
        return {
            "optimizer_steps": self.optimizer_steps,
            "micro_step": self.micro_step,
            "grad_accum_steps": self.grad_accum_steps,
            "loss_scaler": self.loss_scaler.state_dict() if self.loss_scaler is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore counters; the micro-step restarts at the step boundary with *this* run's accumulation
        (which may differ after resuming on another data-parallel size with the global batch held).

        Raises:
            ValueError: the state was saved in the middle of an accumulation window.
        """
        if state["micro_step"] % max(int(state.get("grad_accum_steps", 1)), 1):
            raise ValueError(
                f"the checkpoint was taken after micro-step {state['micro_step']}, inside an accumulation window of "
                f"{state['grad_accum_steps']}; its partial gradients were not saved. Save at optimizer-step boundaries."
            )
        self.optimizer_steps = int(state["optimizer_steps"])
        self.micro_step = self.optimizer_steps * self.grad_accum_steps
        self._window = []
        if self.loss_scaler is not None and state.get("loss_scaler"):
            self.loss_scaler.load_state_dict(state["loss_scaler"])


def _check_loss_report(value: str) -> None:
    if value not in ("global", "local"):
        raise ValueError(f"loss_report={value!r} is not valid; use 'global' (the mean over data-parallel ranks, "
                         "every rank the same) or 'local' (this rank's micro-batch loss, no communication).")


def _is_two_pass(optimizer: Any) -> bool:
    """Whether the optimizer takes two forward/backward passes per step (``first_step``/``second_step``)."""
    return callable(getattr(optimizer, "first_step", None)) and callable(getattr(optimizer, "second_step", None))


def _pipeline_driver(model: nn.Module) -> Any:
    """The schedule driver of a :class:`~torchloom.parallel.pipeline.PipelinedModel`, else None."""
    from .parallel.pipeline.model import PipelinedModel

    if isinstance(model, PipelinedModel):
        if model.pipeline is None:
            raise RuntimeError("the pipelined model has no schedule (auto_accelerate's post-apply hooks did not run)")
        return model.pipeline
    return None
