"""Rank functions for the uneven-data tests (``test_uneven_data.py``) and their single-process references.

Three groups: the evaluation loader over map-style and iterable data (every sample exactly once, metrics equal
the single-process mean), training on iterable data whose ranks hold different numbers of batches (all ranks
stop at the same step, no hang), and ``loom train``'s held-out evaluation (``Job.evaluate``) under DDP, PP and TP.
"""
from __future__ import annotations

import warnings
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import IterableDataset

import torchloom
from tests.models import tiny_llama, token_batches


# ------------------------------------------------------------------------------------------ held-out evaluation
def heldout_windows(n: int, seq: int = 16):
    """``n`` fixed windows of random tokens as the job's ``TokenWindows``."""
    from torchloom.train.dataset import TokenWindows

    return TokenWindows(token_batches(n, seq=seq).reshape(-1), seq)


def heldout_reference(n: int, subset: list[int] | None = None) -> float:
    """Token-weighted mean next-token loss of the plain model over windows ``subset`` (default: all), one process."""
    from torchloom.train.job import causal_lm_loss

    ds, model = heldout_windows(n), tiny_llama(layers=4)
    model.eval()
    idx = list(range(n)) if subset is None else subset
    total, count = 0.0, 0
    with torch.no_grad():
        for i in idx:
            b = ds.batch([i])
            out = causal_lm_loss(b, model(**b))
            total += float(out.total.double())
            count += int(out.count)
    return total / count


def job_evaluate(configs: list[dict]) -> list[float]:
    """``Job.evaluate`` of ``loom train`` for each config (strategy, n windows, eval batch_size, batches), on
    a job object holding only what evaluation reads (cfg.eval, res, eval_ds)."""
    from torchloom.train.config import EvalConfig
    from torchloom.train.job import Job, causal_lm_loss

    out = []
    for c in configs:
        res = torchloom.auto_accelerate(tiny_llama(layers=4), torch.optim.SGD, None, causal_lm_loss,
                                        strategy=c["strategy"], optim_args={"lr": 0.1},
                                        model_input_format="unpack_dict")
        job = Job.__new__(Job)
        job.cfg = SimpleNamespace(eval=EvalConfig(interval=0, batches=c.get("batches"), batch_size=c["batch_size"]))
        job.res, job.eval_ds = res, heldout_windows(c["n"])
        out.append(job.evaluate())
    return out
