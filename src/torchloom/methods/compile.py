"""`compile`: ``torch.compile`` each repeated block (optional)."""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.effects import Effects, activation_bytes, part_activations
from ..parallel.blocks import find_blocks
from ..strategy.registry import Method, Stage, register_method


@dataclass
class CompileConfig:
    """backend: torch.compile backend ("inductor"; "aot_eager" needs no C++ compiler).
    wrap_cls: block classes to compile (default: the repeated blocks); mode/fullgraph as torch.compile."""

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    wrap_cls: list[str] | None = None


@register_method
class Compile(Method):
    """Compiles per block, as torchtitan does: one compiled graph reused by every identical block keeps
    compile time flat in depth, and FSDP's per-block hooks stay outside the graph. ``nn.Module.compile``
    compiles in place, so module names and state-dict keys do not change."""

    name = "compile"
    aliases = {"torch_compile": {}}
    Config = CompileConfig
    stage = Stage.COMPILE

    #: backends that generate fused kernels (the others trace and run the same eager kernels)
    FUSING_BACKENDS = ("inductor",)

    def estimate(self, info, dims, hw, step):
        """Inductor fuses each chain of non-matmul ops between two matrix products into one kernel: the
        blocks' memory-bound traffic becomes the fused chains' (only tensors entering or leaving a chain move,
        :attr:`~torchloom.cost.model_info.PassCost.fused_bytes`, measured on the traced graph) and one launch
        per chain. Matrix products and attention kernels are unchanged; the rest (embedding, head, loss) stays
        eager, as ``apply`` compiles the blocks only. Other backends (``aot_eager``) run the eager kernels."""
        if self.config.backend not in self.FUSING_BACKENDS:
            return Effects(self.name, notes=[f"backend {self.config.backend!r} does not fuse: priced as eager"])
        e = Effects(self.name, fused=True)
        # the blocks save no chain-internal intermediates (recomputed in backward): their activations shrink
        blocks, rest = activation_bytes(info, step)
        fused = _fused_block_activations(info, step)
        if blocks + rest > 0 and fused is not None:
            e.memory_scale["activations"] = (fused + rest) / (blocks + rest)
        return e

    def apply(self, ctx) -> None:
        c = self.config
        blocks = [b for part in ctx.model_parts for b in find_blocks(part, c.wrap_cls)]
        for _, block in blocks:
            block.compile(backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic)
        ctx.note(f"compile: {len(blocks)} blocks with backend={c.backend}")


def _fused_block_activations(info, step) -> float | None:
    """The blocks' activations of one micro-batch under fusion (``PartInfo.act_bytes_fused`` of the step's
    trace, scaled like :func:`~torchloom.cost.effects.activation_bytes`); None when the analysis has none."""
    if not info.blocks or not all(p.act_bytes_fused for p in info.blocks):
        return None
    scale = step.micro_batch * (step.seq_len / info.seq_len if info.seq_len else 1.0)
    key = step.activation_key
    return sum(part_activations(p, key, fused=True) * p.count for p in info.blocks) * scale
