"""`tensor_parallel`, `sequence_parallel`, `loss_parallel`: Megatron-style intra-layer parallelism on DTensor.

The mechanics (styles, per-family plans, application) live in ``torchloom.parallel.tensor``.
"""
from __future__ import annotations

import time
import warnings
from collections import Counter
from dataclasses import dataclass

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel import loss_parallel

from ..cost.effects import (Collective, Effects, activation_bytes, attention_is_eager, blocks_per_rank,
                            analysed_samples, dtype_bytes, hidden_bytes, step_peak)
from ..cost.memo import memo_model_check
from ..errors import StrategyError
from ..parallel.tensor import Flags, auto_plan, check_divisible, custom_plan, parallelize_part, resolve_plan
from ..parallel.tensor.apply import check_fsdp_compatible
from ..parallel.tensor import probe as tp_probe
from ..parallel.tensor.checkpointing import install_model_hook, install_optimizer_hook
from ..parallel.tensor.heads import describe as describe_heads
from ..parallel.tensor.optim import parameter_layouts
from ..parallel.tensor.styles import SEQUENCE_STYLES, check_style_name
from ..strategy.registry import Method, Stage, register_method
from ..utils import did_you_mean


@dataclass
class TensorParallelConfig:
    """size: tensor-parallel degree when ``parallel_mode`` does not set ``tp`` (giving both with different
        values is an error).
    plan: "auto" (the built-in plan of a supported Hugging Face family) or a mapping of module-name patterns
        (``fnmatch`` per dotted component of the unwrapped model's names, e.g.
        ``"model.layers.*.self_attn.q_proj"``) to style names:
        colwise, rowwise, colwise_gather, lm_head, vocab_embedding, embedding_colwise, fused_qkv, moe_experts,
        sequence_parallel, sp_gather_input, sp_gather_input_scatter_output (docs/methods/tensor_parallel.md).
    verify: once at apply, run one representative block of each kind on a small probe input before and after
        sharding and stop with a StrategyError when the outputs differ (``torchloom.parallel.tensor.probe``:
        a module whose own code still assumes full-size head counts). Skipped for a model on the meta device.
        ``False`` skips the probe (the head-count attributes of a user plan are still divided, with a warning).
    """

    size: int | None = None
    plan: str | dict[str, str] = "auto"
    verify: bool = True

    def __post_init__(self):
        if self.size is not None and self.size < 1:
            raise StrategyError(f"tensor_parallel: size must be >= 1, got {self.size}.")
        if isinstance(self.plan, str) and self.plan != "auto":
            raise StrategyError(
                f"tensor_parallel: plan must be 'auto' or a mapping of module patterns to style names, got "
                f"{self.plan!r}."
            )
        if isinstance(self.plan, dict):
            if not self.plan:
                raise StrategyError("tensor_parallel: the plan is empty; give module patterns and styles or 'auto'.")
            for pattern, style in self.plan.items():
                if not isinstance(pattern, str) or not isinstance(style, str):
                    raise StrategyError(
                        f"tensor_parallel: plan entries map a pattern (str) to a style name (str), got "
                        f"{pattern!r}: {style!r}."
                    )
                check_style_name(style, f"pattern '{pattern}'")


