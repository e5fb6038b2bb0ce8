"""Built-in strategy methods, one file each. Importing this package registers them."""
from . import activation_checkpoint, amp, compile, ddp, fsdp, half, parallel_mode, tensor_parallel, zero1  # noqa: F401
from . import module_replace  # noqa: F401
from . import pipeline_parallel  # noqa: F401
from . import expert_parallel  # noqa: F401
from . import float8  # noqa: F401
from . import context_parallel  # noqa: F401
from . import ulysses  # noqa: F401
