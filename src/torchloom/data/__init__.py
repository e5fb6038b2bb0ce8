"""Resumable, elastic data loading: an order that is a pure function of (seed, epoch) and a
position (global samples consumed) that restores exactly, also on another data-parallel size."""
from torchloom.data.batching import BatchPlan, plan_batches
from torchloom.data.loader import StatefulDataLoader, build_dataloader
from torchloom.data.sampler import DataError, ElasticDistributedSampler

__all__ = ["BatchPlan", "plan_batches", "DataError", "ElasticDistributedSampler", "StatefulDataLoader", "build_dataloader"]
