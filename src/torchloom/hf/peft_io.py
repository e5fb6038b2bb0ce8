"""peft (``PeftModel``) helpers for :mod:`torchloom.hf.save`. peft is imported only when it is already
loaded (a model cannot be a ``PeftModel`` otherwise), so saving plain models never needs it."""
from __future__ import annotations

import copy
import sys
from typing import Any

import torch
from torch import nn


def is_peft_class(cls: type) -> bool:
    """Whether ``cls`` is (a subclass of) ``peft.PeftModel``."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(cls, type) and issubclass(cls, peft.PeftModel)


def is_peft_model(module: Any) -> bool:
    """Whether ``module`` is a ``peft.PeftModel`` (also FSDP2-wrapped in place)."""
    return is_peft_class(type(module))


def rebuild(live: nn.Module, base: nn.Module) -> nn.Module:
    """A ``PeftModel`` of ``live``'s class around the meta ``base`` with copies of all of ``live``'s adapter
    configs (the active one active), on the meta device: the same names as ``live``'s state dict, ready for
    :func:`torchloom.hf.save.fill`. peft's own classes then write the adapter (``save_pretrained``: peft's
    key names via ``get_peft_model_state_dict``) or merge it (``merge_and_unload``)."""
    from torchloom.hf.save import plain_class

    configs = copy.deepcopy(dict(live.peft_config))
    active = live.active_adapter
    if not isinstance(active, str):
        raise NotImplementedError(f"saving a PeftModel with several active adapters ({active}) is not supported; "
                                  f"activate one with set_adapter(name)")
    with torch.device("meta"):
        clone = plain_class(live)(base, configs[active], adapter_name=active)
        for name, cfg in configs.items():
            if name != active:
                clone.add_adapter(name, cfg)
    clone.set_adapter(active)
    return clone
