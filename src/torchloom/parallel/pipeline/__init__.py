"""Pipeline parallelism on ``torch.distributed.pipelining``: stage assignment (``split``), name-preserving stage
modules (``stage``), per-family stage runners (``families``), schedules and keyword routing (``schedule``),
the returned model container (``model``) and weights tied across stages (``tied``). The strategy method is
``torchloom.methods.pipeline_parallel``."""
from .model import PipelinedModel
from .split import StageSpec, Unit, balance_by_cost, split_by_cost, split_by_points

__all__ = ["PipelinedModel", "StageSpec", "Unit", "balance_by_cost", "split_by_cost", "split_by_points"]
