"""Rank function for tests/distributed/test_search_trials.py: confirming trials on the live group, then the
real run, compared with the same real run without trials (one launch)."""
from __future__ import annotations

import random

import numpy as np
import torch
import torch.distributed as dist

import torchloom
from tests.models import tiny_llama_config, token_batches
from torchloom.parallel import mesh as loom_mesh
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate
from torchloom.search.isolation import live_groups
from torchloom.search.runner import run_trials

SEQ = 16
DATA = [{"input_ids": x, "labels": x} for x in token_batches(64, seq=SEQ)]


def fresh_model():
    """A tiny Llama initialised from the *current* torch RNG (no re-seeding) and with dropout: a run after the
    trials starts from other weights and drops other units if the trials leaked random state."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(attention_dropout=0.1))


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def real_run(steps: int = 3) -> dict:
    """What a job does after its search: build, accelerate (DDP), train with SGD on shuffled data, draw."""
    model = fresh_model()
    res = torchloom.auto_accelerate(
        model, torch.optim.SGD, DATA, lambda b, o: o.loss, strategy=["ddp"], optim_args={"lr": 0.1},
        dataloader_args={"batch_size": 8, "shuffle": True}, model_input_format="unpack_dict")
    losses = []
    it = iter(res.dataloader)
    for _ in range(steps):
        losses.append(float(res.train_step(next(it))))
    params = {k: v.detach().clone() for k, v in res.model.module.state_dict().items()}
    after = (torch.rand(3), random.random(), np.random.rand(2))
    loom_mesh.set_current_mesh(None)
    return {"losses": losses, "params": params, "draws": after}


def candidates() -> list[Candidate]:
    c = lambda dims, methods, mb=2, accum=2: Candidate(dims, tuple(methods), mb, accum, SEQ)  # noqa: E731
    return [
        c(ParallelDims(dp_replicate=2), [("ddp", {})]),                              # DDP x2, accumulation 2
        c(ParallelDims(dp_shard=2), [("fsdp", {})], mb=4, accum=1),                  # ZeRO-3 x2
        c(ParallelDims(tp=2), [("tensor_parallel", {})], mb=8, accum=1),              # TP x2
        c(ParallelDims(dp_shard=2), [("fsdp", {"reshard_after_forward": "sometimes"})]),  # invalid config
    ]


def trials_then_real_run() -> dict:
    seed_all(11)
    reference = real_run()
    seed_all(11)
    groups_before = len(live_groups())
    mesh_before = loom_mesh._CURRENT
    results = run_trials(candidates(), make_model=fresh_model, optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                         dataset=DATA, loss_func=lambda b, o: o.loss, model_input_format="unpack_dict",
                         dataloader_args={"shuffle": True}, steps=2, warmup=1)
    state = {"groups_before": groups_before, "groups_after": len(live_groups()),
             "mesh_restored": loom_mesh._CURRENT is mesh_before, "rank": dist.get_rank()}
    after = real_run()
    return {"reference": reference, "after": after, "results": [r.to_dict() for r in results], **state}


def tp_trials_after_tp() -> list:
    """4 ranks: tensor-parallel trials whose tp views have the same layout ([[0, 1], [2, 3]]) on different
    meshes. The DTensor dispatch cache compares meshes by layout: without clearing it a later trial reused
    output specs naming the first trial's destroyed groups (found by benchmarks/search_accuracy.py)."""
    c = lambda dims, methods, mb=4, accum=1: Candidate(dims, tuple(methods), mb, accum, SEQ)  # noqa: E731
    cands = [c(ParallelDims(dp_shard=2, tp=2), [("fsdp", {}), ("tensor_parallel", {})]),
             c(ParallelDims(pp=2, tp=2), [("tensor_parallel", {}), ("pipeline_parallel", {})], accum=2),
             c(ParallelDims(dp_shard=2, tp=2), [("fsdp", {}), ("tensor_parallel", {})])]
    results = run_trials(cands, make_model=fresh_model, optim_func=torch.optim.SGD, optim_args={"lr": 0.1},
                         dataset=DATA, loss_func=lambda b, o: o.loss, model_input_format="unpack_dict",
                         dataloader_args={"batch_size": 8}, steps=1, warmup=1)
    return [(r.status, r.error) for r in results]


def zero_bubble_trials() -> list:
    """2 ranks: zero-bubble schedules as trials (the CPU memory tracker broke their split backward on one
    rank and left the other blocked in a recv: a hang), then 1F1B, whose memory is tracked."""
    c = lambda schedule: Candidate(ParallelDims(pp=2), (("pipeline_parallel", {"schedule": schedule}),),  # noqa: E731
                                   4, 2, SEQ)
    results = run_trials([c("zero_bubble"), c("zbv"), c("1f1b")], make_model=fresh_model,
                         optim_func=torch.optim.SGD, optim_args={"lr": 0.1}, dataset=DATA,
                         loss_func=lambda b, o: o.loss, model_input_format="unpack_dict",
                         dataloader_args={"batch_size": 8}, steps=1, warmup=1)
    return [(r.status, r.error, r.peak_memory_bytes) for r in results]
