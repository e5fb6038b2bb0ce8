"""torchloom: one call from single-device PyTorch training code to fast, fault-tolerant distributed training.

    import torchloom
    res = torchloom.auto_accelerate(model, torch.optim.AdamW, dataset, loss_func, strategy=["fsdp", "amp"])
    for batch in res.dataloader:
        loss = res.train_step(batch)
"""
from .api import AccelerateResult, auto_accelerate
from .main_process import (gather_for_metrics, is_local_main_process, is_main_process, main_process_first, print,
                           wait_for_everyone)
from .errors import (CheckpointError, GradientSyncError, LossScaleError, ReplicaDivergenceError, StrategyError,
                     TorchloomError)
from .elastic.notebook import NotebookLaunchError, notebook_launcher
from .parallel.mesh import ParallelDims, ParallelMesh
from .replace import register_module_replacement
from .strategy import Method, Stage, Strategy, register_method
from .strategy.config_file import ConfigFileError
from .strategy.annotations import replicate, split
from .tracking import Tracker
from .train_step import SumLoss, TrainStep

__version__ = "0.1.0"

__all__ = [
    "auto_accelerate", "AccelerateResult", "Strategy", "Method", "Stage", "register_method", "ParallelDims",
    "ParallelMesh", "replicate", "split", "register_module_replacement", "SumLoss", "TrainStep", "TorchloomError",
    "StrategyError", "CheckpointError", "LossScaleError", "GradientSyncError", "ReplicaDivergenceError",
    # Accelerate-style helpers (docs/hf.md); `torchloom.print` is left out so `import *` keeps the builtin
    "is_main_process", "is_local_main_process", "main_process_first", "wait_for_everyone", "gather_for_metrics",
    "Tracker", "notebook_launcher", "NotebookLaunchError", "ConfigFileError",
]
