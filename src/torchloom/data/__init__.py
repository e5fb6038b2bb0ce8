"""Resumable, elastic data loading: an order that is a pure function of (seed, epoch) and a
position (global samples consumed) that restores exactly, also on another data-parallel size;
evaluation that counts every sample exactly once; ranks that agree when iterable data ends."""
from torchloom.data.batching import BatchPlan, plan_batches
from torchloom.data.eval import EvalLoader, eval_loader, reduce_metrics, split_counts
from torchloom.data.loader import StatefulDataLoader, build_dataloader
from torchloom.data.sampler import DataError, ElasticDistributedSampler, PaddedEpochWarning

__all__ = ["BatchPlan", "plan_batches", "DataError", "ElasticDistributedSampler", "EvalLoader", "PaddedEpochWarning",
           "StatefulDataLoader", "build_dataloader", "eval_loader", "reduce_metrics", "split_counts"]
