"""What one strategy method does to a rank's step: the vocabulary of the methods' ``estimate`` hooks.

A method's :meth:`~torchloom.strategy.registry.Method.estimate` returns an :class:`Effects`; the cost model
(:func:`torchloom.cost.model.predict`) starts from the single-device baseline of a
:class:`~torchloom.cost.model_info.ModelInfo` and applies every method's effects **in stage order** by
the same rules, so a user-registered method that implements ``estimate`` composes with the built-ins:

* memory, per category (:data:`MEMORY`): ``value = value * memory_scale[cat] + memory_add[cat]`` (bytes per
  rank); a later method's scale also scales an earlier method's addition (FSDP shards what a user method
  added to ``params``). ``temporary`` additions are transient buffers (FSDP's gathered blocks, DDP buckets).
* compute: ``matmul_scale``, ``other_scale`` and ``ops_scale`` multiply the per-rank matmul FLOPs, the
  memory-bound bytes and the dispatched op count of every pass (tensor parallel divides the matmuls);
  ``ops_add`` adds ops per block instance per forward (backward gets twice as many); ``recompute_fraction``
  (summed, capped at 1) is the fraction of the rank's block forward run again in backward (checkpointing);
  ``time_add`` adds seconds per optimizer step under its own label (offload copies, a user method's extra
  work). ``grads_persistent`` says the gradients stay allocated across steps (DDP buckets). ``fused`` says the
  blocks run compiled: their memory-bound traffic and kernel count are the fused chains'
  (:attr:`~torchloom.cost.model_info.PassCost.fused_bytes`), not the eager per-op ones.
* communication: each :class:`Collective` is priced with ``Hardware.collective_time`` over the group of
  its mesh view; what may overlap with compute is hidden up to the compute of the phase it overlaps.
* pipeline: at most one method returns a :class:`PipelineShape` (which blocks each pipeline rank runs,
  the schedule's bubble and the micro-batches in flight).
* parameter groups (Mixture-of-Experts): the ``params``, ``grads`` and ``optimizer`` categories are tracked
  as a dense share and an ``"expert"`` share (``ModelInfo.experts.params``). ``memory_scale`` scales both,
  except where ``group_memory_scale[group][cat]`` gives the group its own multiplier (expert parallelism:
  experts ``1/ep``). A data-parallel method's scale ``1/d`` (sharding over ``d`` data-parallel ranks) that
  names no expert entry shards the expert share over only ``d / gcd(ep, d)`` ranks: the ``ep`` ranks inside
  its group already hold different experts (:func:`expert_shard_scale`), never ``experts / (ep x dp_shard)``.
  FSDP names its own expert entry (its experts units shard over the whole ``edp``: ``experts / (ep x edp)``);
  DDP leaves ``experts / ep``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

#: bytes per element by dtype name
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}

#: memory categories the cost model tracks per rank (the Prediction adds ``headroom``)
MEMORY = ("params", "grads", "optimizer", "activations", "temporary")
MEMORY_SET = frozenset(MEMORY)

#: what a collective can overlap with: the forward or backward compute of the step, any compute, or nothing
OVERLAPS = ("forward", "backward", "compute", "none")

#: mesh views a collective can run over (``dp`` = dp_replicate x dp_shard, flattened; ``ep`` and ``edp`` =
#: dp / ep carved out of it for experts)
VIEWS = ("dp", "dp_replicate", "dp_shard", "tp", "pp", "ep", "edp", "cp", "dp_shard_cp", "dp_cp")

#: memory categories that parameter groups split (the rest are not per-parameter)
GROUPED = ("params", "grads", "optimizer")


@dataclass
class Collective:
    """One kind of collective a method issues, per rank.

    Attributes:
        kind: one of ``torchloom.cost.hardware.COLLECTIVES`` (``"all_reduce"``, ``"all_gather"``, ...).
        nbytes: bytes per rank per call, as ``Hardware.collective_time`` reads them (the tensor all-reduced,
            the *output* of an all-gather, the *input* of a reduce-scatter, the tensor sent).
        view: the mesh view it runs over (:data:`VIEWS`); its degree is the group size.
        calls: calls per optimizer step.
        overlap: the compute phase it can hide behind (:data:`OVERLAPS`).
        exposed_calls: how many of ``calls`` can never overlap (FSDP's first all-gather of a pass, the last
            reduce-scatter, DDP's last bucket).
        label: the name in the breakdown (``"fsdp.all_gather"``); default ``"<method>.<kind>"``.
        recomputed: issued inside the blocks' forward, so activation checkpointing's recomputation issues it
            again (the cost model adds ``calls x`` the recomputed fraction, in backward): tensor parallel's
            forward all-reduces, sequence parallel's all-gathers and reduce-scatters.
    """

    kind: str
    nbytes: float
    view: str
    calls: float = 1.0
    overlap: str = "none"
    exposed_calls: float = 0.0
    label: str = ""
    recomputed: bool = False

    def __post_init__(self):
        if self.overlap not in OVERLAPS:
            raise ValueError(f"Collective.overlap must be one of {OVERLAPS}, got {self.overlap!r}.")
        if self.view not in VIEWS:
            raise ValueError(f"Collective.view must be one of {VIEWS}, got {self.view!r}.")
        if self.nbytes < 0 or self.calls < 0:
            raise ValueError(f"Collective {self.kind}: nbytes and calls must be >= 0, got {self.nbytes}, {self.calls}.")


@dataclass
class StageLoad:
    """What one pipeline rank holds and runs: ``blocks`` block instances (all its virtual stages together),
    and whether it has the model's first units (embeddings) and last units (final norm, head, loss)."""

    blocks: int
    first: bool = False
    last: bool = False


@dataclass
class PipelineShape:
    """A pipeline schedule as the cost model prices it.

    Attributes:
        schedule: the schedule name (``"1f1b"``, ``"gpipe"``, ``"interleaved_1f1b"``, ``"zero_bubble"``, ``"zbv"``).
        stages: pipeline degree ``p``; ``virtual``: stages per rank ``v``; ``microbatches``: ``m`` per step.
        ranks: the load of each pipeline rank (length ``p``).
        bubble_fwd / bubble_bwd: the bubble in seconds is ``bubble_fwd * t_f + bubble_bwd * t_b`` (clamped at
            0), with ``t_f``/``t_b`` one micro-batch's forward/backward on the slowest rank: 1F1B and GPipe
            ``(p-1)`` and ``(p-1)``, so the bubble fraction is ``(p-1)/(m+p-1)``; interleaved ``(p-1)/v``.
        in_flight: micro-batches whose activations the first rank holds at the peak (1F1B ``min(m, p)``,
            GPipe ``m``).
        boundary_bytes: bytes of one micro-batch's activation sent between stages (per micro-batch 1 sample
            count is already multiplied in).
    """

    schedule: str
    stages: int
    virtual: int
    microbatches: int
    ranks: list[StageLoad]
    bubble_fwd: float
    bubble_bwd: float
    in_flight: float
    boundary_bytes: float = 0.0


@dataclass
class Effects:
    """What one method does per rank per optimizer step (see the module docstring for the composition rules).

    Attributes:
        method: the method's name (labels in the breakdown).
        memory_scale / memory_add: per category of :data:`MEMORY`: multiplier and bytes added per rank.
        matmul_scale / other_scale / ops_scale: multipliers of the per-rank matmul FLOPs, memory-bound bytes
            and op count of every forward/backward pass.
        ops_add: extra dispatched ops per block instance per forward pass (backward: twice as many).
        recompute_fraction: fraction of the rank's block forward recomputed in backward.
        recompute_matmul_share: share of that forward's matmul time actually recomputed (selective
            checkpointing keeps some matmul outputs); the memory-bound and per-op parts are recomputed whole.
        time_add: seconds per optimizer step by label (added to the step time as they are).
        grads_persistent: the gradients stay allocated across steps (counted in the backward peak).
        fused: the repeated blocks run with their non-matmul op chains fused (``torch.compile`` with a fusing
            backend): priced by ``PassCost.fused_bytes`` and ``fused_kernels``.
        dtensor_params: the method turns the parameters into DTensors (FSDP2, tensor parallelism): the
            optimizer's host work per tensor is ``Hardware.optimizer_dtensor_s``.
        grads_unsharded_accum: bytes per rank of the gradients while micro-batches accumulate without a
            reduction (FSDP2 keeps them unsharded): with ``grad_accum > 1`` the grads category is at least this.
        group_memory_scale: ``{group: {category: multiplier}}`` for a parameter group's share of
            :data:`GROUPED` categories, used instead of ``memory_scale`` for that share (``"expert"``).
        collectives: the collectives the method adds.
        pipeline: the pipeline shape (only the pipeline method sets it).
        notes: assumptions the estimate made.
    """

    method: str = ""
    memory_scale: dict[str, float] = field(default_factory=dict)
    memory_add: dict[str, float] = field(default_factory=dict)
    matmul_scale: float = 1.0
    other_scale: float = 1.0
    ops_scale: float = 1.0
    ops_add: float = 0.0
    recompute_fraction: float = 0.0
    recompute_matmul_share: float = 1.0
    time_add: dict[str, float] = field(default_factory=dict)
    grads_persistent: bool = False
    fused: bool = False
    dtensor_params: bool = False
    grads_unsharded_accum: float = 0.0
    group_memory_scale: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    pipeline: PipelineShape | None = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        for d in (self.memory_scale, self.memory_add):
            if d.keys() <= MEMORY_SET:  # the common case, without building a list (thousands per plan)
                continue
            bad = [k for k in d if k not in MEMORY]
            if bad:
                raise ValueError(f"Effects of {self.method or 'a method'}: unknown memory categories {bad}; "
                                 f"use {MEMORY}.")
        for group, d in self.group_memory_scale.items():
            bad = [k for k in d if k not in GROUPED]
            if bad:
                raise ValueError(f"Effects of {self.method or 'a method'}: group {group!r} scales {bad}; a "
                                 f"parameter group splits only {GROUPED}.")


# -- arithmetic the estimate hooks share ----------------------------------------------------------------
def _memo(info, key, fn):
    """``fn()`` memoised on ``info`` (a ModelInfo is not changed after the analysis; the cost model calls
    these per candidate, thousands of times per plan)."""
    memo = info.__dict__.setdefault("_effects_memo", {})
    if key not in memo:
        memo[key] = fn()
    return memo[key]


def attention_is_eager(info) -> bool:
    """Whether the analysed model's attention materialises its scores (a transformers config with
    ``_attn_implementation == "eager"``; SDPA and models without a config keep none)."""
    def eager():
        cfg = getattr(info.module, "config", None)
        return getattr(cfg, "_attn_implementation", "sdpa") == "eager"

    return _memo(info, ("eager",), eager)


def dtype_bytes(name: str) -> int:
    """Bytes per element of a dtype name (4 for an unknown name)."""
    return DTYPE_BYTES.get(name, 4)


def blocks_per_rank(info, dims) -> int:
    """Block instances on the most loaded pipeline rank (all blocks without pipelining)."""
    return math.ceil(info.num_blocks / max(dims.pp, 1)) if info.num_blocks else 0


def embed_params(info) -> int:
    """Parameter elements of the input embedding (``vocab_size x hidden_size`` when both are known, else half
    of the non-block rest: embedding and head)."""
    def embed():
        rest = info.rest
        total = rest.params if rest is not None else 0
        v, h = info.dims.get("vocab_size"), info.dims.get("hidden_size")
        return min(total, v * h) if v and h else total // 2

    return _memo(info, ("embed_params",), embed)


def rank_params(info, dims, *, trainable: bool = False) -> float:
    """Parameter elements one rank holds after tensor and pipeline parallelism (before data-parallel
    sharding): the blocks of the most loaded pipeline rank plus, under pipelining, the larger of the
    embedding (first stage) and the head (last stage; tied weights live on both), all divided by ``tp``
    (norms are replicated over tp ranks: a small overcount of the saving)."""
    attr = "trainable" if trainable else "params"
    nb = max(info.num_blocks, 1)
    block_total, rest_total = _memo(info, ("totals", attr), lambda: (
        sum(getattr(p, attr) * p.count for p in info.blocks),
        getattr(info.rest, attr) if info.rest is not None else 0))
    if dims.pp > 1:
        embed = min(embed_params(info), rest_total)
        head = rest_total - embed if not info.tied else max(rest_total - embed, embed)
        rest_total = max(embed, head)
    return (block_total * blocks_per_rank(info, dims) / nb + rest_total) / max(dims.tp, 1)


def block_params(info) -> float:
    """Mean parameter elements of one block instance."""
    return _memo(info, ("block_params",), lambda: sum(p.params * p.count for p in info.blocks)
                 / max(info.num_blocks, 1))


def hidden_bytes(info, step, dtype: str | None = None) -> float:
    """Bytes of one micro-batch's hidden state (``micro_batch x seq_len x hidden_size``) in ``dtype`` (default
    the compute dtype); 0 when the hidden size is unknown."""
    h = info.dims.get("hidden_size", 0)
    return step.micro_batch * step.seq_len * h * dtype_bytes(dtype or step.compute_dtype)


def analysed_samples(info, step) -> float:
    """One micro-batch in analysed samples: ``micro_batch`` samples of ``step.seq_len`` tokens, the analysis'
    per-sample quantities being at ``info.seq_len`` tokens (activations and transients scale with it)."""
    return step.micro_batch * (step.seq_len / info.seq_len if info.seq_len else 1.0)


def activation_bytes(info, step) -> tuple[float, float]:
    """Baseline activations of one micro-batch: ``(blocks, rest)`` bytes as the step's kernels save them
    (:func:`step_activations`; the analysed sequence length scaled to ``step.seq_len``)."""
    scale = analysed_samples(info, step)
    memo = ("act", step.activation_key, step.fused_blocks, step.fused_loss, step.fp8_saved_inputs)
    blocks, rest = _memo(info, memo, lambda: (sum(step_activations(p, step) * p.count for p in info.blocks),
                                              step_activations(info.rest, step) if info.rest is not None else None))
    return blocks * scale, rest * scale if rest is not None else 0.0


def step_activations(part, step) -> float:
    """Bytes one instance of ``part`` saves for backward at micro-batch 1 as the step runs it: the trace of
    its precision (``StepShape.activation_key``); for a block, without the chain-internal intermediates when
    the blocks run fused (``StepShape.fused_blocks``) and with the weight GEMMs' inputs kept in FP8 when
    ``StepShape.fp8_saved_inputs`` (``PartInfo.fp8_input_saving``); for the rest (embedding, head, loss),
    with its cross-entropy fused when ``StepShape.fused_loss``."""
    block = part.name != "rest"
    act = part_activations(part, step.activation_key, fused=step.fused_blocks if block else step.fused_loss)
    if block and step.fp8_saved_inputs:
        act -= _by_key(part.fp8_input_saving, step.activation_key) or 0.0
    return max(act, 0.0)


def step_peak(part, step, samples: float = 1.0) -> float:
    """Transient bytes above its activations while one instance of ``part`` runs forward and backward on
    ``samples`` analysed samples (the micro-batch in analysed sequences), as the step runs it: the largest of
    the trace's lines in the batch size (``PartInfo.peak_lines``; the fused-loss traces under
    ``StepShape.fused_loss``), else the per-sample transient of the step's precision (``peak_extra``) or the
    fp32 trace's ``peak_extra_bytes`` times ``samples``."""
    key = step.activation_key
    fused = part.name == "rest" and step.fused_loss and part.peak_extra_fused
    lines = _by_key(part.peak_lines_fused if fused else part.peak_lines, key)
    if lines:
        return max(0.0, max(a + samples * b for a, b in lines))
    per = _by_key(part.peak_extra_fused if fused else part.peak_extra, key)
    return (part.peak_extra_bytes if per is None else per) * samples


def split_tokens_temporary_scale(info, step, split: float) -> float:
    """Multiplier of the baseline's transient when each rank holds ``1/split`` of every sample's tokens
    (context parallelism, Ulysses): the per-token share of each part's transient divides, its state-sized share
    (the head's and a tied embedding's weight gradients: ``PartInfo.peak_lines``) does not."""
    samples = analysed_samples(info, step)
    whole = max((step_peak(p, step, samples) for p in info.parts), default=0.0)
    if whole <= 0 or split <= 1:
        return 1.0
    return max(step_peak(p, step, samples / split) for p in info.parts) / whole


def _by_key(table: dict[str, float], key: str) -> float | None:
    """``table[key]``, else the same dtype's other trace; fp16 reads bf16's (the same 2-byte element: the
    analysis traces bf16 only); None when absent."""
    twins = [key, key.split(":")[0]] + ([key.replace("float16", "bfloat16"), "bfloat16"] if "float16" in key
                                        and "bfloat16" not in key else [])
    for k in twins:
        if k in table:
            return table[k]
    return None


def part_activations(part, key: str, fused: bool = False) -> float:
    """Bytes one instance of ``part`` saves for backward at micro-batch 1 under the trace ``key``
    (``StepShape.activation_key``): that trace when analysed, else the compute dtype's, else the fp32 trace
    scaled by the element size. ``fused``: ``act_bytes_fused`` (a compiled block) where known."""
    table = part.act_bytes_fused if fused and part.act_bytes_fused else part.act_bytes
    found = _by_key(table, key)
    if found is not None:
        return found
    dt = key.split(":")[0]
    return table.get("float32", 0.0) * dtype_bytes(dt) / 4


def expert_params(info, dims) -> float:
    """Expert parameter elements one rank holds after pipeline and expert parallelism (before data-parallel
    sharding): the experts of the most loaded pipeline rank's MoE layers, ``1/ep`` of each; 0 for a dense
    model. Tensor parallelism does not split experts (they are sharded over ``ep``)."""
    ex = getattr(info, "experts", None)
    if ex is None:
        return 0.0
    share = blocks_per_rank(info, dims) / max(info.num_blocks, 1) if dims.pp > 1 else 1.0
    return ex.params * share / max(dims.ep, 1)


def dense_params(info, dims, *, trainable: bool = False) -> float:
    """:func:`rank_params` without the experts: the dense elements one rank holds after tensor and pipeline
    parallelism (what a data-parallel method reduces over ``dp``; the experts, :func:`expert_params`, go over
    ``edp``). Equal to :func:`rank_params` for a dense model."""
    ex = getattr(info, "experts", None)
    total = rank_params(info, dims, trainable=trainable)
    if ex is None:
        return total
    share = blocks_per_rank(info, dims) / max(info.num_blocks, 1) if dims.pp > 1 else 1.0
    return max(total - ex.params * share / max(dims.tp, 1), 0.0)


def moe_layers_per_rank(info, dims) -> float:
    """MoE layers on the most loaded pipeline rank (all of them without pipelining)."""
    ex = getattr(info, "experts", None)
    if ex is None:
        return 0.0
    return ex.layers * (blocks_per_rank(info, dims) / max(info.num_blocks, 1) if dims.pp > 1 else 1.0)


def expert_shard_scale(scale: float, dims) -> float:
    """The multiplier of the expert share for a data-parallel sharding ``scale`` = ``1/d`` (over ``d``
    data-parallel ranks): ``gcd(ep, d) / d``. Expert peers are the innermost ``ep`` data-parallel ranks, so a
    group of ``d`` of them holds ``gcd(ep, d)`` expert peers, which own different experts and cannot split
    one shard further: the share is split over the ``d / gcd(ep, d)`` ranks holding the same experts (FSDP
    over ``dp_shard``: ``edp_shard``; ZeRO over ``dp``: ``edp``). A scale that is not ``1/d`` for a divisor
    ``d`` of ``dp`` (offload's 0, no sharding's 1) applies unchanged."""
    ep = max(dims.ep, 1)
    if ep == 1 or not 0.0 < scale < 1.0:
        return scale
    d = round(1.0 / scale)
    if abs(d * scale - 1.0) > 1e-9 or dims.dp % d:
        return scale
    return scale * math.gcd(ep, d)
