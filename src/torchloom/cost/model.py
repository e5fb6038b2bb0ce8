"""The cost model: ``predict(candidate, info, hw) -> Prediction`` by pure arithmetic (no process group, no
allocated model; ~0.1 ms per candidate, so ``loom plan`` can rank thousands).

1. The single-device baseline from :class:`~torchloom.cost.model_info.ModelInfo`: parameters, gradients
   and Adam state (2 x the trainable elements) in the parameter dtype (fp32, or the ``half`` dtype), the
   activations of one micro-batch from ``act_bytes`` of the compute dtype, the largest transient of a part.
2. Every method's :class:`~torchloom.cost.effects.Effects` (its ``estimate`` hook), applied in stage order
   by the rules of :mod:`torchloom.cost.effects`.
3. Time per micro-batch on the slowest rank: each GEMM at the achieved rate for its size
   (``hw.matmul_rate``), the other bytes at ``hw.mem_bw``, each dispatched op at ``hw.op_overhead_s``;
   recomputation; the pipeline bubble; collectives at ``hw.collective_time`` over their group, exposed
   when they cannot overlap (see :func:`_exposed`); the optimizer step as memory-bound traffic.
4. Peak memory per rank: the larger of the backward peak (params, optimizer state, activations in flight,
   transient buffers, the gradients that exist then) and the optimizer-step peak (all gradients plus the
   step's temporaries), plus allocator headroom (:data:`HEADROOM`). See docs/cost_model.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Sequence

from ..parallel.dims import spans_nodes, view_size  # noqa: F401  (spans_nodes re-exported: the node-span rule)
from .step import Prediction, StepShape
from .effects import (DTYPE_BYTES, MEMORY, MEMORY_SET, Collective, Effects, PipelineShape, StageLoad,
                      expert_shard_scale, step_activations, step_peak)
from .hardware import Hardware
from .model_info import ModelInfo, PassCost

if TYPE_CHECKING:
    from ..search.candidate import Candidate
    from ..strategy.registry import Method


#: allocator headroom as a fraction of the allocated peak, by device type. CUDA: the caching allocator
#: reserves whole segments and fragments under changing sizes; the reserved peak (what
#: ``torch.cuda.max_memory_reserved`` and out-of-memory see) runs ~5% above the allocated peak for
#: transformer training with stable shapes (a planning assumption, not fitted to any row). CPU: the
#: host allocator returns memory to the OS, nothing reserved is counted.
HEADROOM = {"cuda": 0.05, "cpu": 0.0}

#: fraction of a collective's overlappable time that compute actually hides, by device type. CUDA: NCCL
#: runs on its own streams (full overlap assumed). CPU/gloo: the collective's thread competes with the
#: compute threads for the same cores, so little is hidden (see docs/cost_model.md).
OVERLAP_EFFICIENCY = {"cuda": 1.0, "cpu": 0.0}

#: Adam's step per updated element: reads param, grad, exp_avg, exp_avg_sq, writes param and both states
#: (in units of the element sizes: 2 x param + 1 x grad + 4 x state).
_ADAM_PARAM_RW, _ADAM_GRAD_R, _ADAM_STATE_RW = 2, 1, 4


def predict(cand: "Candidate", info: ModelInfo, hw: Hardware, methods: Sequence["Method"], *,
            memory_limit: float | None = None) -> Prediction:
    """Predict one optimizer step of ``cand`` for the model ``info`` on ``hw``, per rank (the most loaded).

    Args:
        cand: the plan (dims must be resolved: their product is the world size).
        info: the model analysis (costs at micro-batch 1, ``info.seq_len`` tokens; ``cand.seq_len`` may
            differ: compute and activations scale linearly with the tokens, which ignores attention's
            quadratic term for the difference).
        hw: the machine.
        methods: the candidate's method objects in stage order, with what ``auto_accelerate`` adds
            (:func:`torchloom.search.pricing.method_instances`; ``torchloom.search.pricing.predict`` passes them).
        memory_limit: bytes per rank to compare with (default ``hw.memory_bytes``).

    Returns:
        a :class:`Prediction`: ``time`` parts sum to ``step_time_s``, ``memory`` parts to
        ``peak_memory_bytes``.

    Raises:
        ValueError: hardware without the calibration a term needs.
    """
    c = compose(cand, info, hw, methods)
    step, dims, notes, mem, state, mb = c.step, cand.dims, c.notes, c.memory, c.baseline, c.mb
    mm, other, ops_scale, ops_add, recompute = c.matmul_scale, c.other_scale, c.ops_scale, c.ops_add, c.recompute
    time_add, collectives, pipeline = c.time_add, c.collectives, c.pipeline
    if c.fused and hw.device_type == "cpu":
        notes.append("compile: fused blocks priced with the calibrated stream bandwidth (Inductor's CPU kernels "
                     "may vectorise differently)")
    grads_persistent, unsharded_grads, scale_tokens = c.grads_persistent, c.unsharded_grads, c.scale_tokens

    # -- compute on the slowest rank ----------------------------------------------------------------
    loads = pipeline.ranks if pipeline is not None else [StageLoad(info.num_blocks, True, True)]
    dtype = step.compute_dtype
    cache = _pass_cache(info, hw)
    # one part instance's pass times do not depend on the rank: price each part once, then weight per rank
    parts = []
    for i, part in enumerate(info.parts):
        is_rest = part.name == "rest"
        extra = 0.0 if is_rest else ops_add
        fused = c.fused and not is_rest  # compile fuses the blocks; the rest runs eager
        gemm = dtype if is_rest else step.block_gemm_dtype  # float8 converts the blocks' Linears only
        op_s = hw.host_op_seconds(None if fused else info.eager_code)
        f, f_mm = _pass_time(cache, (i, "f"), part.fwd, mb, dtype, hw, mm, other, ops_scale, extra, fused, False,
                             gemm, op_s)
        b, _ = _pass_time(cache, (i, "b"), part.bwd, mb, dtype, hw, mm, other, ops_scale, 2 * extra, fused, True,
                          gemm, op_s)
        parts.append((is_rest, part.count, f, b, 0.0 if is_rest else f - f_mm * (1.0 - c.recompute_matmul_share)))
    nb = max(info.num_blocks, 1)
    per_rank = []
    for load in loads:
        tf = tb = tr = 0.0
        for is_rest, count, f, b, f_re in parts:
            n = (1.0 if load.last else 0.0) if is_rest else count * load.blocks / nb
            if n == 0:
                continue
            tf, tb = tf + n * f, tb + n * b
            if not is_rest:
                tr += n * recompute * f_re
        per_rank.append((tf + tb + tr, tf, tb, tr))
    _, tf, tb, tr = max(per_rank)
    accum = cand.grad_accum
    time: dict[str, float] = {"forward": accum * tf, "backward": accum * tb}
    if tr:
        time["recompute"] = accum * tr
    if pipeline is not None:
        bubble = max(0.0, pipeline.bubble_fwd * tf + pipeline.bubble_bwd * (tb + tr))
        over = oversubscription(hw)
        if over > 1.0:
            # co-located ranks share cores: while some idle (bubble, lighter stages) the others run faster,
            # up to ``over`` x; the step is at least the average rank's own work (work conservation) and at
            # least the critical path at the uncontended speed
            busy = accum * (tf + tb + tr)
            mean = accum * sum(r[0] for r in per_rank) / len(per_rank)
            wall = max(mean, (busy + bubble) / over)
            if wall < busy:  # even the slowest rank's work shrinks: scale the compute parts, no bubble
                for k in list(time):
                    time[k] *= wall / busy
                bubble = 0.0
            else:
                bubble = wall - busy
            notes.append(f"pipeline_parallel: {len(per_rank)} stages share cores ({over:g}x oversubscribed): "
                         "idle ranks' cores absorb part of the bubble")
        time["bubble"] = bubble
        notes.append(f"pipeline_parallel: {pipeline.schedule} p={pipeline.stages} v={pipeline.virtual} "
                     f"m={pipeline.microbatches}: bubble {bubble / max(sum(time.values()), 1e-30):.1%} of compute")

    # -- communication -------------------------------------------------------------------------------
    eff = OVERLAP_EFFICIENCY.get(hw.device_type, 1.0)
    windows = {"forward": time["forward"] * eff, "backward": (time["backward"] + time.get("recompute", 0.0)) * eff}
    windows["compute"] = windows["forward"] + windows["backward"]
    records, exposed_total = _exposed(collectives, dims, hw, windows)
    for r in records:
        if r["exposed_s"] > 0:
            key = f"comm_exposed:{r['label']}"
            time[key] = time.get(key, 0.0) + r["exposed_s"]

    # -- optimizer step: memory-bound traffic over the rank's updated elements ----------------------------
    time["optimizer"] = _optimizer_time(mem, step, hw, _rank_tensors(info, loads), info, c.dtensor_params)
    if hw.train_step_call_s:  # TrainStep's own work around each call (calibrated; host time); pipelined, one
        # call runs the schedule's micro-batches
        calls = accum if pipeline is None else max(1, accum // max(pipeline.microbatches, 1))
        time["train_step"] = calls * hw.train_step_call_s
    time.update(time_add)

    # -- memory peak -------------------------------------------------------------------------------
    if cand.grad_accum > 1 and unsharded_grads:
        mem["grads"] = max(mem["grads"], unsharded_grads)
    if pipeline is not None:
        notes.append(f"pipeline_parallel: activations of {pipeline.in_flight:g} micro-batches in flight on the "
                     f"first stage")
    memory = _peak(mem, state, grads_persistent or cand.grad_accum > 1, hw)
    peak = sum(memory.values())

    step_time = sum(time.values())
    world = dims.world  # ep is carved out of dp, not a factor
    tokens = cand.global_batch * cand.seq_len
    tps = tokens / step_time if step_time > 0 else 0.0
    peak_flops = hw.peak_flops.get(dtype) or hw.peak_flops.get("float32", 0.0)
    model_flops = info.flops_per_sample() * scale_tokens * cand.global_batch
    # hardware FLOPs: what the kernels compute (flash's recomputed scores, causal diagonal tiles) plus the
    # plan's recomputation (activation checkpointing re-runs that share of every block's forward)
    block_fwd = sum(p.fwd.matmul_flops * p.count for p in info.blocks) * c.recompute_matmul_share * recompute
    hw_flops = (info.hardware_flops_per_sample() + block_fwd) * scale_tokens * cand.global_batch
    per_device = step_time * world * peak_flops
    mfu = model_flops / per_device if per_device > 0 else 0.0
    hfu = hw_flops / per_device if per_device > 0 else 0.0
    return Prediction(
        step_time_s=step_time, time=time, memory=memory, peak_memory_bytes=peak,
        memory_limit_bytes=hw.memory_bytes if memory_limit is None else memory_limit,
        tokens_per_s=tps, tokens_per_s_per_device=tps / world, mfu=mfu, peak_flops=peak_flops,
        collectives=records, notes=notes, hfu=hfu,
        model_flops_per_token=model_flops / tokens if tokens else 0.0,
        hardware_flops_per_token=hw_flops / tokens if tokens else 0.0,
    )



class Composed:
    """The candidate's methods' effects composed over the baseline (what :func:`predict` prices)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


