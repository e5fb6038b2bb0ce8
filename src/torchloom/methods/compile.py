"""`compile`: ``torch.compile`` each repeated block and, with ``components: [.., loss]``, a Hugging Face model's
loss (optional)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cost.effects import Effects
from ..cost.step import FUSING_BACKENDS
from ..errors import StrategyError
from ..parallel.blocks import find_blocks
from ..strategy.registry import Method, Stage, register_method

#: what ``components`` may name (torchtitan's ``compile.components``)
COMPONENTS = ("model", "loss")


@dataclass
class CompileConfig:
    """backend: torch.compile backend ("inductor"; "aot_eager" needs no C++ compiler).
    wrap_cls: block classes to compile (default: the repeated blocks); mode/fullgraph as torch.compile.
    components: what to compile, as torchtitan's ``compile.components``: ``"model"`` (each repeated block)
    and/or ``"loss"`` (a Hugging Face model's ``loss_function``: Inductor fuses the cross-entropy's upcast,
    log-softmax and gradient, so the full-vocabulary fp32 copy and log-softmax of the logits are never made;
    for a 128k vocabulary at 8k tokens ~7.8 GiB less per sample)."""

    backend: str = "inductor"
    mode: str | None = None
    fullgraph: bool = False
    dynamic: bool | None = None
    wrap_cls: list[str] | None = None
    components: list[str] = field(default_factory=lambda: ["model"])


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
    FUSING_BACKENDS = FUSING_BACKENDS

    def estimate(self, info, dims, hw, step):
        """Inductor fuses each chain of non-matmul ops between two matrix products into one kernel: the
        blocks' memory-bound traffic becomes the fused chains' (only tensors entering or leaving a chain move,
        :attr:`~torchloom.cost.model_info.PassCost.fused_bytes`, measured on the traced graph) and one launch
        per chain. Matrix products and attention kernels are unchanged; the embedding and the head stay eager,
        and the loss unless ``components`` names it (then its memory is the fused-loss trace's:
        ``StepShape.fused_loss``). Other backends (``aot_eager``) run the eager kernels.
        The blocks save no chain-internal intermediates (recomputed in backward): the baseline's activations
        already say so (``StepShape.fused_blocks``, :func:`~torchloom.cost.effects.step_activations`), so
        every method's memory rule starts from what the compiled blocks save."""
        if self.config.backend not in self.FUSING_BACKENDS:
            return Effects(self.name, notes=[f"backend {self.config.backend!r} does not fuse: priced as eager"])
        notes = []
        if "loss" in self.config.components and dims.pp > 1:
            notes.append("loss: not compiled under pipeline parallelism (priced eager)")
        elif "loss" in self.config.components and info.rest is not None and not info.rest.peak_extra_fused:
            notes.append("loss: the analysis could not trace the loss as a fused kernel (a custom loss_func): "
                         "its memory is priced eager")
        elif "loss" in self.config.components:
            notes.append("loss: one fused cross-entropy (the logits kept in their dtype, their gradient written "
                         "once; no fp32 copy or log-softmax)")
        return Effects(self.name, fused="model" in self.config.components, notes=notes)

    @classmethod
    def normalise_config(cls, raw):
        comps = raw.get("components") if isinstance(raw, dict) else None
        if comps is not None:
            if not isinstance(comps, (str, list, tuple)):
                raise StrategyError(f"compile: components {comps!r}: a list of {list(COMPONENTS)}.")
            comps = [comps] if isinstance(comps, str) else list(dict.fromkeys(comps))
            bad = [c for c in comps if c not in COMPONENTS]
            if bad or not comps:
                raise StrategyError(f"compile: components {comps!r}: choose one or more of {list(COMPONENTS)} "
                                    "(model: the repeated blocks; loss: the model's loss_function).")
            raw = {**raw, "components": comps}
        return raw

    def validate(self, info, dims) -> None:
        """Compiling the loss needs a model with a Hugging Face ``loss_function`` (under pipeline parallelism
        the loss runs inside the schedule and is left eager, with a note: ``apply``)."""
        if "loss" in self.config.components and dims.pp == 1:
            if info.module is not None and _loss_owner(info.module) is None:
                raise StrategyError(f"compile: components 'loss' compiles a Hugging Face model's loss_function; "
                                    f"{type(info.module).__name__} has none. Compile your loss_func "
                                    "(torch.compile(loss_func)) or drop 'loss'.")

    def apply(self, ctx) -> None:
        c = self.config
        if "model" in c.components:
            blocks = [b for part in ctx.model_parts for b in find_blocks(part, c.wrap_cls)]
            for _, block in blocks:
                block.compile(backend=c.backend, mode=c.mode, fullgraph=c.fullgraph, dynamic=c.dynamic)
            ctx.note(f"compile: {len(blocks)} blocks with backend={c.backend}")
        if "loss" in c.components and ctx.parts is not None:
            ctx.note("compile: the loss is not compiled under pipeline parallelism (the last stage computes it "
                     "inside the schedule); priced eager too")
        elif "loss" in c.components:
            owner = _loss_owner(ctx.model)
            if owner is None:
                raise StrategyError(f"compile: components 'loss' compiles a Hugging Face model's loss_function; "
                                    f"{type(ctx.model).__name__} has none. Compile your loss_func "
                                    "(torch.compile(loss_func)) or drop 'loss'.")
            import torch

            # the instance attribute wins over the class's default (PreTrainedModel.loss_function's setter)
            owner.loss_function = torch.compile(owner.loss_function, backend=c.backend, mode=c.mode,
                                                fullgraph=c.fullgraph, dynamic=c.dynamic)
            fused = " (fused cross-entropy)" if c.backend in self.FUSING_BACKENDS else ""
            ctx.note(f"compile: {type(owner).__name__}.loss_function compiled{fused}: it computes output.loss; a "
                     "loss_func that does not read output.loss is not compiled")


def _loss_owner(model):
    """The module whose ``loss_function`` computes the loss: the first whose class defines it as a settable
    property (a Hugging Face ``PreTrainedModel``) and that has an output head (``get_output_embeddings()``:
    ``LlamaModel``/``BertModel`` have the property but compute no loss), searched from the top (wrappers
    included)."""
    for m in model.modules():
        prop = getattr(type(m), "loss_function", None)
        if not (isinstance(prop, property) and prop.fset is not None):
            continue
        head = getattr(m, "get_output_embeddings", None)
        if callable(head) and head() is not None:
            return m
    return None

