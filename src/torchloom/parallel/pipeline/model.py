"""`PipelinedModel`: what ``auto_accelerate`` returns as ``model`` under pipeline parallelism."""
from __future__ import annotations

from typing import Any

from torch import nn


class PipelinedModel(nn.Module):
    """This rank's pipeline stages as one module tree with the original model's names.

    Its children are those of a pruned copy of the original root that holds every local stage's modules (the
    same module objects the stage modules hold; others are placeholders), so ``named_parameters()``,
    ``state_dict()`` and ``torch.distributed.checkpoint`` see exactly this rank's parameters under their
    original fully qualified names (``model.layers.3.mlp.up_proj.weight``). A checkpoint saved by all ranks
    therefore holds the whole model and loads at another pipeline size (DCP reshards by name).

    Attributes:
        stages: this rank's :class:`~torchloom.parallel.pipeline.split.StageSpec` s.
        parts: the stage modules the methods transformed (DDP/FSDP/compile wrappers included), by stage order.
        pipeline: the :class:`~torchloom.parallel.pipeline.schedule.PipelineDriver` ``train_step`` uses (set
            once every method has run).
        config: the original model's ``config`` (Hugging Face models), or None.
        generation_config: the original model's ``generation_config``, or None.
        root_type: the original model's class (``root_class`` is its name).

    Calling it raises: a pipelined forward needs every rank at once; use ``train_step(batch)`` or
    ``result.forward_loss(batch)``.
    """

    def __init__(self, merged: nn.Module, stages: list, description: str):
        super().__init__()
        for name, child in merged.named_children():
            self.add_module(name, child)
        self.stages = list(stages)
        self.parts: list[nn.Module] = []
        self.pipeline: Any = None
        self.config = getattr(merged, "config", None)
        self.generation_config = getattr(merged, "generation_config", None)
        self.root_class = type(merged).__name__
        self.root_type = type(merged)  # what torchloom.hf.save_pretrained rebuilds the whole model as
        self._description = description

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipelined model cannot be called directly (each rank holds only some layers and the forward needs "
            "every pipeline rank): use result.train_step(batch) for training and result.forward_loss(batch) for "
            "evaluation losses."
        )

    def save_pretrained(self, save_directory, **kwargs: Any):
        """The whole model (every stage) in Hugging Face format: ``torchloom.hf.save_pretrained(self,
        save_directory, **kwargs)``. Collective: call on every rank; rank 0 writes (docs/hf.md)."""
        from torchloom.hf.save import save_pretrained

        return save_pretrained(self, save_directory, **kwargs)

    def train(self, mode: bool = True) -> "PipelinedModel":
        super().train(mode)
        for p in self.parts:  # the stage copies of the containers carry their own `training` flag
            p.train(mode)
        return self

    def extra_repr(self) -> str:
        return f"{self.root_class}, {self._description}"
