"""``atorch.optimizers``: ATorch's ``AGD`` and ``WeightedSAM`` on torchloom's native optimizers.

``from torchloom.compat.atorch.optimizers import AGD, WeightedSAM`` (or ``...optimizers.agd.AGD``,
``...optimizers.wsam.WeightedSAM``) replaces the ``atorch.optimizers`` import. ATorch's other optimizers
(``AdamL``, ``BF16Optimizer``, the low-bit ``Q_*`` optimizers, ``adam_offload``) are not provided: importing
them raises ImportError saying what to use instead.
"""
from .agd import AGD
from .wsam import WeightedSAM

__all__ = ["AGD", "WeightedSAM"]

_NOT_PROVIDED = {
    "AdamL": "use torch.optim.AdamW, or torchloom.compat.atorch.optimizers.AGD",
    "BF16Optimizer": "use the 'amp' strategy with bfloat16 (fp32 weights and optimizer state, bf16 compute)",
    "low_bit": "use torch.optim.AdamW or AGD (low-bit optimizer states are not implemented)",
    "adam_offload": "use torch.optim.AdamW; CPU offload of optimizer state is not implemented",
}


def __getattr__(name: str):
    if name in _NOT_PROVIDED:
        raise ImportError(f"atorch.optimizers.{name} is not provided by torchloom.compat.atorch: "
                          f"{_NOT_PROVIDED[name]}.")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
