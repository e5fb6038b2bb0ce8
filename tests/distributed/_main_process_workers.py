"""Rank function for ``test_main_process.py``: every main-process helper and ``res.log`` in one 2-rank launch."""
from __future__ import annotations

import contextlib
import io
import os
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import torchloom
import torchloom.main_process as mp
import torchloom.tracking
from torchloom.data import eval_loader


def square_loss(batch, out):
    return out.pow(2).mean()


def _gathers(n: int, batch_size: int) -> dict[str, list]:
    """``gather_for_metrics`` over ``n`` samples ``0..n-1`` through both loader kinds, concatenated."""
    ds = TensorDataset(torch.arange(n), torch.arange(n) * 10.0)
    out = {}
    ev = eval_loader(ds, batch_size=batch_size)
    out["eval_loader"] = torch.cat([mp.gather_for_metrics(x, ev) for x, _ in ev]).tolist()
    out["eval_implicit"] = torch.cat([mp.gather_for_metrics(x) for x, _ in ev]).tolist()  # the loader iterated
    dl = DataLoader(ds, batch_size=batch_size, sampler=DistributedSampler(ds, shuffle=False))
    pairs = [mp.gather_for_metrics((x, y), dl) for x, y in dl]
    out["sampler_x"] = torch.cat([p[0] for p in pairs]).tolist()
    out["sampler_y"] = torch.cat([p[1] for p in pairs]).tolist()
    out["sampler_again"] = torch.cat([mp.gather_for_metrics(x, dl) for x, _ in dl]).tolist()  # next epoch
    mine = torch.cat([x for x, _ in dl])  # this rank's whole epoch, gathered once
    out["sampler_epoch"] = mp.gather_for_metrics(mine, dl).tolist()
    # one rank passes rows that fit no batch: both ranks raise (neither waits in the all-gather)
    try:
        mp.gather_for_metrics(mine[:1] if dist.get_rank() == 0 else mine[:batch_size], dl)
    except torchloom.data.DataError as e:
        out["bad_rows_error"] = str(e)[:60]
    return out


def main_process_checks(tmp: str) -> dict:
    rank, tmp = dist.get_rank(), Path(tmp)
    r: dict = {"main": mp.is_main_process(), "local_main": mp.is_local_main_process()}
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        mp.print("hello from", rank)
    r["printed"] = buf.getvalue()

    # rank 0 runs the body first: rank 1 must find the file rank 0 wrote (after a delay) already there
    marker = tmp / "cache.txt"
    with mp.main_process_first():
        if rank == 0:
            time.sleep(0.5)
            marker.write_text("built")
        r["saw_cache"] = marker.exists()
    # a body that raises on rank 0 still releases the others (no hang), and rank 0 gets its error
    try:
        with mp.main_process_first():
            if rank == 0:
                raise RuntimeError("map failed")
            r["second_body_ran"] = True
    except RuntimeError as e:
        r["second_error"] = str(e)
    mp.wait_for_everyone()

    r["gather_7_b2"] = _gathers(7, 2)
    r["gather_7_b3"] = _gathers(7, 3)
    r["gather_errors"] = _gather_errors()

    # res.log: only rank 0 writes, into one directory both ranks name
    os.chdir(tmp)
    res = torchloom.auto_accelerate(nn.Linear(4, 2), torch.optim.SGD, loss_func=square_loss,
                                    optim_args={"lr": 0.1})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        res.log({"loss": 1.0}, 0)  # no init_trackers: the default JSONL tracker
    r["default_warned"] = sum("init_trackers" in str(x.message) for x in w)
    res.end_training()
    mine = Recorder()  # every rank builds one; only rank 0's may be called
    res.init_trackers("proj", config={"lr": 0.1}, log_with=["jsonl", mine], logging_dir=tmp / "logs")
    torch.manual_seed(rank)
    for step in range(3):
        loss = res.train_step(torch.randn(4, 4))
        res.log({"loss": loss, "rank": rank}, step)
    r["has_tracker"] = res.get_tracker("jsonl") is not None
    res.end_training()
    r["custom"] = (mine.config, mine.calls, mine.finished)
    r["tracker_errors"] = _tracker_errors(res, tmp)
    return r


def _error(fn) -> str:
    """The exception ``fn()`` raised, as ``"Type: message"`` (the test checks every rank raised, none hung)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return "no error"


def _gather_errors() -> dict[str, str]:
    """Implicit-loader and sampler mistakes raise on both ranks instead of gathering wrong rows."""
    ds = TensorDataset(torch.arange(7))
    dl = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, shuffle=False))
    ev, ev2 = eval_loader(list(range(16)), 4), eval_loader(list(range(16)), 4)
    out = {}
    for _ in ev:
        break  # the loop is over: gather_for_metrics(b) must not use ev's counts for dl's batches
    out["after_break"] = _error(lambda: [mp.gather_for_metrics(x) for (x,) in dl])
    for a in ev:
        for b in ev2:  # two loops running: which loader the values belong to is ambiguous
            out["nested"] = _error(lambda: mp.gather_for_metrics(b))
            break
        break
    # both ranks built their sampler with rank=0: the interleave would be wrong; both raise (none waits)
    same = DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=2, rank=0, shuffle=False))
    out["sampler_rank"] = _error(lambda: [mp.gather_for_metrics(x, same) for (x,) in same])
    return out


def _tracker_errors(res, tmp: Path) -> dict[str, str]:
    """A tracker that fails on one rank stops every rank (rank 0 builds; one all-gather shares the outcome)."""
    out = {"bad_kwargs": _error(lambda: res.init_trackers("bad", log_with="jsonl", logging_dir=tmp / "logs",
                                                          init_kwargs={"jsonl": {"bogus": 1}}))}
    from torchloom.tracking import group

    saved = dict(group.PACKAGES)
    if dist.get_rank() == 1:  # a package missing on rank 1 only (rank 0 has built its jsonl tracker by then)
        group.PACKAGES["jsonl"] = ("no_such_tracker_pkg", "no-such-tracker-pkg")
    try:
        out["missing_on_1"] = _error(lambda: res.init_trackers("miss", log_with="jsonl", logging_dir=tmp / "logs"))
    finally:
        group.PACKAGES.clear()
        group.PACKAGES.update(saved)
    return out


class Recorder(torchloom.tracking.Tracker):
    name = "recorder"

    def __init__(self):
        self.config, self.calls, self.finished = None, [], False

    def store_init_configuration(self, config):
        self.config = dict(config)

    def log(self, values, step):
        self.calls.append((values, step))

    def finish(self):
        self.finished = True
