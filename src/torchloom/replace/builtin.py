"""The pairs torchloom ships (registered on first use of the registry)."""
from torch import nn

from .attention import eager_hf_model, use_sdpa
from .norms import is_hf_rms_norm, to_fused_rms_norm
from .registry import Replacement, _register_builtin

# Hugging Face attention -> PyTorch SDPA: a model-wide switch, so the pair matches the model, not each layer
_register_builtin(Replacement("sdpa", ("PreTrainedModel",), use_sdpa, when=eager_hf_model, builtin=True))
# HF RMS norms are recognised by their forward's code (see norms.py), whatever their class name
_register_builtin(Replacement("rms_norm", (nn.Module,), to_fused_rms_norm, when=is_hf_rms_norm, builtin=True))