def compose(cand: "Candidate", info: ModelInfo, hw: Hardware, methods: Sequence["Method"]) -> Composed:
    """Every method's :class:`Effects` applied in stage order to the single-device baseline: per-rank memory
    by category (``memory``, before the peak phase is chosen), the compute scales, the recomputed fraction,
    extra seconds, the collectives and the pipeline shape.

    """
    step = StepShape.of(cand, info.param_dtype)
    dims = cand.dims
    notes: list[str] = []
    effects: list[Effects] = []
    data_parallel: list[bool] = []  # per effect: from a data-parallel method (its scales shard over dp ranks)
    for m in methods:
        e = m.estimate(info, dims, hw, step)
        if e is not None:
            e.method = e.method or type(m).name
            effects.append(e)
            data_parallel.append(bool(getattr(type(m), "data_parallel", False)))
            notes.extend(f"{e.method}: {n}" for n in e.notes)
    scale_tokens = cand.seq_len / info.seq_len if info.seq_len else 1.0
    mb = cand.micro_batch * scale_tokens  # micro-batch in units of the analysed sample
    state = _Baseline(info, step, mb)
    mem = state.memory()
    xmem = state.expert_memory()  # the expert share of mem's GROUPED categories

    mm = other = ops_scale = 1.0
    ops_add = recompute = 0.0
    matmul_share = 1.0
    time_add: dict[str, float] = {}
    collectives: list[tuple[str, Collective]] = []
    pipeline: PipelineShape | None = None
    grads_persistent, unsharded_grads, fused, dtensor = False, 0.0, False, False
    for e, dp_method in zip(effects, data_parallel):
        # only the categories the Effects names (x 1.0 + 0.0 leaves the others as they are)
        own = e.group_memory_scale.get("expert", {})
        for cat in (e.memory_scale.keys() | e.memory_add.keys() | own.keys()) & MEMORY_SET:
            scale, add = e.memory_scale.get(cat, 1.0), e.memory_add.get(cat, 0.0)
            x = xmem.get(cat, 0.0)
            if x:  # the expert share scales by its own rule (effects module docstring); additions are dense
                xs = own.get(cat)
                if xs is None:
                    xs = expert_shard_scale(scale, dims) if dp_method else scale
                xmem[cat] = x * xs
                mem[cat] = (mem[cat] - x) * scale + add + xmem[cat]
            else:
                mem[cat] = mem[cat] * scale + add
        mm *= e.matmul_scale
        other *= e.other_scale
        ops_scale *= e.ops_scale
        ops_add += e.ops_add
        recompute = min(1.0, recompute + e.recompute_fraction)
        if e.recompute_fraction:
            matmul_share = min(matmul_share, e.recompute_matmul_share)
        for k, v in e.time_add.items():
            time_add[f"{e.method}.{k}"] = time_add.get(f"{e.method}.{k}", 0.0) + v
        collectives += [(e.method, c) for c in e.collectives]
        grads_persistent |= e.grads_persistent
        fused |= e.fused
        dtensor |= e.dtensor_params
        unsharded_grads = max(unsharded_grads, e.grads_unsharded_accum)
        if e.pipeline is not None:
            pipeline = e.pipeline

    if recompute > 0:  # checkpointing re-runs the forward: its collectives again, during backward
        again = [(m, dataclasses.replace(c, calls=c.calls * recompute, exposed_calls=c.exposed_calls * recompute,
                                         overlap=c.overlap if c.overlap == "none" else "backward",
                                         label=(c.label or f"{m}.{c.kind}") + ".recompute", recomputed=False))
                 for m, c in collectives if c.recomputed]
        collectives += again
    return Composed(step=step, notes=notes, effects=effects, memory=mem, baseline=state, mb=mb,
                    scale_tokens=scale_tokens, matmul_scale=mm, other_scale=other, ops_scale=ops_scale,
                    ops_add=ops_add, recompute=recompute, recompute_matmul_share=matmul_share, time_add=time_add, collectives=collectives,
                    pipeline=pipeline, grads_persistent=grads_persistent, unsharded_grads=unsharded_grads,
                    fused=fused, dtensor_params=dtensor)

