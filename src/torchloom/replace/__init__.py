"""Module replacement: swap modules for faster equivalents that keep the same Parameter objects
(see docs/methods/module_replace.md). Built-in pairs: ``sdpa`` (HF attention -> PyTorch SDPA) and
``rms_norm`` (HF RMS norms -> ``torch.nn.RMSNorm``)."""
from .norms import FusedRMSNorm
from .registry import (Replacement, register_module_replacement, replace_modules, replacement_names, select_pairs,
                       unregister_module_replacement)

__all__ = ["register_module_replacement", "unregister_module_replacement", "replacement_names", "select_pairs",
           "replace_modules", "Replacement", "FusedRMSNorm"]
