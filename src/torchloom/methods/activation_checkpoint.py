"""`checkpoint`: activation checkpointing of the repeated blocks (recompute in backward)."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..cost.memo import memo_model_check
from ..cost.effects import Effects, activation_bytes, analysed_samples, blocks_per_rank, dtype_bytes, step_peak
from ..errors import StrategyError
from ..parallel.blocks import find_blocks
from ..strategy.registry import Method, Stage, register_method


@dataclass
class CheckpointConfig:
    """wrap_cls: block class names to checkpoint (default: the repeated blocks).
    every_k: checkpoint every k-th block (1 = all; 2 = half of them, trading memory for less recompute).
    preserve_rng_state: replay dropout masks exactly in the recomputation.
    mode: ``"full"`` keeps only each checkpointed block's inputs and recomputes its whole forward;
        ``"selective"`` also keeps the outputs of its attention kernels and of every other matrix multiply
        and recomputes the rest (torchtitan's ``op`` policy; ``torchloom.parallel.selective_ac``)."""

    wrap_cls: list[str] | None = None
    every_k: int = 1
    preserve_rng_state: bool = True
    mode: Literal["full", "selective"] = "full"

    def __post_init__(self):
        if self.every_k < 1:
            raise StrategyError(f"checkpoint: every_k must be >= 1 (1 = every block), got {self.every_k}.")
        if self.mode not in ("full", "selective"):
            raise StrategyError(f"checkpoint: mode must be 'full' or 'selective', got {self.mode!r}.")


@register_method
class ActivationCheckpoint(Method):
    """Activation checkpointing (Chen et al., "Training Deep Nets with Sublinear Memory Cost", 2016)
    with the non-reentrant ``torch.utils.checkpoint`` implementation: supports keyword and non-tensor
    arguments, inputs that do not require grad (frozen embeddings) and keeps RNG state for dropout.

    The block's ``forward`` is replaced on the instance, so module names and state-dict keys do not
    change (DCP checkpoints stay loadable with or without it).
    """

    name = "checkpoint"
    aliases = {"activation_checkpoint": {}, "ac": {}}
    key_aliases = {"atorch_wrap_cls": "wrap_cls"}
    Config = CheckpointConfig
    stage = Stage.ACTIVATION_CHECKPOINT

    search_configs = ({"every_k": 1}, {"every_k": 2})

    def estimate(self, info, dims, hw, step):
        """The checkpointed blocks (``blocks[::every_k]`` of the rank's model parts: its pipeline stages)
        keep only their input instead of their activations, and run their forward again in backward; while
        one of them is backpropagated its activations exist again: the transient peak becomes the larger
        of the baseline's (loss/head temporaries) and one recomputed block's activations and transient.
        ``mode="selective"`` also keeps every attention output and every other weight matmul's output, and
        recomputes the other half of the weight matmuls plus all memory-bound ops
        (:func:`_selective_saves`)."""
        nb = blocks_per_rank(info, dims)
        if not nb or (self.config.wrap_cls and not set(self.config.wrap_cls) & set(info.block_classes)):
            return Effects(self.name, notes=["no block of the wrap classes: nothing checkpointed"])
        chosen = math.ceil(nb / self.config.every_k)
        f = chosen / nb
        blocks, rest = activation_bytes(info, step)
        scale = analysed_samples(info, step)
        # the residual stream between blocks: fp32 under plain autocast, low precision under half or fsdp's
        # mixed precision (StepShape.residual_dtype)
        inputs = sum(p.input_bytes * p.count for p in info.blocks) * scale * dtype_bytes(step.residual_dtype) / 4
        kept_block = inputs
        e = Effects(self.name, recompute_fraction=f)
        if self.config.mode == "selective":
            saved, share = _selective_saves(info, step)
            kept_block = min(blocks, inputs + saved * sum(p.count for p in info.blocks) * scale)
            e.recompute_matmul_share = share
        kept = (1 - f) * blocks + f * kept_block
        if blocks + rest > 0:
            e.memory_scale["activations"] = (kept + rest) / (blocks + rest)
            # the transient peak is the larger of the loss/head temporaries (the baseline's) and one block
            # being backpropagated: its recomputed activations plus its own transient
            base = max((step_peak(p, step, scale) for p in info.parts), default=0.0)
            widest = max((step_peak(p, step, scale) for p in info.blocks), default=0.0)
            recomputed = (blocks / max(info.num_blocks, 1) + widest) / max(dims.tp, 1)
            e.memory_add["temporary"] = max(0.0, recomputed - base)
        return e

    @classmethod
    def normalise_config(cls, raw: Any) -> Any:
        # ATorch passes a tuple of block classes: ("checkpoint", (LlamaDecoderLayer,))
        if isinstance(raw, (tuple, list)):
            return {"wrap_cls": [c if isinstance(c, str) else c.__name__ for c in raw]}
        return raw

    def apply(self, ctx) -> None:
        chosen = self.chosen_blocks(ctx.model_parts)
        for _, block in chosen:
            checkpoint_module(block, preserve_rng_state=self.config.preserve_rng_state,
                              selective=self.config.mode == "selective")
        blocks = [b for part in ctx.model_parts for b in find_blocks(part, self.config.wrap_cls)]
        ctx.note(f"checkpoint: {len(chosen)}/{len(blocks)} blocks recompute activations in backward"
                 + (" (selective: attention and every other matmul output kept)" if self.config.mode == "selective"
                    else ""))

    def validate(self, info, dims) -> None:
        """``apply``'s checks on the (meta) model: the wrap classes exist; no dropout in a checkpointed
        block without ``preserve_rng_state`` (the whole model's ``blocks[::every_k]``; under pipelining
        ``apply`` counts per rank, which may pick other blocks of a model whose blocks differ)."""
        if info.module is not None:  # memoised per config: a search checks thousands of candidates on one model
            memo_model_check(info.module, ("checkpoint", repr(self.config)), lambda: self.chosen_blocks([info.module]))

    def chosen_blocks(self, parts) -> list:
        """``(name, block)`` of the blocks to checkpoint: every ``every_k``-th of the parts' blocks together
        (``apply``: the rank's model parts, i.e. its pipeline stages).

        Raises:
            StrategyError: an unknown wrap class, or a chosen block with active dropout while
                ``preserve_rng_state=False``.
        """
        c = self.config
        chosen = [b for part in parts for b in find_blocks(part, c.wrap_cls)][:: c.every_k]
        stochastic = [q for q, b in chosen if has_active_dropout(b)]
        if stochastic and not c.preserve_rng_state:
            raise StrategyError(
                f"checkpoint: preserve_rng_state=False but blocks {stochastic[:3]} contain dropout with p > 0: the "
                "recomputation in backward would draw new dropout masks, so the gradients would belong to a "
                "different forward than the loss (allenai/OLMo-core PR 828). Keep preserve_rng_state=True "
                "(the default) or set the dropout probabilities to 0."
            )
        return chosen


def _selective_saves(info, step) -> tuple[float, float]:
    """``(bytes saved per block instance at micro-batch 1, share of the forward's matmul time recomputed)``
    under selective checkpointing, from the analysed GEMMs: attention GEMMs are those repeated once per head
    (``count`` a multiple of the heads) over the head dimension (``[s, s]`` scores, ``[s, head_dim]`` output); the
    others are weight matmuls, half of whose outputs (``m x n`` each, compute dtype) are kept. Attention
    keeps its output (``m x heads x head_dim``) and its FLOPs are not recomputed."""
    d = info.dims
    heads, hd = d.get("num_heads"), d.get("head_dim")
    blocks = info.blocks
    if not blocks:
        return 0.0, 1.0
    b = dtype_bytes(step.compute_dtype)

    def is_attention(g) -> bool:  # scores q @ k^T: [s, s] over head_dim; then scores @ v: [s, head_dim] over s
        per_head = bool(hd and heads) and g.count % heads == 0
        return per_head and ((g.n == g.m and g.k == hd) or (g.k == g.m and g.n == hd))

    weights = [g for g in blocks[0].fwd.matmuls if not is_attention(g)]
    attn = [g for g in blocks[0].fwd.matmuls if is_attention(g)]
    saved = 0.5 * sum(g.m * g.n * g.count for g in weights) * b
    if attn and heads and hd:
        saved += attn[0].m * heads * hd * b
    total = sum(g.flops for g in blocks[0].fwd.matmuls)
    share = 0.5 * sum(g.flops for g in weights) / total if total else 0.5
    return saved, share


def has_active_dropout(module: nn.Module) -> bool:
    """True if ``module`` contains a dropout layer with ``p > 0`` (its forward draws random numbers)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in module.modules())


#: keyword arguments through which a block writes a key/value cache (Hugging Face spellings)
_CACHE_KWARGS = ("cache", "past_key_value", "past_key_values", "layer_past")


def checkpoint_module(module: nn.Module, preserve_rng_state: bool = True, selective: bool = False) -> None:
    """Make ``module``'s forward run under non-reentrant activation checkpointing (in place).

    Only a forward with gradients enabled is checkpointed; ``torch.no_grad`` evaluation and generation
    run the block as is. The block's keyword arguments are bound before ``checkpoint`` sees them, so a
    block keyword that shares a name with one of ``checkpoint``'s own options (``debug``, ``context_fn``,
    ``determinism_check``, ``use_reentrant``) reaches the block. A cache the block would write
    (``use_cache=True``, ``cache``/``past_key_values``/``layer_past``) is dropped when checkpointing, as
    Hugging Face's own gradient checkpointing does: the recomputation would write it again and read the
    first write back, so forward and recomputation would differ (T5's cross-attention cache). Blocks that
    only read a cache declare ``_can_checkpoint_with_cache = True`` and keep it. ``selective``: keep the
    outputs of attention kernels and every other matmul (``torchloom.parallel.selective_ac``).
    """
    inner = module.forward
    extra = {}
    if selective:
        from ..parallel.selective_ac import selective_context

        extra["context_fn"] = selective_context

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        if not torch.is_grad_enabled():  # nothing to recompute
            return inner(*args, **kwargs)
        if kwargs.get("use_cache"):
            kwargs["use_cache"] = False
        if not getattr(module, "_can_checkpoint_with_cache", False):
            for k in _CACHE_KWARGS:
                if kwargs.get(k) is not None:
                    kwargs[k] = None
        fn = functools.partial(inner, **kwargs) if kwargs else inner
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **extra)

    module.forward = forward