# -- baseline ----------------------------------------------------------------------------------------
class _Baseline:
    """The single-device memory of the model at micro-batch ``mb`` (in analysed samples)."""

    def __init__(self, info: ModelInfo, step: StepShape, mb: float):
        self.info, self.step, self.mb = info, step, mb
        self.pbytes = DTYPE_BYTES.get(step.param_dtype, 4)
        native = DTYPE_BYTES.get(info.param_dtype, 4)
        self.param_ratio = self.pbytes / native

    def memory(self) -> dict[str, float]:
        info, pb = self.info, self.pbytes
        params = sum(p.param_bytes * p.count for p in info.parts) * self.param_ratio
        trainable = info.n_trainable
        return {
            "params": params,
            "grads": trainable * pb,
            "optimizer": 2.0 * trainable * pb,  # Adam exp_avg + exp_avg_sq in the parameter dtype
            "activations": self.activations_per_microbatch(),
            "temporary": max((step_peak(p, self.step, self.mb) for p in info.parts), default=0.0),
        }

    def expert_memory(self) -> dict[str, float]:
        """The experts' share of the parameter, gradient and Adam-state bytes (0 for a dense model;
        expert parameters counted trainable unless the model has fewer trainable elements)."""
        ex = self.info.experts
        if ex is None:
            return {}
        pb = self.pbytes
        trainable = min(ex.params, self.info.n_trainable)
        return {"params": ex.params * pb, "grads": trainable * pb, "optimizer": 2.0 * trainable * pb}

    def activations_per_microbatch(self) -> float:
        return sum(step_activations(p, self.step) * p.count for p in self.info.parts) * self.mb


