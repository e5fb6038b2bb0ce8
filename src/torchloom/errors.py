"""Exceptions raised by torchloom. Every message names the problem and the fix."""


class TorchloomError(Exception):
    """Base class of every error torchloom raises on purpose."""


class StrategyError(TorchloomError, ValueError):
    """A strategy is malformed: unknown method or key, bad value, conflicting methods, or a mesh that
    does not fit the world size."""


class CheckpointError(TorchloomError, RuntimeError):
    """A checkpoint is missing, incomplete (torn) or unreadable."""


class LossScaleError(TorchloomError, FloatingPointError):
    """The dynamic fp16 loss scale fell to its floor: the gradients overflow at every scale."""


class GradientSyncError(TorchloomError, RuntimeError):
    """Data-parallel gradients of a step were not all synchronised (e.g. DDP parameters that got no
    gradient); raised before the optimizer steps on them, naming the parameters and the fix."""


class ReplicaDivergenceError(TorchloomError, RuntimeError):
    """Data-parallel replicas that must hold identical parameters differ; names the first parameter and
    the ranks."""


class HardwareError(TorchloomError, ValueError):
    """A hardware description cannot be used: an unknown accelerator, a cluster whose GPUs do not divide
    into its nodes, a missing or bad field, or more ranks than the machine has devices."""