@register_method
class TensorParallel(Method):
    """Tensor parallelism (Shoeybi et al., "Megatron-LM", 2019) with DTensor ``parallelize_module``.

    Attention q/k/v and MLP gate/up are split column-wise, o/down row-wise, embeddings and the output head
    over the vocabulary; one all-reduce per attention and per MLP in forward and in backward. Parameters
    become DTensors on the ``tp`` mesh (norms stay plain tensors with identical gradients on every tp rank);
    their full values and checkpoints keep the original layout. Applied before activation checkpointing,
    compile and FSDP (torchtitan order); with ``fsdp`` the parameters are 2-D (dp_shard x tp).
    """

    name = "tensor_parallel"
    Config = TensorParallelConfig
    stage = Stage.TENSOR
    mesh_dims = ("tp",)
    conflicts = {"ddp": "DistributedDataParallel cannot hold tensor-parallel DTensor parameters (it fails at wrap "
                        "time, broadcasting them as plain tensors). Use fsdp for the data-parallel dimension: "
                        "[('parallel_mode', {'dp_shard': N, 'tp': M}), 'tensor_parallel', 'fsdp'] (2-D, as "
                        "torchtitan), or {'dp_replicate': N, 'tp': M} with fsdp to replicate instead of shard."}

    search_configs = ({},)

    def estimate(self, info, dims, hw, step):
        """Megatron tensor parallelism per rank, per micro-batch:

        * matmul FLOPs, parameters, gradients and optimizer state 1/tp (norms replicated, ignored);
        * activations of a block: ``(10 + 24/t + 5as/(ht)) / (34 + 5as/h)`` of the unsharded ones
          (Korthikanti et al. 2022, eqs. 1-2: norm inputs and outputs, dropout masks are replicated; the
          score term only for eager attention), ``1/t`` with sequence parallel; the logits 1/t under
          loss_parallel, else gathered;
        * memory-bound bytes: the same replicated share (``0.3 + 0.7/t``), ``1/t`` with sequence parallel;
        * transients: a block's 1/t like its activations, the loss's logits 1/t under loss_parallel;
        * per block, on the critical path: 2 all-reduces of the hidden state in forward and 2 in backward
          (sequence parallel: as many all-gathers plus reduce-scatters of the same tensor); the forward's are
          issued again by activation checkpointing's recomputation (``Collective.recomputed``); the vocabulary-
          parallel embedding all-reduces its output, the head gathers the logits (not under loss_parallel:
          three small all-reduces of per-token statistics) and all-reduces its input gradient;
        * DTensor: each sharded Linear's forward + backward costs ``_DTENSOR_OPS_PER_LINEAR`` dispatched ops
          more (from_local, sharding propagation, redistribute, to_local around each sharded matmul).
        """
        t = dims.tp
        if t <= 1:
            return None
        sp, lp = "sequence_parallel" in step.methods, "loss_parallel" in step.methods
        h, a = info.dims.get("hidden_size", 0), info.dims.get("num_heads", 0)
        # the attention-score term only where attention materialises its scores (eager); SDPA keeps none
        eager = attention_is_eager(info)
        att = 5.0 * a * step.seq_len / h if h and a and eager else 0.0
        blk = 1.0 / t if sp else (10 + 24 / t + att / t) / (34 + att)
        blocks, rest = activation_bytes(info, step)
        rest_scale = 1.0 / t if lp else 1.0
        e = Effects(self.name, matmul_scale=1.0 / t, other_scale=1.0 / t if sp else 0.3 + 0.7 / t,
                    memory_scale={"params": 1.0 / t, "grads": 1.0 / t, "optimizer": 1.0 / t}, dtensor_params=True)
        if blocks + rest > 0:
            e.memory_scale["activations"] = (blocks * blk + rest * rest_scale) / (blocks + rest)
        # transients: a block's (its widest intermediate is column-sharded) and the loss's (the logits and their
        # fp32 log-softmax: vocabulary-sharded under loss_parallel, gathered whole otherwise)
        samples = analysed_samples(info, step)
        blk_peak = max((step_peak(p, step, samples) for p in info.blocks), default=0.0)
        rest_peak = step_peak(info.rest, step, samples) if info.rest is not None else 0.0
        base_peak = max(blk_peak, rest_peak)
        if base_peak > 0:
            e.memory_scale["temporary"] = max(blk_peak * blk, rest_peak * rest_scale) / base_peak
        # forward gets ops_add per block, backward twice that: a third of the fwd+bwd cost each
        e.ops_add = _DTENSOR_OPS_PER_LINEAR * _linears_per_block(info) / 3
        hb = hidden_bytes(info, step) / dims.cp  # context parallel: the rank's 1/cp of the tokens
        calls = step.grad_accum * blocks_per_rank(info, dims) * 2  # per pass: attention's and the MLP's
        if hb and calls:
            kinds = ("all_gather", "reduce_scatter") if sp else ("all_reduce",)
            for kind in kinds:  # the forward's (repeated by checkpointing's recomputation), then the backward's
                e.collectives += [Collective(kind, hb, "tp", calls=calls, label=f"tp.{kind}", recomputed=True),
                                  Collective(kind, hb, "tp", calls=calls, label=f"tp.{kind}_bwd")]
        if hb:
            m = step.grad_accum
            e.collectives.append(Collective("all_reduce", hb, "tp", calls=2 * m, label="tp.embed_head_all_reduce"))
            tokens = step.micro_batch * step.seq_len
            if lp:
                e.collectives.append(Collective("all_reduce", tokens * 4, "tp", calls=3 * m, label="tp.loss_parallel"))
            elif info.dims.get("vocab_size"):
                logits = tokens * info.dims["vocab_size"] * dtype_bytes(step.compute_dtype)
                e.collectives.append(Collective("all_gather", logits, "tp", calls=m, label="tp.logits_all_gather"))
        return e

    def validate(self, info, dims) -> None:
        """``apply``'s checks on the (meta) model: the plan resolves, its patterns match, every split
        dimension and head count divides by ``tp``; with the whole strategy known
        (:func:`torchloom.search.validate.validate_strategy`) also sequence parallel's plan variant and
        fsdp's dim-0 compatibility. Without ``info.module``: the architecture sizes in ``info.dims``."""
        tp = dims.tp
        if tp <= 1:
            return
        strategy = getattr(self, "planning_strategy", None)
        fsdp = strategy is not None and "fsdp" in strategy
        sp = strategy is not None and "sequence_parallel" in strategy
        model = info.module
        if model is None:
            for key in ("num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
                size = info.dims.get(key)
                if size and size % tp:
                    raise StrategyError(
                        f"tensor_parallel: {info.name} {key} = {size} is not divisible by tp={tp}, so the ranks "
                        f"cannot hold equal whole parts. Use a tp degree that divides it or change the model.")
            return
        def check() -> None:
            plan = auto_plan(model) if self.config.plan == "auto" else custom_plan(model, self.config.plan)
            resolved = resolve_plan(model, plan)
            _raise_unmatched([model], [plan], resolved.matched)
            check_resolved([model], [plan], [resolved], tp, fsdp=fsdp, sequence_parallel=sp)

        memo_model_check(model, ("tensor_parallel", repr(self.config), tp, fsdp, sp), check)

    def configure(self, ctx) -> None:
        mode = ctx.strategy.config("parallel_mode")
        mode_tp = getattr(mode, "tp", None)
        size = self.config.size
        if size is not None and mode_tp is not None and mode_tp != size:
            raise StrategyError(
                f"tensor_parallel: size={size} but parallel_mode sets tp={mode_tp}; give the degree in one place."
            )
        degree = size if size is not None else mode_tp
        if degree is None:
            raise StrategyError(
                "tensor_parallel needs a degree: ('tensor_parallel', {'size': 2}) or ('parallel_mode', {'tp': 2})."
            )
        ctx.dims.tp = degree

    def apply(self, ctx) -> None:
        tp = ctx.mesh.dims.tp
        if tp == 1:
            ctx.note("tensor_parallel: tp=1, nothing to shard")
            return
        flags = Flags(sequence_parallel=ctx.sequence_parallel, loss_parallel=ctx.loss_parallel)
        parts = ctx.model_parts
        plans = [auto_plan(p) if self.config.plan == "auto" else custom_plan(p, self.config.plan) for p in parts]
        resolved = [resolve_plan(p, plan) for p, plan in zip(parts, plans)]
        _check_patterns_matched(ctx, parts, plans, resolved)
        check_resolved(parts, plans, resolved, tp, fsdp="fsdp" in ctx.strategy,
                       sequence_parallel=flags.sequence_parallel)
        mesh = ctx.mesh["tp"]
        probes, skipped = self._record_probes(parts, resolved, mesh)
        counts: Counter = Counter()
        for part, r in zip(parts, resolved):
            counts.update(parallelize_part(part, mesh, r, flags))
            install_model_hook(part)  # DCP: strided (fused q/k/v, packed experts) shards save as their blocks
        # a pipeline stage may hold no planned module (e.g. only a norm and an untied head)
        styles = ", ".join(f"{n} {k}" for k, n in counts.items()) or "no planned modules on this rank's stage(s)"
        ctx.note(f"tensor_parallel: tp={tp}, {plans[0].family} plan over {len(parts)} part(s): {styles}"
                 + (", sequence parallel" if flags.sequence_parallel else "")
                 + (", loss parallel (vocab-sharded logits)" if flags.loss_parallel else ""))
        heads = [h for r in resolved for h in r.head_attrs]
        if heads:
            ctx.note(f"tensor_parallel: divided head-count attributes by tp={tp} (user plan; modules whose "
                     f"projections are column-wise sharded): {describe_heads(heads, tp)}")
        verified = [_blocks(n) for n in self._compare_probes(ctx, parts, resolved, probes, mesh, flags, skipped)]
        # a representative region (blocks.0.attn) verifies the same module in every block
        guessed = [h for h in heads if not any(_blocks(h.module) == v or _blocks(h.module).startswith(v + ".")
                                               for v in verified)]
        if guessed:
            warnings.warn(
                f"tensor_parallel: divided head-count attributes by tp={tp}: {describe_heads(guessed, tp)}, without "
                "verifying the sharded forward (verify is off, the model is on the meta device, or the module "
                "could not be probed). If the module used them for anything but the per-rank head count, or keeps "
                "another full-size count, it computes a different function; run once with verify=True on a "
                "CPU-built model (docs/methods/tensor_parallel.md).", stacklevel=2)

    def _record_probes(self, parts, resolved, mesh):
        """The probe's reference (before sharding), or None and why it is skipped."""
        if not self.config.verify:
            return None, "verify=False"
        if any(t.is_meta for part in parts for t in [*part.parameters(), *part.buffers()]):
            return None, "the model is on the meta device (its weights are not real yet)"
        start = time.perf_counter()
        probes = [tp_probe.record(part, r.targets, mesh) for part, r in zip(parts, resolved)]
        self._probe_seconds = time.perf_counter() - start
        return probes, None

    def _compare_probes(self, ctx, parts, resolved, probes, mesh, flags, skipped):
        """Compare the sharded forward with the probe's reference; returns the regions verified (none when
        the probe was skipped).

        Raises:
            StrategyError: a region's sharded output differs, naming it, its projections and the fix.
        """
        if probes is None:
            ctx.note(f"tensor_parallel: sharded forward not verified ({skipped})")
            return []
        start = time.perf_counter()
        diffs, unverified = {}, {}
        for part, r, probe in zip(parts, resolved, probes):
            d, failures = tp_probe.compare(part, probe, r.targets, mesh, flags.sequence_parallel)
            if failures:
                raise StrategyError(_probe_error(part, r, failures, mesh.size()))
            diffs.update(d)
            unverified.update(probe.unverified)
        seconds = self._probe_seconds + time.perf_counter() - start
        if diffs:
            worst = max(diffs.values())
            ctx.note(f"tensor_parallel: sharded forward verified on a probe input for {', '.join(diffs)} (largest "
                     f"relative difference {worst:.1e}; {seconds:.2f} s)")
        if unverified:
            msg = ("tensor_parallel: sharded forward not verified for "
                   + "; ".join(f"{n} ({why})" for n, why in unverified.items()))
            ctx.note(msg)
            if any(r.plan.family == "custom" for r in resolved):
                warnings.warn(msg + ". Check that these modules work on sharded widths, or write their forward "
                              "so it can be called with the hidden states alone.", stacklevel=3)
        return list(diffs)

    def wrap_optimizer(self, ctx) -> None:
        if ctx.mesh.dims.tp > 1:
            install_optimizer_hook(ctx.optimizer)
        params = [p for g in ctx.optimizer.param_groups for p in g["params"]]
        if ctx.optimizer.defaults.get("foreach") is False and len(parameter_layouts(params)) > 1:
            ctx.note("optimizer: foreach=False (parameters mix DTensors and plain tensors; the foreach kernels "
                     "reject such lists)")


@register_method
class SequenceParallelMethod(Method):
    """Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
    Models", 2022): norms and dropout run on a 1/tp slice of the sequence; the residual stream between
    blocks is a DTensor sharded on the sequence dim; attention/MLP inputs are all-gathered and their row-wise
    outputs reduce-scattered (same communication volume as tensor parallelism alone, 1/tp of the
    activation memory outside attention/MLP). Sets a flag that ``tensor_parallel`` reads."""

    name = "sequence_parallel"
    stage = Stage.TENSOR
    requires = ("tensor_parallel",)

    def configure(self, ctx) -> None:
        ctx.sequence_parallel = True


@register_method
class LossParallel(Method):
    """Cross-entropy on vocabulary-sharded logits without gathering them (DTensor ``loss_parallel``): the
    output head returns a ``Shard(-1)`` DTensor and forward, loss and backward of every micro-batch run
    inside ``loss_parallel()``. Losses from Hugging Face models (``output.loss``) and ``loss_func``s that call
    ``F.cross_entropy`` on the logits work unchanged; other operations on the logits see a DTensor."""

    name = "loss_parallel"
    stage = Stage.TENSOR
    requires = ("tensor_parallel",)

    def configure(self, ctx) -> None:
        ctx.loss_parallel = True

    def apply(self, ctx) -> None:
        if ctx.mesh.dims.tp > 1:
            ctx.step_contexts.append(loss_parallel)
            ctx.note("loss_parallel: cross-entropy on vocab-sharded logits inside loss_parallel()")


#: extra cost of one sharded Linear's forward + backward in units of ``Hardware.op_overhead_s`` (DTensor
#: dispatch: from_local, sharding propagation, redistribute, to_local). Measured on torch 2.13 CPU eager
#: (a colwise + rowwise pair of 8x8 Linears on a 1-rank mesh vs the plain pair, best of 30 x 10 calls:
#: +460 us per Linear, with ``op_overhead_s`` ~4.4 us): ~100 ops. Relative to the op overhead so that it
#: follows the machine's dispatch speed.
_DTENSOR_OPS_PER_LINEAR = 100.0


def _linears_per_block(info) -> float:
    """nn.Linear (and HF Conv1D) modules of one block instance (the ones tensor parallel shards): counted on
    ``info.module`` when there, else the block GEMMs that read or write the hidden size."""
    memo = info.__dict__.get("_tp_linears")
    if memo is not None:
        return memo
    n = 0.0
    if info.module is not None and info.block_classes:
        block = next((m for m in info.module.modules() if type(m).__name__ in info.block_classes), None)
        if block is not None:
            n = float(sum(1 for m in block.modules() if isinstance(m, nn.Linear) or type(m).__name__ == "Conv1D"))
    if not n:
        h = info.dims.get("hidden_size")
        blocks = info.blocks
        n = sum(g.count for g in blocks[0].fwd.matmuls if h in (g.n, g.k)) if blocks and h else 0.0
    info.__dict__["_tp_linears"] = n
    return n


def _blocks(name: str) -> str:
    """A module name with its numeric components as ``*`` (``blocks.0.attn`` -> ``blocks.*.attn``)."""
    return ".".join("*" if a.isdigit() else a for a in name.split("."))


def _probe_error(part, resolved, failures: dict[str, str], tp: int) -> str:
    """The StrategyError text for regions whose sharded forward differs: module, class, sharded projections,
    the head counts torchloom adjusted there, and the fix."""
    modules = dict(part.named_modules())
    lines = []
    for region, why in failures.items():
        inner = [f"{n} ({s})" for n, s in resolved.targets.items()
                 if n.startswith(region + ".") and s in tp_probe.COLUMN_STYLES]
        adjusted = [f"{h.module}.{h.attr} {h.value} -> {h.value // tp}" for h in resolved.head_attrs
                    if h.module == region or h.module.startswith(region + ".")]
        lines.append(f"{region} ({type(modules[region]).__name__}) {why}; its column-wise sharded projections "
                     f"{', '.join(inner)} hold 1/{tp} of their output features per rank"
                     + (f"; torchloom divided {', '.join(adjusted)}" if adjusted else ""))
    return (
        "tensor_parallel: the sharded model does not compute the unsharded model's function: " + "; ".join(lines) + ". Typically the "
        "module's code splits the projections' outputs with a full-size head count of its own (q.reshape(B, T, "
        "n_heads, -1) with the count in a closure, a tuple, a shared config object, or derived from the input "
        "width). torchloom divides int attributes named like a head count (n_heads, num_heads, n_head, "
        "num_attention_heads, num_key_value_heads, n_kv_heads, ...) on the direct parent of column-wise sharded "
        "projections; store the module's head count in such an attribute, or reshape with the per-head width "
        "(view(B, T, -1, head_dim)). If the difference is expected (the module is not deterministic in eval mode), "
        "pass ('tensor_parallel', {'verify': False}) to skip this check."
    )


def _check_patterns_matched(ctx, parts, plans, resolved) -> None:
    """Every plan pattern must match a module on some rank (pipeline stages hold different modules, so
    the matches are gathered over the pp group first).

    Raises:
        StrategyError: naming the patterns and the closest module names.
    """
    matched = set().union(*(r.matched for r in resolved))
    if ctx.mesh.dims.pp > 1:
        everyone: list = [None] * ctx.mesh.dims.pp
        dist.all_gather_object(everyone, sorted(matched), group=ctx.mesh.group("pp"))
        matched = set().union(*map(set, everyone))
    _raise_unmatched(parts, plans, matched)


def check_resolved(parts, plans, resolved, tp: int, *, fsdp: bool, sequence_parallel: bool) -> None:
    """The checks ``apply`` and ``validate`` share on resolved plans: sequence parallel's plan variant, every
    split dimension divisible by ``tp``, and (with fsdp) no dim-0 strided split fsdp would shard again.

    Raises:
        StrategyError: from :func:`check_divisible`, ``check_fsdp_compatible`` or the sequence-plan check.
    """
    if sequence_parallel:
        _check_sequence_plan(plans)
    for part, r in zip(parts, resolved):
        check_divisible(part, r, tp)
        if fsdp:
            check_fsdp_compatible(part, r)


def _raise_unmatched(parts, plans, matched) -> None:
    """Raises StrategyError naming the plan patterns outside ``matched`` and the closest module names."""
    missing = [p for plan in plans for p in plan.styles if p not in matched]
    if missing:
        names = [n for part in parts for n, _ in part.named_modules() if n]
        hint = did_you_mean(missing[0], names)
        raise StrategyError(
            f"tensor_parallel: plan pattern(s) {sorted(set(missing))} match no module of "
            f"{type(parts[0]).__name__}.{hint} Patterns are fnmatch patterns on module names such as "
            f"{names[:3]} ('*' matches one dotted component)."
        )


def _check_sequence_plan(plans) -> None:
    for plan in plans:
        if plan.family != "custom" and not plan.sequence_parallel:
            raise StrategyError(
                f"sequence_parallel: the built-in {plan.family} plan has no sequence-parallel variant (supported: "
                "the Llama-like families). Remove sequence_parallel, or pass a tensor_parallel plan with "
                "'sequence_parallel'/'sp_gather_input' styles."
            )
        if plan.family == "custom" and not SEQUENCE_STYLES & set(plan.styles.values()):
            raise StrategyError(
                "sequence_parallel: the tensor_parallel plan has no sequence-parallel entries; add "
                "'sequence_parallel' for the norms and 'sp_gather_input' for attention/MLP modules."
            )