def _peak(mem: dict[str, float], state: _Baseline, grads_live: bool, hw: Hardware) -> dict[str, float]:
    """The larger of the backward peak and the optimizer-step peak, by category, with headroom.

    Backward peak: params + optimizer + activations + temporaries + the gradients that exist at the start of
    backward (all of them when they persist across steps or accumulate, else none yet: autograd frees
    activations as it creates gradients, so only one of the two is at its maximum at a time).
    Step peak: params + optimizer + all gradients + the step's temporaries (foreach Adam: ~one fp32 copy of
    the updated elements).
    """
    backward = {"params": mem["params"], "grads": mem["grads"] if grads_live else 0.0,
                "optimizer": mem["optimizer"], "activations": mem["activations"], "temporary": mem["temporary"]}
    elems = mem["optimizer"] / (2 * state.pbytes) if state.pbytes else 0.0
    opt_step = {"params": mem["params"], "grads": mem["grads"], "optimizer": mem["optimizer"],
                "activations": 0.0, "temporary": elems * 4.0}
    out = dict(max(backward, opt_step, key=lambda d: sum(d.values())))
    out["headroom"] = HEADROOM.get(hw.device_type, 0.0) * sum(out.values())
    return out


# -- compute -----------------------------------------------------------------------------------------
def oversubscription(hw: Hardware) -> float:
    """How many times the node's cores are oversubscribed by its ranks' compute threads (``ranks_per_node x
    threads_per_rank / cores``, at least 1; 1 off CPU, where each rank has its own device). The calibration
    measured every rate with all ranks busy at once, so a rank whose peers idle can run up to this much
    faster."""
    cores = hw.fingerprint.get("cores") if hw.device_type == "cpu" else None
    if not cores:
        return 1.0
    return max(1.0, hw.ranks_per_node * max(hw.threads_per_rank, 1) / cores)


