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


# ------------------------------------------------------------------------------------------ evaluation loader
def metric_value(i: int) -> float:
    """A per-sample metric that is a multiple of 1/8, so float64 sums are exact in any order."""
    return ((i * 37) % 23) / 8.0


class RankShard(IterableDataset):
    """This rank's shard of the ids ``0..sum(lengths)-1``: rank ``r`` yields ``lengths[r]`` consecutive ids
    (its own sharding, uneven on purpose)."""

    def __init__(self, lengths: list[int], rank: int):
        self.lo, self.hi = sum(lengths[:rank]), sum(lengths[: rank + 1])

    def __iter__(self):
        return iter(torch.arange(self.lo, self.hi).tolist())


def _eval_pass(loader) -> dict:
    own, gathered, steps, fillers = [], [], 0, 0
    total, count = torch.zeros((), dtype=torch.float64), 0
    for batch in loader:
        ids = torch.as_tensor(batch)
        steps += 1
        fillers += loader.is_filler
        values = torch.tensor([metric_value(int(i)) for i in ids], dtype=torch.float64)
        total += loader.valid(values).sum()
        count += loader.num_valid
        own += loader.valid(ids).tolist()
        gathered += loader.gather_for_metrics(ids).tolist()
    return {"own": own, "gathered": gathered, "steps": steps, "fillers": fillers,
            "mean": float(loader.reduce_metrics(total, count))}


def eval_runs(n: int, batch_size: int, shard_lengths: list[int], multiple: int = 1) -> dict:
    """A map-style pass over ``range(n)`` and an iterable pass over :class:`RankShard` (default group)."""
    from torchloom.data import eval_loader

    rank = dist.get_rank()
    return {"map": _eval_pass(eval_loader(list(range(n)), batch_size, pad_to_multiple_of=multiple)),
            "iterable": _eval_pass(eval_loader(RankShard(shard_lengths, rank), batch_size))}


def eval_on_mesh(n: int, batch_size: int) -> dict:
    """dp 2 x tp 2: ``eval_loader(mesh=...)`` gives tensor-parallel peers the same samples; gathers and
    reductions run over the dp group (one over the world would return every sample twice)."""
    from torchloom.data import eval_loader
    from torchloom.parallel.mesh import ParallelDims, ParallelMesh

    mesh = ParallelMesh(ParallelDims(dp_replicate=2, tp=2))
    out = _eval_pass(eval_loader(list(range(n)), batch_size, mesh=mesh))
    out["dp_rank"] = mesh.dp_rank
    return out


# ------------------------------------------------------------------------------------------ iterable training
class MLP(nn.Module):
    """4-8-1 regression MLP called as ``model(x, y)`` (the target is ignored; the loss reads it)."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x, y=None):
        return self.net(x)


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MLP()


def sample(rank: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + i)
    x = torch.randn(4, generator=g)
    return x, x.sum(0, keepdim=True).sin()


class RankSamples(IterableDataset):
    """``n`` fixed regression samples of one rank (a different number per rank)."""

    def __init__(self, rank: int, n: int):
        self.rank, self.n = rank, n

    def __iter__(self):
        return (sample(self.rank, i) for i in range(self.n))


def mse(batch, output):
    return nn.functional.mse_loss(output, batch[1])


def train_reference(lengths: list[int], micro: int, accum: int, steps: int, lr: float = 0.1) -> dict:
    """One process: step ``k`` averages the mean losses of every rank's micro-batches ``k*accum ..`` (what DDP
    with gradient accumulation computes), plain SGD."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    dp = len(lengths)
    for k in range(steps):
        opt.zero_grad()
        for r in range(dp):
            for a in range(accum):
                b = (k * accum + a) * micro
                xs, ys = zip(*(sample(r, i) for i in range(b, b + micro)))
                loss = mse((None, torch.stack(ys)), model(torch.stack(xs))) / (dp * accum)
                loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_iterable(lengths: list[int], micro: int, accum: int, uneven: str = "drop", epochs: int = 1,
                   resume_batches: int | None = None) -> dict:
    """``auto_accelerate`` (DDP) on this rank's :class:`RankSamples` (``lengths[rank]`` samples), then
    ``for batch in res.dataloader: res.train_step(batch)``. Returns steps taken, warnings, the error (if any),
    the loader state and the parameters."""
    rank = dist.get_rank()
    args = {"batch_size": len(lengths) * micro * accum, "micro_batch_size": micro}
    if uneven != "drop":  # the default stays unnamed (this worker also shows the hang of the code before it)
        args["uneven"] = uneven
    res = torchloom.auto_accelerate(mlp(), torch.optim.SGD, RankSamples(rank, lengths[rank]), mse,
                                    optim_args={"lr": 0.1}, model_input_format="unpack_sequence",
                                    dataloader_args=args)
    loader = res.dataloader
    if resume_batches is not None:
        loader.load_state_dict({"kind": "iterable", "epoch": 0, "batches_yielded": resume_batches,
                                "dp_size": len(lengths), "micro_batch_size": micro})
    batches, error = 0, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for _ in range(epochs):
                for batch in loader:
                    res.train_step(batch)
                    batches += 1
        except Exception as e:  # noqa: BLE001 - the test checks that every rank raises the same error
            error = f"{type(e).__name__}: {e}"
    model = res.model.module if hasattr(res.model, "module") else res.model
    uneven_warnings = [str(w.message) for w in caught if "unevenly" in str(w.message)]
    return {"batches": batches, "micro_steps": res.train_step.micro_step, "warnings": uneven_warnings,
            "error": error, "state": loader.state_dict(),
            "params": {k: v.detach().clone() for k, v in model.state_dict().items()}}


