"""Checkpoint stall side by side: torchloom flash checkpoint vs PyTorch DCP ``async_save`` (thread and
process mode) vs synchronous DCP ``save`` vs DLRover's flash checkpoint, on 2 gloo ranks (DDP), plus the
time to restore after a kill. Entry point: :func:`benchmarks.compare_ckpt.run.main`
(``python benchmarks/compare_ckpt/run.py [--smoke]``). See ``docs/benchmarks.md`` ("Checkpoint stall").
"""
