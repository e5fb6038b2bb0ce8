"""Find the repeated transformer blocks of an unmodified model, and the modules that share parameters."""
from __future__ import annotations

from collections import defaultdict

from torch import nn

from ..errors import StrategyError


def detect_block_classes(model: nn.Module) -> list[str]:
    """Class names of the model's repeated blocks (what FSDP wraps and checkpointing recomputes).

    Uses Hugging Face's ``_no_split_modules`` when the model declares it and those classes occur; otherwise
    the element class of the largest ``nn.ModuleList`` whose items share one class (>= 2 items).
    Returns [] when nothing repeats.
    """
    present = {type(m).__name__ for m in model.modules()}
    hf = [c for c in (getattr(model, "_no_split_modules", None) or []) if c in present]
    if hf:
        return hf
    best, best_params = None, -1
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) >= 2:
            classes = {type(m) for m in mod}
            if len(classes) == 1:
                n = sum(p.numel() for p in mod.parameters())
                if n > best_params:
                    best, best_params = type(mod[0]).__name__, n
    return [best] if best else []


def find_blocks(model: nn.Module, class_names: list[str] | None) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of every module whose class name is in ``class_names`` (outermost only).

    Raises:
        StrategyError: a requested class name does not occur in the model (lists the classes that do).
    """
    names = list(class_names) if class_names is not None else detect_block_classes(model)
    present = {type(m).__name__ for m in model.modules()}
    missing = [c for c in names if c not in present]
    if missing:
        from ..utils import did_you_mean

        raise StrategyError(
            f"block class(es) {missing} do not occur in {type(model).__name__}.{did_you_mean(missing[0], present)} "
            f"Leave the option unset to auto-detect the repeated blocks."
        )
    out: list[tuple[str, nn.Module]] = []
    for qual, mod in model.named_modules():
        if type(mod).__name__ in names and not any(qual.startswith(q + ".") for q, _ in out):
            out.append((qual, mod))
    return out


def shared_parameter_owners(model: nn.Module) -> list[list[str]]:
    """Groups of module names that hold the same parameter object (tied weights), e.g.
    ``[["model.embed_tokens", "lm_head"]]`` for a Llama with ``tie_word_embeddings=True``."""
    owners: dict[int, list[str]] = defaultdict(list)
    for qual, mod in model.named_modules():
        for _, p in mod.named_parameters(recurse=False):
            owners[id(p)].append(qual)
    return [sorted(set(v)) for v in owners.values() if len(set(v)) > 1]