def activation_bandwidth(hw: Hardware) -> float:
    """Bytes/s per rank of the step's memory-bound ops (elementwise, norms, softmax): the calibrated stream
    bandwidth, measured with every co-located rank streaming at once (in chunks spanning scheduler time slices
    when the ranks oversubscribe the cores: ``Timer.min_chunk_s``), so already their share."""
    return hw.mem_bw



def _pass_cache(info: ModelInfo, hw: Hardware) -> dict:
    """Per (model, hardware) memo of pass times (the same part/micro-batch/dtype/scales recur across
    thousands of candidates). Kept on the ModelInfo; invalidated when another Hardware object is used."""
    c = info.__dict__.get("_pass_cache")
    if c is None or c[0] is not hw:
        c = (hw, {})
        info.__dict__["_pass_cache"] = c
    return c[1]


def _pass_time(cache: dict, key, pc: PassCost, mb: float, dtype: str, hw: Hardware, mm: float, other: float,
               ops_scale: float, ops_add: float, fused: bool = False, backward: bool = False,
               gemm_dtype: str | None = None, op_s: float | None = None) -> tuple[float, float]:
    """Seconds of one pass of one part instance at micro-batch ``mb`` (per rank): ``(total, matmul part)``.

    GEMMs at the achieved rate of their size; attention products at the hardware's attention-kernel rate
    where it has one (else as GEMMs); the memory-bound bytes (eager per op, or the fused chains' when
    ``fused``) at the activation bandwidth; per-op dispatch. Where kernels launch asynchronously (CUDA) the
    host's dispatch overlaps the device's work: the pass costs the longer of the two. ``gemm_dtype``: the
    weight GEMMs' dtype when it differs from ``dtype`` (float8's). ``op_s``: host seconds per op (default
    ``hw.op_overhead_s``; :meth:`Hardware.host_op_seconds` gives the eager code's)."""
    gemm_dtype = gemm_dtype or dtype
    op_s = hw.op_overhead_s if op_s is None else op_s
    k = (key, mb, dtype, mm, other, ops_scale, ops_add, fused, gemm_dtype, op_s)
    t = cache.get(k)
    if t is not None:
        return t
    t, listed = 0.0, 0.0
    attn_rate = hw.attention_rate(dtype, backward)
    # the backward's weight GEMMs run other layouts than the forward's (input / weight gradient): their
    # measured slowdown where the library treats the layouts differently (bf16 on CPU)
    layout = hw.backward_gemm_factor.get(gemm_dtype, 1.0) if backward else 1.0
    for g in pc.matmuls:
        one = 2.0 * g.m * mb * g.n * g.k * mm
        if one > 0:
            if g.attention and attn_rate:
                t += g.count * one * g.share / attn_rate
            elif g.attention:
                t += g.count * one * g.share / hw.matmul_rate(dtype, one)
            else:
                t += g.count * one * g.share * layout / hw.matmul_rate(gemm_dtype, one)
        listed += g.flops
    rest = (pc.matmul_flops - listed) * mb * mm  # FLOPs without shapes: the largest listed rate
    if rest > 0:
        size = max((2.0 * g.m * mb * g.n * g.k * mm for g in pc.matmuls), default=rest)
        t += rest / hw.matmul_rate(dtype, size)
    t_mm = t
    if hw.mem_bw > 0:
        t += (pc.fused_bytes if fused else pc.other_bytes) * mb * other / activation_bandwidth(hw)
    ops = pc.fused_kernels if fused else pc.ops
    # the methods' extra ops (DTensor dispatch, FSDP hooks, autocast casts) are counted in bare dispatches
    host = ops * ops_scale * op_s + ops_add * hw.op_overhead_s
    t = max(t, host) if hw.async_launch else t + host
    cache[k] = (t, t_mm)
    return t, t_mm


