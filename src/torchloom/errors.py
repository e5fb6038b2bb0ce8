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
