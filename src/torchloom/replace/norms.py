"""Hugging Face RMS norms -> ``torch.nn.RMSNorm`` (the fused ``F.rms_norm`` kernel), same weight and eps.

A module qualifies when its class's ``forward`` is, statement for statement, Llama's RMSNorm or T5's
LayerNorm (in transformers 5.24 that is ~150 classes: Llama, Mistral, Qwen2/3, Mixtral, Phi3, T5, MT5,
...). Matching the code rather than a list of names keeps look-alikes with other maths out (Gemma's
``1 + weight``, Olmo2's multiply-then-cast, Cohere's mean-centred norm).

Numerics (tests/unit/test_module_replace.py): identical in fp32 (max difference 0 on CPU). With bf16
input and bf16 weight HF rounds twice (normalised value to bf16, then the product) and the fused kernel
once, so about a quarter of the outputs differ by one bf16 ulp (relative <= 2**-7). When input and weight
dtypes differ (bf16 activations, fp32 weight) ``F.rms_norm`` would return the input dtype while HF
promotes; :class:`FusedRMSNorm` then follows HF's rule exactly.
"""
from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import torch
import torch.nn.functional as F
from torch import nn

#: forward of transformers' LlamaRMSNorm (and its copies): normalise in fp32, cast back, then scale
_LLAMA_FORWARD = """
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)
"""
#: forward of transformers' T5LayerNorm (and its copies): cast to the weight's dtype only when it is half
_T5_FORWARD = """
def forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states
"""
_HALF = (torch.float16, torch.bfloat16)


class FusedRMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` holding an existing weight Parameter; ``hf_rule`` ("llama" or "t5") is the output
    dtype rule of the replaced norm, used only when input and weight dtypes differ.

    Args:
        weight: the replaced norm's 1-D weight Parameter (kept as is: same object, device and dtype).
        eps: the replaced norm's ``variance_epsilon``.
        hf_rule: ``"llama"`` (``weight * normed.to(input dtype)``) or ``"t5"`` (``normed`` cast to the
            weight dtype only when that is fp16/bf16).
    Input ``(..., hidden)``, output the same shape.
    """

    def __init__(self, weight: nn.Parameter, eps: float, hf_rule: str = "llama"):
        super().__init__(tuple(weight.shape), eps=eps, elementwise_affine=True, device="meta")
        self.weight = weight
        self.hf_rule = hf_rule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.dtype == w.dtype:
            return F.rms_norm(x, self.normalized_shape, w, self.eps)
        normed = F.rms_norm(x.float(), self.normalized_shape, None, self.eps)
        if self.hf_rule == "llama":
            return w * normed.to(x.dtype)
        return w * (normed.to(w.dtype) if w.dtype in _HALF else normed)


def _canonical(fn_source: str) -> str | None:
    """The function's code without docstring and annotations (so copies with type hints compare equal)."""
    try:
        fn = ast.parse(textwrap.dedent(fn_source)).body[0]
    except (SyntaxError, IndexError):
        return None
    if not isinstance(fn, ast.FunctionDef):
        return None
    fn.returns, fn.decorator_list = None, []
    for a in [*fn.args.args, *fn.args.kwonlyargs]:
        a.annotation = None
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        fn.body = body[1:]
    return ast.unparse(fn)


_RULES = {_canonical(_LLAMA_FORWARD): "llama", _canonical(_T5_FORWARD): "t5"}


@functools.lru_cache(maxsize=None)
def hf_rms_rule(cls: type) -> str | None:
    """``"llama"``/``"t5"`` when ``cls.forward`` is one of the two HF RMS norm forwards, else None."""
    try:
        return _RULES.get(_canonical(inspect.getsource(cls.forward)))
    except (OSError, TypeError):  # no source (C extension, REPL class)
        return None


def is_hf_rms_norm(module: nn.Module) -> bool:
    w = getattr(module, "weight", None)
    return (
        hf_rms_rule(type(module)) is not None and isinstance(w, nn.Parameter) and w.dim() == 1
        and isinstance(getattr(module, "variance_epsilon", None), (int, float)) and not isinstance(module, FusedRMSNorm)
    )


def to_fused_rms_norm(module: nn.Module) -> FusedRMSNorm:
    """The replacement of one HF RMS norm: same weight Parameter, same eps."""
    new = FusedRMSNorm(module.weight, float(module.variance_epsilon), hf_rms_rule(type(module)))
    return new.train(module.training)