def _optimizer_time(mem: dict[str, float], step: StepShape, hw: Hardware, tensors: float = 0.0,
                    info: ModelInfo | None = None, dtensor: bool = False) -> float:
    """Adam over the rank's updated elements (optimizer bytes / two states): at the calibrated seconds per element
    of PyTorch's default implementation (``hw.optimizer_element_s``, measured; scaled by the state's bytes
    against fp32) where known, else a fused kernel's traffic at ``hw.mem_bw`` (the GPU tables: production runs
    use fused Adam); plus its host work per parameter tensor (``hw.optimizer_tensor_s`` x ``tensors``:
    dominant for small models on CPU, where PyTorch's AdamW loops over the tensors in Python; with ``dtensor``
    parameters, FSDP2's and TP's, ``hw.optimizer_dtensor_s`` where calibrated: every op is a DTensor dispatch)."""
    sb = DTYPE_BYTES.get(step.param_dtype, 4)
    elems = mem["optimizer"] / (2 * sb)
    per_tensor = hw.optimizer_dtensor_s if dtensor and hw.optimizer_dtensor_s else hw.optimizer_tensor_s
    host = tensors * per_tensor
    if hw.optimizer_element_s and info is not None:
        return _measured_optimizer_seconds(info, elems, hw) * sb / 4 + host
    traffic = elems * (_ADAM_PARAM_RW * sb + _ADAM_GRAD_R * sb + _ADAM_STATE_RW * sb)
    t = traffic / hw.mem_bw if hw.mem_bw > 0 else 0.0
    return t + host


