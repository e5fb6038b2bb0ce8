"""Expert parallelism mechanics: all-to-all token dispatch (:mod:`.dispatch`), placing an experts module over
the ``ep`` ranks (:mod:`.shard`), and the expert gradient reduction under DDP (:mod:`.reduce`). The strategy
method is ``torchloom.methods.expert_parallel``; docs/expert_parallel.md."""
from .dispatch import AllToAllDispatcher, alltoall_seconds, reset_alltoall_seconds
from .shard import shard_experts

__all__ = ["AllToAllDispatcher", "alltoall_seconds", "reset_alltoall_seconds", "shard_experts"]