# ------------------------------------------------------------------------------------------ gather shapes, TP mesh
def _err(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message on every rank
        return f"{type(e).__name__}: {e}"
    return None


def per_sample_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """``(rows,)`` mean next-token cross-entropy of each sequence (fp32)."""
    logits = model(input_ids=ids).logits
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    loss = nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), ids[:, 1:], reduction="none")
    return loss.mean(1)


def eval_gather_and_current_mesh(n: int, batch_size: int) -> dict:
    """2 ranks. First (default group, dp 2): ``gather_for_metrics`` of a per-rank trailing shape (error, then
    ``pad_value``), of nested dict/list/tuple structures, and of a structure that differs per rank. Then
    ``auto_accelerate`` with tp=2 and ``eval_loader`` *without* ``mesh=``: the per-sample loss mean, the gathered
    ids, and the errors of an explicit world group / dp_rank that contradict the mesh."""
    from torchloom.data import eval_loader, reduce_metrics

    rank, out = dist.get_rank(), {}
    loader = eval_loader(list(range(n)), batch_size)
    it = iter(loader)
    ids = next(it)
    out["varlen_error"] = _err(lambda: loader.gather_for_metrics(torch.zeros(len(ids), 2 + rank)))
    out["padded"] = loader.gather_for_metrics((ids[:, None] + 1) * torch.ones(len(ids), 2 + rank, dtype=torch.long),
                                              pad_value=-1).tolist()
    nested = {"ids": ids, "pair": [ids * 2, (ids.double(), {"deep": ids[:, None].expand(-1, 3)})]}
    g = loader.gather_for_metrics(nested)
    out["nested"] = [g["ids"].tolist(), g["pair"][0].tolist(), g["pair"][1][0].tolist(), type(g["pair"][1]).__name__,
                     g["pair"][1][0].dtype == torch.float64, g["pair"][1][1]["deep"].tolist()]
    mismatch = {"a": ids} if rank == 0 else {"b": ids}
    out["structure_error"] = _err(lambda: loader.gather_for_metrics(mismatch))
    out["dtype_error"] = _err(lambda: loader.gather_for_metrics(ids.double() if rank else ids))
    # only rank 0's tensor is wrong (7 rows): rank 1 must raise too, not wait in the gather
    out["one_rank_error"] = _err(lambda: loader.gather_for_metrics(torch.zeros(7) if rank == 0 else ids))
    del it

    toks = token_batches(n)
    ds = [{"input_ids": t, "idx": torch.tensor(i)} for i, t in enumerate(toks)]
    res = torchloom.auto_accelerate(tiny_llama(), torch.optim.SGD, None, lambda b, o: o.loss,
                                    strategy=[("parallel_mode", {"tp": 2}), "tensor_parallel", "fsdp"],
                                    optim_args={"lr": 0.0}, model_input_format="unpack_dict")
    res.model.eval()
    loader = eval_loader(ds, batch_size)  # no mesh=: auto_accelerate's (dp 1 x tp 2) is the current one
    total, count, own, gathered = torch.zeros((), dtype=torch.float64), 0, [], []
    with torch.no_grad():
        for b in loader:
            loss = per_sample_loss(res.model, b["input_ids"])
            total += loader.valid(loss).double().sum()
            count += loader.num_valid
            own += loader.valid(b["idx"]).tolist()
            gathered += loader.gather_for_metrics(b["idx"]).tolist()
    out.update(own=own, gathered=gathered, mean=float(loader.reduce_metrics(total, count)),
               free_mean=float(reduce_metrics(total, count)))
    out["world_group_error"] = _err(lambda: eval_loader(ds, batch_size, group=dist.group.WORLD))
    out["dp_rank_error"] = _err(lambda: eval_loader(ds, batch_size, dp_rank=rank, dp_size=2))
    out["reduce_world_error"] = _err(lambda: reduce_metrics(total, count, group=dist.group.WORLD))
    return out


def tp_eval_reference(n: int) -> float:
    """The per-sample loss mean of the plain model over ``token_batches(n)``, one process."""
    model = tiny_llama().eval()
    with torch.no_grad():
        return per_sample_loss(model, token_batches(n)).double().mean().item()
