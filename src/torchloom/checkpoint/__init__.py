"""Checkpoints: sharded, reshardable ``torch.distributed.checkpoint`` saves of a whole training state,
committed atomically (a torn checkpoint is never loaded), and consolidated ``safetensors`` export.

See ``docs/checkpoint.md``.
"""
from torchloom.checkpoint.api import check, export_from_dcp, export_safetensors, load, load_safetensors, save
from torchloom.checkpoint.commit import is_complete, latest_complete, verify
from torchloom.checkpoint.flash import FlashCheckpointer
from torchloom.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "FlashCheckpointer",
    "check",
    "export_from_dcp",
    "export_safetensors",
    "is_complete",
    "latest_complete",
    "load",
    "load_safetensors",
    "save",
    "verify",
]
