"""`module_replace`: swap modules for faster equivalents (HF attention -> SDPA, HF RMS norms -> fused
``torch.nn.RMSNorm``, plus pairs registered with ``torchloom.register_module_replacement``)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..replace.registry import replace_modules, select_pairs
from ..strategy.registry import Method, Stage, register_method


@dataclass
class ModuleReplaceConfig:
    """pairs: names of the pairs to apply (None: every registered pair; each replaces only what it matches).
    exclude: pair names to skip."""

    pairs: list[str] | None = None
    exclude: list[str] = field(default_factory=list)


@register_method
class ModuleReplace(Method):
    """Replaces matching submodules in place, keeping every Parameter object (weights, tied weights and
    meta tensors stay; state-dict keys do not change). Runs after ``half``'s cast and before pipeline
    splitting and tensor parallelism, so those see the replaced modules. Notes how many modules each
    pair replaced."""

    name = "module_replace"
    Config = ModuleReplaceConfig
    stage = Stage.REPLACE

    def estimate(self, info, dims, hw, step):
        """The analysis of the model (``info``) is taken as is: run it on the replaced model (as ``apply``
        leaves it) for the replacements' costs; nothing is added here."""
        return None

    def configure(self, ctx) -> None:
        select_pairs(self.config.pairs, self.config.exclude)  # unknown names fail before any model change

    def apply(self, ctx) -> None:
        pairs = select_pairs(self.config.pairs, self.config.exclude)
        total: dict[str, list[str]] = {}

        def replace(part):
            part, replaced = replace_modules(part, pairs)
            for name, classes in replaced.items():
                total.setdefault(name, []).extend(classes)
            return part

        ctx.map_parts(replace)
        if not total:
            ctx.note(f"module_replace: nothing matched pairs {[p.name for p in pairs]}")
            return
        parts = []
        for name, classes in total.items():
            kinds = ", ".join(sorted(set(classes)))
            parts.append(f"{name} x{len(classes)} ({kinds})")
        ctx.note("module_replace: " + "; ".join(parts))
