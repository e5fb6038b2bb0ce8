"""The initialisation calls a plain build makes, in order, so that a meta-device model can replay them.

``torch.manual_seed(s); Model(config)`` draws random numbers in a fixed order:

1. every module's constructor initialises its own parameters, a child before the parent that creates it
   (torch layers call ``reset_parameters()``; Hugging Face's GPT-2 ``Conv1D`` draws ``normal_(std=0.02)``);
2. a Hugging Face ``PreTrainedModel`` ends its constructor with ``post_init()``, whose
   ``initialize_weights()`` applies ``_init_weights`` to every module of its subtree not initialised yet,
   children first (transformers 5.x ``smart_apply``). A nested one (``LlamaModel`` inside
   ``LlamaForCausalLM``) does this before its parent creates the remaining children (``lm_head``).

Replaying the same calls in the same order after ``to_empty`` draws the same numbers, so the materialised
model equals the plain build. A pipeline stage holds only some modules; for a Hugging Face model the absent
ones are rebuilt on the meta device from ``model.config`` (free) so their draws can be replayed and dropped.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

log = logging.getLogger("torchloom")

_CONTAINERS = (nn.ModuleList, nn.Sequential)


@dataclass
class InitCall:
    """One initialisation call of the plain build.

    name: the module's qualified name in the model (``""`` for the root).
    module: the module it initialises: the model's own, or (``present=False``) a meta-device stand-in for a
        module another pipeline stage holds, whose random draws are replayed and dropped.
    run: makes the call (``module.reset_parameters()``, ``owner._init_weights(module)``, ...).
    """

    name: str
    module: nn.Module
    run: Callable[[], None]
    present: bool = True


def plan_init_calls(model: nn.Module) -> tuple[list[InitCall], bool]:
    """The calls that initialise ``model`` as its plain build would, in that build's order.

    Returns ``(calls, whole_model)``; ``whole_model`` is True when the calls also replay the modules this
    pipeline stage lacks (rebuilt from the Hugging Face config), so every stage starts from the same RNG state.
    Modules without a known initialiser get no call (the caller's sentinel check reports their tensors).
    """
    tree, whole = model, False
    if _is_pruned(model):
        skeleton = _meta_skeleton(model) if _is_pretrained(model) else None
        if skeleton is not None and _covers(skeleton, model):
            tree, whole = skeleton, True
        elif skeleton is not None or _has_gaps(model):
            log.warning("meta-device init: %s looks like a pipeline stage whose other modules cannot be rebuilt "
                        "(only a Hugging Face model can be, from its config); it is initialised without the other "
                        "stages' random draws, so its values differ from a single-process build (still distinct per "
                        "shard and reproducible for this layout).", type(model).__name__)
    own = dict(model.named_modules())
    calls: list[InitCall] = []
    constructed: set[int] = set()
    hf_done: set[int] = set()

    def resolve(name: str, stand_in: nn.Module) -> tuple[nn.Module, bool]:
        mod = own.get(name)
        return (mod, True) if mod is not None else (stand_in, False)

    def construct(mod: nn.Module, name: str) -> None:
        if id(mod) in constructed:  # one module object under two names is built once
            return
        constructed.add(id(mod))
        for child_name, child in mod.named_children():
            construct(child, _join(name, child_name))
        target, present = resolve(name, mod)
        fn = construction_init(target)
        if fn is not None:
            calls.append(InitCall(name, target, fn, present))
        if _is_pretrained(mod):
            post_init(mod, name, mod, name)

    def post_init(mod: nn.Module, name: str, owner: nn.Module, owner_name: str) -> None:
        for child_name, child in mod.named_children():
            q = _join(name, child_name)
            post_init(child, q, *((child, q) if _is_pretrained(child) else (owner, owner_name)))
        if id(mod) in hf_done:
            return
        hf_done.add(id(mod))
        target, present = resolve(name, mod)
        init_owner, _ = resolve(owner_name, owner)
        calls.append(InitCall(name, target, _hf_call(init_owner, target), present))

    construct(tree, "")
    return calls, whole


def construction_init(module: nn.Module) -> Callable[[], None] | None:
    """What ``module``'s constructor draws: ``reset_parameters`` (torch layers and most custom modules), the
    known exceptions below, or None."""
    if _is_hf_conv1d(module):  # transformers.pytorch_utils.Conv1D.__init__ has no reset_parameters
        return lambda: nn.init.normal_(module.weight, std=0.02)
    fn = getattr(module, "reset_parameters", None)
    return fn if callable(fn) else None


def _hf_call(owner: nn.Module, module: nn.Module) -> Callable[[], None]:
    def run():
        owner._init_weights(module)
        module._is_hf_initialized = True  # as initialize_weights leaves it
    return run


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _is_pretrained(module: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    return isinstance(module, PreTrainedModel)


def _is_hf_conv1d(module: nn.Module) -> bool:
    cls = type(module)
    return any(c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils" for c in cls.__mro__)


def _is_pruned(model: nn.Module) -> bool:
    """Maybe a pipeline stage module (``parallel/pipeline/stage.py``): other stages' children are ``None``
    or missing from a list."""
    return _has_gaps(model) or any(c is None for m in model.modules() for c in m._modules.values())


def _has_gaps(model: nn.Module) -> bool:
    """A list whose keys skip numbers: entries were removed (a pipeline stage after the first)."""
    return any(isinstance(m, _CONTAINERS) and list(m._modules) != [str(i) for i in range(len(m._modules))]
               for m in model.modules())


def _meta_skeleton(model: nn.Module) -> nn.Module | None:
    """A fresh meta-device build of ``model``'s Hugging Face class and config (no memory, no random draws)."""
    from torch.distributed.fsdp import FSDPModule

    cls = next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))  # fully_shard subclasses it
    try:
        with torch.device("meta"):
            return cls(model.config)
    except Exception as e:  # a model that cannot be rebuilt from its config alone
        log.warning("meta-device init: rebuilding %s from its config failed (%s)", cls.__name__, e)
        return None


def _covers(skeleton: nn.Module, model: nn.Module) -> bool:
    """Every parameter and buffer of ``model`` exists in ``skeleton`` under the same name and global shape."""
    ref = {n: tuple(t.shape) for n, t in [*skeleton.named_parameters(remove_duplicate=False),
                                          *skeleton.named_buffers(remove_duplicate=False)]}
    return all(ref.get(n) == tuple(t.shape) for n, t in [*model.named_parameters(remove_duplicate=False),
                                                         *model.named_buffers(remove_duplicate=False)])
