"""Corrupted or truncated checkpoints on the distributed auto-resume path (2 gloo ranks, FSDP2).

A run saves steps 1, 2 and 3 (auto_accelerate with a real dataset, so model, optimizer, scheduler, data
position and ``TrainStep`` are all in the checkpoint). Rank 0 then damages a copy of the root's newest
checkpoint in one way per case. Expected, on every rank: ``load(root)`` falls back to step 2 (all ranks
agree on the path, rank 0 logs which checkpoint it skipped and why, naming the file), and loading the
damaged directory explicitly raises a ``CheckpointError`` naming the file. After a fallback, training
step 3 again reproduces the original step 3 bit for bit (same world size and layout: deterministic CPU
kernels and gloo reductions).
"""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.distributed._reshard_workers import _accelerate, _train
from tests.models import full_params
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed


def _flip(path: Path, offset: int = 0, n: int = 64) -> None:
    """Corrupt ``n`` bytes in place, keeping the size (the marker's size check cannot see it)."""
    raw = bytearray(path.read_bytes())
    for i in range(offset, min(offset + n, len(raw))):
        raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _truncate(path: Path, n: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-n])


CASES = {  # name: (damage to step_00000003, text the explicit load's error must contain)
    "truncated_shard": (lambda d: _truncate(d / "__1_0.distcp"), "__1_0.distcp is truncated"),
    "truncated_rng": (lambda d: _truncate(d / "rng" / "rank0.pt", 10), "rank0.pt is truncated"),
    "trainer_state_same_size": (lambda d: _flip(d / "trainer_state.json"), "trainer_state.json is corrupt"),
    "trainer_state_shorter": (lambda d: _truncate(d / "trainer_state.json", 5), "trainer_state.json is truncated"),
    "metadata_same_size": (lambda d: _flip(d / ".metadata"), ".metadata is corrupt"),
    "no_marker": (lambda d: (d / "COMPLETE").unlink(), "is incomplete: it has no COMPLETE marker"),
}


class _ListHandler(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def corrupt_rank(tmp: str) -> dict:
    from torchloom.checkpoint import CheckpointError, load

    tmp_p, rank = Path(tmp), dist.get_rank()
    root = tmp_p / "orig"
    res = _accelerate(["fsdp"], "sgd", 12, 3, model_seed=0)
    _train(res, 0, 2, save_at=(1, 2), root=str(root))
    params2 = full_params(res.model)
    _train(res, 2, 3, save_at=3, root=str(root))
    params3 = full_params(res.model)

    if rank == 0:
        for name, (damage, _) in CASES.items():
            shutil.copytree(root, tmp_p / name)
            damage(tmp_p / name / "step_00000003")
    dist.barrier()

    handler = _ListHandler()
    logging.getLogger("torchloom.checkpoint").addHandler(handler)
    fresh = _accelerate(["fsdp"], "sgd", 12, 3, model_seed=7)
    kw = dict(model=fresh.model, optimizer=fresh.optimizer, lr_scheduler=fresh.lr_scheduler,
              dataloader=fresh.dataloader, train_step=fresh.train_step)
    out: dict = {"rank": rank, "cases": {}}
    for name in CASES:
        handler.messages.clear()
        info = load(tmp_p / name, **kw)
        got = full_params(fresh.model)
        case = {
            "step": info["path"].name, "path": str(info["path"]),
            "params_equal_step2": all(torch.equal(got[k], v) for k, v in params2.items()),
            "optimizer_steps": fresh.train_step.optimizer_steps,
            "consumed": fresh.dataloader.state_dict()["consumed"],
            "warnings": list(handler.messages),
        }
        try:
            load(tmp_p / name / "step_00000003", **kw)
            case["explicit_error"] = None
        except CheckpointError as e:
            case["explicit_error"] = str(e)
        out["cases"][name] = case

    # resume from the fallback and redo step 3: identical to the original step 3
    info = load(tmp_p / "trainer_state_same_size", **kw)
    _train(fresh, info["step"], 3)
    again = full_params(fresh.model)
    out["step3_bitwise"] = all(torch.equal(again[k], v) for k, v in params3.items())
    # a root whose every checkpoint is unusable: one clear error, on every rank
    if rank == 0:
        for step in (1, 2):
            (tmp_p / "no_marker" / f"step_{step:08d}" / "COMPLETE").unlink()
    dist.barrier()
    try:
        load(tmp_p / "no_marker", **kw)
        out["nothing_usable"] = None
    except CheckpointError as e:
        out["nothing_usable"] = str(e)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_ranks(corrupt_rank, 2, str(tmp_path_factory.mktemp("corrupt")), timeout=600)


@pytest.mark.parametrize("name", sorted(CASES))
def test_load_root_falls_back_and_explicit_load_names_the_file(results, name):
    r0, r1 = (r["cases"][name] for r in results)
    assert r0["path"] == r1["path"], "ranks disagree on the checkpoint"
    for r in (r0, r1):
        assert r["step"] == "step_00000002"
        assert r["params_equal_step2"] and r["optimizer_steps"] == 2 and r["consumed"] == 24
        assert r["explicit_error"] is not None and CASES[name][1] in r["explicit_error"], r["explicit_error"]
        assert "step_00000003" in r["explicit_error"]
    # rank 0 decides, and says what it skipped and why (the reason names the file)
    assert len(r0["warnings"]) == 1 and "skipped 1 unusable checkpoint(s) (step_00000003: " in r0["warnings"][0]
    assert CASES[name][1] in r0["warnings"][0] and r0["warnings"][0].endswith("step_00000002")
    assert r1["warnings"] == []


def test_training_resumes_from_the_fallback(results):
    assert all(r["step3_bitwise"] for r in results)


def test_no_usable_checkpoint_is_one_clear_error_on_every_rank(results):
    for r in results:
        msg = r["nothing_usable"]
        assert msg is not None and "no complete checkpoint under" in msg
        assert all(f"step_{s:08d}: checkpoint" in msg for s in (1, 2, 3)), msg