def _measured_optimizer_seconds(info: ModelInfo, elems: float, hw: Hardware) -> float:
    """``elems`` updated elements at the calibrated seconds per element of their tensors' size: each part's
    share of the trainable elements at its mean tensor size, scaled to the rank's shard (FSDP/TP shard every
    tensor; ``elems / n_trainable`` of each)."""
    total = sum(p.trainable * p.count for p in info.parts)
    if total <= 0:
        return 0.0
    shard = elems / total
    t = 0.0
    for p in info.parts:
        if p.trainable <= 0:
            continue
        size = p.trainable / max(p.tensors, 1) * min(shard, 1.0)
        t += elems * (p.trainable * p.count / total) * hw.optimizer_element_rate(size)
    return t


def _rank_tensors(info: ModelInfo, loads) -> float:
    """Trainable parameter tensors the most loaded rank's optimizer steps: every part's (FSDP and TP shard each
    tensor, keeping the count), the blocks in the pipeline stage's share."""
    nb = max(info.num_blocks, 1)
    most = max((ld.blocks for ld in loads), default=nb)
    return sum(p.tensors * (1 if p.name == "rest" else p.count * most / nb) for p in info.parts)


# -- communication -----------------------------------------------------------------------------------
def view_degree(dims, view: str) -> int:
    """Group size of a mesh view (``dp`` = dp_replicate x dp_shard; flattened views multiply their dims)."""
    return view_size(dims, view)


def _collective_cache(hw: Hardware) -> dict:
    """Per-Hardware memo of one collective's seconds and node span by (kind, bytes, view, mesh degrees):
    the same gradient and parameter collectives recur across thousands of candidates."""
    c = hw.__dict__.get("_collective_cache")
    if c is None:
        c = hw.__dict__["_collective_cache"] = {}
    return c


def _exposed(collectives: list[tuple[str, Collective]], dims, hw: Hardware,
             windows: dict[str, float]) -> tuple[list[dict[str, Any]], float]:
    """Price every collective and split it into hidden and exposed seconds.

    Per overlap phase, the overlappable seconds of all its collectives share the phase's compute window
    (``OVERLAP_EFFICIENCY`` x the phase's compute): exposed = max(0, overlappable - window), spread over
    them in proportion, plus the calls that can never overlap. ``"none"`` collectives are fully exposed.
    """
    recs: list[dict[str, Any]] = []
    phases: dict[str, list] = {}  # overlap phase -> (record, never-hidden seconds, hideable seconds)
    memo = _collective_cache(hw)
    dims_key = (dims.pp, dims.dp_replicate, dims.dp_shard, dims.ep, dims.tp, dims.cp)
    for method, c in collectives:
        g = view_degree(dims, c.view)
        if g <= 1 or c.calls <= 0 or c.nbytes <= 0:
            continue
        k = (c.kind, c.nbytes, c.view, dims_key)
        priced = memo.get(k)
        if priced is None:
            across = hw.num_nodes > 1 and spans_nodes(dims, c.view, hw.ranks_per_node)
            priced = memo[k] = (across, hw.collective_time(c.kind, c.nbytes, g, spans_nodes=across))
        across, one = priced
        total = one * c.calls
        fixed = one * min(c.exposed_calls, c.calls) if c.overlap != "none" else total
        rec = {"label": c.label or f"{method}.{c.kind}", "kind": c.kind, "bytes": c.nbytes, "view": c.view,
               "group": g, "calls": c.calls, "spans_nodes": across, "seconds": total, "overlap": c.overlap}
        recs.append(rec)
        if c.overlap == "none":
            rec["exposed_s"] = total
        else:
            phases.setdefault(c.overlap, []).append((rec, fixed, total - fixed))
    used = dict.fromkeys(windows, 0.0)
    for phase in ("forward", "backward", "compute"):
        group = phases.get(phase, ())
        free = sum(f for _, _, f in group)
        window = windows[phase] - (used["forward"] + used["backward"] if phase == "compute" else used[phase])
        hidden = min(free, max(0.0, window))
        used[phase] += hidden
        for rec, fixed, f in group:
            rec["exposed_s"] = fixed + (f - hidden * f / free if free else 0.0)
    return recs, sum(r["exposed_s"] for r in recs)
