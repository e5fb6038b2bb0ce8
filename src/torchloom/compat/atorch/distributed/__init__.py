"""``atorch.distributed``: the process-group helpers."""
from .distributed import (  # noqa: F401
    coworker_size,
    init_distributed,
    is_distributed,
    local_rank,
    rank,
    reset_distributed,
    world_size,
)
