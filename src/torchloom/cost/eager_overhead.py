"""What one dispatched op costs the host when it runs inside eager model code, measured on this machine.

The cost model prices a pass's host time as ``ops x seconds per op`` (``torchloom.cost.model._pass_time``),
where ``ops`` is what the analysis counts on its fake-tensor trace. A bare loop of tiny in-place adds
(:func:`torchloom.cost.microbench.op_overhead`) times only the dispatcher: ~3.5 us per op on the build machine.
Inside a model every op also pays the ``nn.Module.__call__`` machinery, autograd recording its node, the
backward engine running that node, and the model's own Python between ops; measured on the same machine, a
plain-module decoder costs ~10.6 us per counted op and Hugging Face's Llama ~24 us (its attention-mask,
rotary and output-capture helpers are Python too). Small models are dominated by that time (the 2-layer
``loom train smoke`` model spent 36 ms per step where the bare rate priced 13 ms).

So the calibration runs two tiny decoders whose compute is negligible (width 16, 8 tokens) forward and
backward, counts their ops with the analysis's own counter (:func:`torchloom.cost.analysis.analyze_model`:
the same unit the cost model multiplies), and keeps seconds per op by code style
(``Hardware.eager_op_overhead_s``): ``"modules"`` for a model written as plain PyTorch modules (the reference
below: RMSNorm, rotary embeddings, SDPA attention, SwiGLU MLP, as torchtitan's Llama writes them), and
``"transformers"`` for a Hugging Face ``PreTrainedModel`` (its tiny ``LlamaForCausalLM``; measured only when
transformers is installed). The analysis records the style of the model it traced
(``ModelInfo.eager_code``).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

#: the reference decoders' sizes: every GEMM is under 1 kFLOP, so their time is the host's
WIDTH, HEADS, FFN, VOCAB, LAYERS, TOKENS = 16, 2, 32, 32, 2, 8
#: code styles :func:`measure` reports (``ModelInfo.eager_code`` names one of them)
STYLES = ("modules", "transformers")


class _RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Attention(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.h = h
        self.q, self.k, self.v, self.o = (nn.Linear(d, d, bias=False) for _ in range(4))

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.h, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, d))


class _MLP(nn.Module):
    def __init__(self, d: int, f: int):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _Block(nn.Module):
    def __init__(self, d: int, h: int, f: int):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = _RMSNorm(d), _Attention(d, h), _RMSNorm(d), _MLP(d, f)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class ReferenceDecoder(nn.Module):
    """A Llama-style decoder written as plain PyTorch modules (the ``"modules"`` reference): embedding,
    ``layers`` blocks of RMSNorm + rotary SDPA attention + SwiGLU MLP, final norm, head, next-token
    cross-entropy. ``forward(input_ids, labels) -> loss`` (a scalar); ``input_ids``/``labels``: ``[B, S]``
    int64."""

    def __init__(self, vocab: int = VOCAB, d: int = WIDTH, heads: int = HEADS, ffn: int = FFN, layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(_Block(d, heads, ffn) for _ in range(layers))
        self.norm, self.head, self.head_dim = _RMSNorm(d), nn.Linear(d, vocab, bias=False), d // heads

    def forward(self, input_ids, labels):
        s, dev = input_ids.shape[1], input_ids.device
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, device=dev).float() / self.head_dim))
        freqs = torch.outer(torch.arange(s, device=dev).float(), inv)
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _hf_reference() -> nn.Module | None:
    """Hugging Face's ``LlamaForCausalLM`` at the reference sizes (SDPA attention), or None without transformers."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        return None
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=HEADS, max_position_embeddings=64)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def measured_styles() -> int:
    """How many code styles :func:`measure` times here (for the calibration's budget split)."""
    import importlib.util

    return 1 + (importlib.util.find_spec("transformers") is not None)


