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
from .parallel_groups import (  # noqa: F401
    get_data_partition_rank_and_size,
    parallel_group,
    parallel_group_size,
    parallel_instance_index,
    parallel_instance_num,
    parallel_rank,
)
