"""Hugging Face interop: save in HF format (``save_pretrained``), and more (see ``docs/hf.md``).

Importing this package is light: each name loads its module (and transformers/peft) on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> module defining it (loaded on first access; add new names here)
_LAZY = {
    "save_pretrained": "torchloom.hf.save",
    "TorchloomTrainer": "torchloom.hf.trainer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'torchloom.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = sorted(_LAZY)