def counted_ops(model: nn.Module, loss: Callable[[Any, Any], torch.Tensor] | None) -> int:
    """Ops of one forward + backward of ``model`` on a ``[1, TOKENS]`` batch, as the analysis counts them
    (the unit ``_pass_time`` multiplies by the seconds per op)."""
    from .analysis import analyze_model

    ids = torch.zeros(1, TOKENS, dtype=torch.long)
    info = analyze_model(model, seq_len=TOKENS, sample_input={"input_ids": ids, "labels": ids},
                         input_format="unpack_dict", loss_func=loss)
    return sum((p.fwd.ops + p.bwd.ops) * p.count for p in info.parts)


def measure(timer, target_s: float) -> dict[str, float]:
    """Seconds of host time per counted op by code style (:data:`STYLES`; ``"transformers"`` only when it is
    installed), every rank of ``timer``'s group measuring at once (``Timer.per_call``: the slowest rank, the
    least disturbed chunk)."""
    out: dict[str, float] = {}
    torch.manual_seed(0)  # the same weights everywhere: the ranks time the same work
    for style, model, loss in (("modules", ReferenceDecoder(), lambda batch, out: out),
                               ("transformers", _hf_reference(), None)):
        if model is None:
            continue
        ops = counted_ops(model, loss)
        model = model.to(timer.device)
        ids = torch.randint(0, VOCAB, (1, TOKENS), device=timer.device)

        def step(model=model, ids=ids, style=style):
            model.zero_grad(set_to_none=True)  # as a step's first micro-batch: backward creates the gradients
            y = model(input_ids=ids, labels=ids)
            (y if style == "modules" else y.loss).backward()

        out[style] = timer.per_call(step, target_s) / ops
    return out


def optimizer_tensor_seconds(timer, target_s: float, tensors: int = 64) -> float:
    """Host seconds per parameter tensor of one optimizer step as LLM training runs it: gradient clipping
    (``clip_grad_norm_``, on by default in torchtitan, Megatron, HF ``Trainer`` and ``loom train``) then
    ``torch.optim.AdamW.step`` with PyTorch's default implementation on ``timer``'s device (a Python loop of
    ~10 ops per tensor on CPU; multi-tensor kernels on CUDA, whose fixed launches are spread over ``tensors``),
    on 16-element tensors so that no memory traffic counts: what the cost model adds per tensor to the
    optimizer step's memory-bound time."""
    torch.manual_seed(0)
    params = [torch.zeros(16, device=timer.device, requires_grad=True) for _ in range(tensors)]
    for p in params:
        p.grad = torch.full_like(p, 1e-3)  # a norm below the clip: the step's values stay the same each call
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return timer.per_call(step, target_s) / tensors


