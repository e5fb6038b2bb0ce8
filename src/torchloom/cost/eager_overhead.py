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


__all__ = ["ReferenceDecoder", "STYLES", "counted_ops", "measure", "optimizer_element_seconds",
           "optimizer_tensor_seconds"]
