"""torchloom: one call from single-device PyTorch training code to fast, fault-tolerant distributed training.

    import torchloom
    res = torchloom.auto_accelerate(model, torch.optim.AdamW, dataset, loss_func, strategy=["fsdp", "amp"])
    for batch in res.dataloader:
        loss = res.train_step(batch)
"""
from .api import AccelerateResult, auto_accelerate
from .errors import (CheckpointError, GradientSyncError, LossScaleError, ReplicaDivergenceError, StrategyError,
                     TorchloomError)
from .parallel.mesh import ParallelDims, ParallelMesh
from .replace import register_module_replacement
from .strategy import Method, Stage, Strategy, register_method
from .strategy.annotations import replicate, split
from .train_step import SumLoss, TrainStep

__version__ = "0.1.0"

__all__ = [
    "auto_accelerate", "AccelerateResult", "Strategy", "Method", "Stage", "register_method", "ParallelDims",
    "ParallelMesh", "replicate", "split", "register_module_replacement", "SumLoss", "TrainStep", "TorchloomError",
    "StrategyError", "CheckpointError", "LossScaleError", "GradientSyncError", "ReplicaDivergenceError",
]