def optimizer_dtensor_seconds(timer, target_s: float, group=None, tensors: int = 32) -> float:
    """Host seconds per parameter tensor of the same step when the parameters are DTensors sharded over
    ``group`` (what FSDP2 and tensor parallelism hand the optimizer): torchloom's global-norm clipping
    (:func:`torchloom.parallel.grad_norm.clip_grad_norm_`: the local norm, one reduction over the mesh) and
    AdamW, every op of which goes through DTensor's dispatch (sharding propagation per op). On the build machine
    (2 gloo ranks) ~8x the plain tensor's cost: a 2-layer model's step measured 9.2 ms under FSDP against
    2.1 ms under DDP, though each rank updates half the elements."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from ..parallel.grad_norm import clip_grad_norm_

    mesh = DeviceMesh.from_group(group or torch.distributed.group.WORLD, timer.device.type)
    n = mesh.size() * 16
    params = []
    for _ in range(tensors):
        p = torch.nn.Parameter(distribute_tensor(torch.zeros(n, device=timer.device), mesh, [Shard(0)]))
        p.grad = distribute_tensor(torch.full((n,), 1e-3, device=timer.device), mesh, [Shard(0)])
        params.append(p)
    opt = torch.optim.AdamW(params, lr=1e-3)

    def step():
        clip_grad_norm_(params, 1.0)
        opt.step()

    return timer.per_call(step, target_s) / tensors


#: tensor sizes (elements) the per-element optimizer cost is measured at: a parameter's step makes several passes
#: over its own param, grad and two moments, so what it costs per element depends on whether that working set
#: (~20 bytes per fp32 element) stays in cache between the passes
OPTIMIZER_SIZES = (1 << 16, 1 << 19, 1 << 22)


def optimizer_element_seconds(timer, target_s: float, per_tensor_s: float = 0.0) -> list[tuple[float, float]]:
    """Seconds per parameter element of the clipped ``AdamW`` step, by tensor size: ``[(elements per tensor,
    seconds per element)]`` at :data:`OPTIMIZER_SIZES` (4 Mi elements in all at each size), every rank at once
    (memory channels shared as in a step), the per-tensor host cost ``per_tensor_s`` taken out (it is priced per
    tensor). Why measured: PyTorch's default implementation (single-tensor on CPU, ``foreach`` on CUDA) makes a
    pass per op (weight decay, two moment updates, square root, division, update, clipping's norm and scale:
    ~23 element accesses against a fused kernel's 7), and a tensor whose working set fits in cache runs those
    passes from cache: on the build machine (1 thread) 3.2 ns per element for the 27.7 M-parameter benchmark
    model's step, 8.7 ns for one 27.7 M-element tensor, while a fused kernel's 28 bytes at the measured
    bandwidth price ~1 ns."""
    total = OPTIMIZER_SIZES[-1] * (4 if timer.device.type == "cuda" else 1)
    out = []
    for size in OPTIMIZER_SIZES:
        size = size * (4 if timer.device.type == "cuda" else 1)
        k = max(1, total // size)
        params = [torch.zeros(size, device=timer.device, requires_grad=True) for _ in range(k)]
        for p in params:
            p.grad = torch.full_like(p, 1e-9)  # below the clip: the same values every call
        opt = torch.optim.AdamW(params, lr=1e-3)

        def step(params=params, opt=opt):
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        t = timer.per_call(step, target_s)
        out.append((float(size), max(t - k * per_tensor_s, 0.0) / (k * size)))
    return out


#: the reference FSDP2 models: this many units (plus the root) of one and of four tiny Linears each, too
#: small for their bytes to matter: what is left after the priced collectives is FSDP2's own work per unit
#: and per parameter tensor of a unit
FSDP_UNITS, FSDP_WIDTH, FSDP_WIDE_LINEARS = 8, 16, 4


def fsdp_unit_seconds(timer, target_s: float, group, gather_s, reduce_s) -> tuple[float, float, float]:
    """FSDP2's own seconds beside its collectives: ``(per unit, per parameter tensor of a unit)`` for the
    forward+backward of a micro-batch whose gradients are not reduced, and the extra per unit when they are
    (``fully_shard`` modules over ``group``, every rank at once). Measured on two models of
    :data:`FSDP_UNITS` units, units of one and of :data:`FSDP_WIDE_LINEARS` ``Linear(16, 16)`` (2 and 8
    parameter tensors); the plain models' time and the collectives' calibrated times subtracted
    (``gather_s(nbytes)`` / ``reduce_s(nbytes)``: this calibration's all-gather / reduce-scatter fits; two
    gathers per unit per micro-batch under ZeRO-3, one reduce-scatter when reducing). What it holds: the
    pre/post-forward and backward hooks, the copy-in / copy-out of the flat buffers (per tensor), the DTensor
    views, the gradient's division and the waits. On the build machine (2 gloo ranks) ~1.5 ms per unit plus
    ~0.2 ms per tensor per micro-batch, against the 12 bare dispatches (~40 us) the cost model assumed: a
    2-layer model's FSDP step ran 2x its prediction. ``(0, 0, 0)`` on one rank."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    group = group or dist.group.WORLD
    if dist.get_world_size(group) < 2:
        return 0.0, 0.0, 0.0
    torch.manual_seed(0)
    mesh = DeviceMesh.from_group(group, timer.device.type)
    x = torch.randn(4, FSDP_WIDTH, device=timer.device)
    units = FSDP_UNITS + 1  # the root holds nothing of its own but runs its hooks

    def model(linears):
        return nn.Sequential(*[nn.Sequential(*[nn.Linear(FSDP_WIDTH, FSDP_WIDTH) for _ in range(linears)])
                               for _ in range(FSDP_UNITS)]).to(timer.device)

    def run(m, sync=None):
        def step():
            if sync is not None:
                m.set_requires_gradient_sync(sync)
            m(x).sum().backward()
        return step

    per_call = {}
    for linears in (1, FSDP_WIDE_LINEARS):
        plain, sharded = model(linears), model(linears)
        for unit in sharded:
            fully_shard(unit, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        nbytes = linears * (FSDP_WIDTH + 1) * FSDP_WIDTH * 4
        t_plain = timer.per_call(run(plain), target_s / 6)
        t_local = timer.per_call(run(sharded, False), target_s / 6)
        t_sync = timer.per_call(run(sharded, True), target_s / 6)
        per_call[linears] = ((t_local - t_plain) / units - 2 * gather_s(nbytes) * FSDP_UNITS / units,
                             (t_sync - t_local) / units - reduce_s(nbytes) * FSDP_UNITS / units)
    tensors = 2 * (FSDP_WIDE_LINEARS - 1)  # parameter tensors the wide unit has more
    per_tensor = max(0.0, (per_call[FSDP_WIDE_LINEARS][0] - per_call[1][0]) / tensors)
    per_unit = max(0.0, per_call[1][0] - 2 * per_tensor)
    per_reduce = max(0.0, per_call[1][1])
    return per_unit, per_tensor, per_reduce


def train_step_seconds(timer, target_s: float, group=None, accum: int = 2) -> float:
    """torchloom's :class:`~torchloom.train_step.TrainStep` own seconds per micro-batch call: a TrainStep
    over a one-Linear model (``accum`` calls per optimizer step, the loss reported over ``group`` as data-parallel
    ranks do, global-norm clipping) against the same forward, backward, clipping and AdamW step run bare. What
    it holds: input preparation, the loss bookkeeping and its asynchronous dp all-reduce and wait, the
    accumulation scaling, zeroing and the step's own calls. On the build machine (2 gloo ranks) ~1.5 ms per call:
    a 2-layer model's 31 ms step spent ~5 ms outside the priced forward, backward and optimizer."""
    import torch.distributed as dist

    from ..parallel.grad_norm import clip_grad_norm_
    from ..train_step import TrainStep

    group = group or dist.group.WORLD
    torch.manual_seed(0)
    x = torch.randn(4, 16, device=timer.device)
    loss = lambda batch, out: out.square().mean()  # noqa: E731

    def make():
        m = nn.Linear(16, 16).to(timer.device)
        return m, torch.optim.AdamW(m.parameters(), lr=1e-6)

    m_bare, opt_bare = make()

    def bare():
        for _ in range(accum):
            (loss(x, m_bare(x)) / accum).backward()
        clip_grad_norm_(list(m_bare.parameters()), 1.0)
        opt_bare.step()
        opt_bare.zero_grad(set_to_none=True)

    m, opt = make()
    step = TrainStep(model=m, optimizer=opt, loss_func=loss, device=timer.device, grad_accum_steps=accum,
                     max_grad_norm=1.0, dp_group=group, dp_size=dist.get_world_size(group))

    def wrapped():
        for _ in range(accum):
            step(x)

    t_bare = timer.per_call(bare, target_s / 2)
    t_step = timer.per_call(wrapped, target_s / 2)
    return max(0.0, t_step - t_bare) / accum


__all__ = ["FSDP_UNITS", "FSDP_WIDE_LINEARS", "FSDP_WIDTH", "ReferenceDecoder", "STYLES", "counted_ops", "fsdp_unit_seconds", "measure",
           "measured_styles", "optimizer_dtensor_seconds", "optimizer_element_seconds", "optimizer_tensor_seconds",
           "train_step_seconds"]
