"""Checkpoints: sharded, reshardable ``torch.distributed.checkpoint`` saves of a whole training state,
committed atomically and checksummed (a torn or corrupt checkpoint is never loaded: resume, export and
verify pick the same newest usable one), and consolidated ``safetensors`` export. The trainer state is
encoded in one place for both tiers (:mod:`torchloom.checkpoint.trainer_state`).

See ``docs/checkpoint.md``.
"""
from torchloom.checkpoint.api import check, export_from_dcp, export_safetensors, load, load_safetensors, save
from torchloom.checkpoint.commit import CorruptCheckpointError, is_complete, latest_complete, select, verify
from torchloom.checkpoint.flash import FlashCheckpointer
from torchloom.errors import CheckpointError

__all__ = [
    "CheckpointError",
    "CorruptCheckpointError",
    "FlashCheckpointer",
    "check",
    "export_from_dcp",
    "export_safetensors",
    "is_complete",
    "latest_complete",
    "load",
    "load_safetensors",
    "save",
    "select",
    "verify",
]
