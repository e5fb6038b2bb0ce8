"""`checkpoint`: activation checkpointing of the repeated blocks (recompute in backward)."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..parallel.blocks import find_blocks
from ..strategy.registry import Method, Stage, register_method


@dataclass
class CheckpointConfig:
    """wrap_cls: block class names to checkpoint (default: the repeated blocks).
    every_k: checkpoint every k-th block (1 = all; 2 = half of them, trading memory for less recompute).
    preserve_rng_state: replay dropout masks exactly in the recomputation."""

    wrap_cls: list[str] | None = None
    every_k: int = 1
    preserve_rng_state: bool = True


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

    @classmethod
    def normalise_config(cls, raw: Any) -> Any:
        # ATorch passes a tuple of block classes: ("checkpoint", (LlamaDecoderLayer,))
        if isinstance(raw, (tuple, list)):
            return {"wrap_cls": [c if isinstance(c, str) else c.__name__ for c in raw]}
        return raw

    def apply(self, ctx) -> None:
        c = self.config
        if c.every_k < 1:
            from ..errors import StrategyError

            raise StrategyError(f"checkpoint: every_k must be >= 1, got {c.every_k}.")
        blocks = find_blocks(ctx.model, c.wrap_cls)
        chosen = blocks[:: c.every_k]
        for _, block in chosen:
            checkpoint_module(block, preserve_rng_state=c.preserve_rng_state)
        ctx.note(f"checkpoint: {len(chosen)}/{len(blocks)} blocks recompute activations in backward")


def checkpoint_module(module: nn.Module, preserve_rng_state: bool = True) -> None:
    """Make ``module``'s forward run under non-reentrant activation checkpointing (in place)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs)

    module.forward = forward
