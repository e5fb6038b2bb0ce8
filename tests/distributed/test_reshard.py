"""Resharding: a checkpoint saved under one strategy and world size resumes under another.

Scenarios (source -> target): 4-rank ZeRO-3 -> 2-rank ZeRO-2, 4-rank ZeRO-3 -> 3-rank DDP, 2-rank DDP ->
4-rank FSDP, HSDP 2x2 -> 2-rank FSDP, 4-rank ZeRO-1 -> 2-rank FSDP; context parallel: 4-rank dp_shard 2 x cp 2
-> 4-rank cp 4 and -> 2-rank FSDP without cp, 4-rank ZeRO-3 -> 2-rank cp 2. The global batch is 12 everywhere
(divisible by 2, 3 and 4); the micro batch is fixed per run, so gradient accumulation changes with the dp
size (e.g. 1 on 4 ranks x 3, 2 on 2 ranks x 3, 2 on 3 ranks x 2). Each source trains 6 steps and saves
after step 3 (uninterrupted run); each target starts from *other* weights, loads that checkpoint through
``torchloom.checkpoint.load(..., dataloader=res.dataloader, train_step=res.train_step)`` and trains steps
4-6. Steps 5-6 lie in epoch 1 (50 samples, 4 steps per epoch), so the epoch roll-over after a resume is
covered too.

Tolerances: the sample ids of every step after the resume must be *equal* to the uninterrupted run's, and
the optimizer-step counter, learning rate and data position exact. Losses and parameters change only by
fp32 rounding, because the world size changes the reduction order (all-reduce vs reduce-scatter, how many
partial sums); with SGD+momentum the measured differences are ~1e-7 relative (losses) and ~4e-9 absolute
(parameters), so the checks are rel 1e-5 and abs 1e-6: far below what a lost momentum buffer, scheduler
state or data position produces (>= 1e-3).
"""
from __future__ import annotations

import pytest

from tests.distributed._reshard_workers import run_jobs
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed

G = 12
SCENARIOS = {  # target name: (source name, target world size)
    "zero3_to_zero2": ("zero3", 2),
    "zero3_to_ddp3": ("zero3", 3),
    "ddp2_to_fsdp4": ("ddp2", 4),
    "hsdp_to_fsdp2": ("hsdp", 2),
    "zero1_to_fsdp2": ("zero1", 2),
}
#: context parallelism: cp peers read the same samples, so resharding across cp changes no data position
CP_SCENARIOS = {  # target: (source, world, accumulation steps)
    "cp2_to_cp4": ("cp2", 4, 4),        # dp_shard 2 x cp 2 -> cp 4 (dp 1)
    "cp2_to_fsdp2": ("cp2", 2, 2),      # -> no cp
    "zero3_to_cp2": ("zero3", 2, 4),    # no cp -> cp 2 (dp 1)
}
CP = lambda **d: [("parallel_mode", d), "context_parallel", "fsdp"]  # noqa: E731


def job(name, strategy, micro, load=None):
    j = dict(name=name, strategy=strategy, optim="sgd", global_batch=G, micro_batch=micro, steps=6)
    if load is None:
        j["save_at"] = 3
    else:
        j["load"] = load
    return j


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("reshard"))
    hsdp = [("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"]
    out = {}
    for world, jobs in (
        (4, [job("zero3", ["zero3"], 3), job("hsdp", hsdp, 3), job("zero1", ["zero1"], 3),
             job("cp2", CP(dp_shard=2, cp=2), 3)]),
        (2, [job("zero3_to_zero2", ["zero2"], 3, "zero3"), job("hsdp_to_fsdp2", ["fsdp"], 3, "hsdp"),
             job("zero1_to_fsdp2", ["fsdp"], 3, "zero1"), job("ddp2", ["ddp"], 3),
             job("cp2_to_fsdp2", ["fsdp"], 3, "cp2"), job("zero3_to_cp2", CP(cp=2), 3, "zero3")]),
        (4, [job("ddp2_to_fsdp4", ["fsdp"], 3, "ddp2"), job("cp2_to_cp4", CP(cp=4), 3, "cp2")]),
        (3, [job("zero3_to_ddp3", ["ddp"], 2, "zero3")]),
    ):
        results = run_ranks(run_jobs, world, tmp, jobs, timeout=600)
        for i, j in enumerate(jobs):
            rec = results[0][i]
            # every rank saw the same steps (ids/losses are gathered/reduced over all ranks)
            assert all(r[i]["records"] == rec["records"] for r in results), j["name"]
            out[j["name"]] = rec
    return out


LAYOUT = {  # a run's notes must say it used the strategy it names
    "zero3": "fsdp: ZeRO-3", "hsdp": "HSDP 2x2", "zero1": "zero1: optimizer state sharded over dp=4",
    "ddp2": "ddp: DistributedDataParallel over dp=2", "zero3_to_zero2": "fsdp: ZeRO-2",
    "zero3_to_ddp3": "ddp: DistributedDataParallel over dp=3", "ddp2_to_fsdp4": "fsdp: ZeRO-3",
    "hsdp_to_fsdp2": "fsdp: ZeRO-3", "zero1_to_fsdp2": "fsdp: ZeRO-3",
}


def test_runs_use_the_intended_layouts(runs):
    for name, text in LAYOUT.items():
        assert text in " | ".join(runs[name]["notes"]), (name, runs[name]["notes"])
    assert "HSDP" not in " ".join(runs["hsdp_to_fsdp2"]["notes"])
    assert [runs[n]["world"] for n in ("zero3", "hsdp", "zero1", "ddp2")] == [4, 4, 4, 2]
    assert runs["zero3"]["accum"] == 1 and runs["ddp2"]["accum"] == 2


@pytest.mark.parametrize("name", sorted(SCENARIOS) + sorted(CP_SCENARIOS))
def test_resume_under_another_strategy_and_world_size(runs, name):
    src_name, world = SCENARIOS[name] if name in SCENARIOS else CP_SCENARIOS[name][:2]
    src, tgt = runs[src_name], runs[name]
    assert tgt["world"] == world
    # global batch held, accumulation adjusted (to dp: cp peers share their samples)
    accum = CP_SCENARIOS[name][2] if name in CP_SCENARIOS else G // (world * (2 if world == 3 else 3))
    assert tgt["accum"] == accum
    if name in CP_SCENARIOS:
        assert ("ring attention" in " ".join(tgt["notes"])) == ("cp" in name.split("_to_")[1])
    assert tgt["loaded_step"] == 3 and tgt["optimizer_steps_after_load"] == 3
    assert tgt["data_state_after_load"]["consumed"] == 36 and tgt["data_state_after_load"]["epoch"] == 0

    ref, got = src["records"][3:], tgt["records"]
    assert [r["step"] for r in got] == [4, 5, 6]
    for a, b in zip(ref, got):
        assert b["ids"] == a["ids"], f"step {a['step']}: other samples than the uninterrupted run"
        assert b["lr"] == a["lr"], f"step {a['step']}: the LR scheduler was not restored"
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=0), f"step {a['step']} loss"
    # no sample of an epoch is repeated or skipped across the resume: steps 1-4 are epoch 0's 48 samples
    epoch0 = [i for r in src["records"][:3] + got[:1] for i in r["ids"]]
    assert len(set(epoch0)) == 48
    assert src["params"].keys() == tgt["params"].keys()
    for k, v in src["params"].items():
        diff = (v - tgt["params"][k]).abs().max().item()
        assert diff <= 1e-6, f"{k}: max abs diff {diff} after 3 resumed steps"
