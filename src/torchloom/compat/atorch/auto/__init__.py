"""``atorch.auto``: ``auto_accelerate`` and the strategy."""
from .accelerate import auto_accelerate  # noqa: F401
