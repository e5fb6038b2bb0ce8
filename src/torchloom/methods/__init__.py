"""Built-in strategy methods, one file each. Importing this package registers them."""
from . import activation_checkpoint, amp, compile, ddp, fsdp, half, parallel_mode, zero1  # noqa: F401
