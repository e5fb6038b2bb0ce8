"""Run as a script (its functions live in ``__main__``, as a notebook cell's do): every notebook_launcher check,
and auto_accelerate(strategy=None) reading a config file on 2 ranks. Prints one JSON line of results."""
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchloom.elastic.notebook import NotebookLaunchError, notebook_launcher
from torchloom.strategy import Strategy

torch.randn(256, 256) @ torch.randn(256, 256)  # this "kernel" has used torch's OpenMP pool (fork hazard)
Strategy(["fsdp"])  # import the built-in methods once here, not in each forked launch (1 s each on 2 busy cores)


class Box:  # a class from __main__ inside a result
    def __init__(self, value):
        self.value = value


def train(scale, *, offset=0):
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    (torch.randn(128, 128) @ torch.randn(128, 128)).sum()  # would hang with >1 thread after the fork
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    return Box((t * scale + offset).tolist()), env, torch.get_num_threads()


def fail_on_rank1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    time.sleep(0.5)
    dist.barrier()  # rank 0 fails in reaction (peer gone), later than rank 1
    return "unreachable"


def sleep_forever():
    time.sleep(600)


def config_pickup(paths):
    """Each rank reads the config file its entry of ``paths`` names: the strategy, or the error, it gets."""
    from torchloom.strategy.config_file import default_strategy

    os.environ["TORCHLOOM_CONFIG_FILE"] = paths[dist.get_rank()]
    try:
        strategy, note = default_strategy(None, torch.nn.Linear(2, 2))
        return repr(strategy), note
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))

    def forward(self, batch):
        return self.net(batch[0])


def accelerate_with_file(path, strategy):
    """auto_accelerate on 2 ranks, strategy=None with the file, or the same strategy given explicitly: one step
    on the same data must give the same parameters."""
    import torchloom

    os.environ["TORCHLOOM_CONFIG_FILE"] = path
    torch.manual_seed(0)
    data = [(torch.randn(8), torch.randn(1)) for _ in range(8)]
    res = torchloom.auto_accelerate(Regressor(), torch.optim.SGD, data, lambda b, out: ((out - b[1]) ** 2).mean(),
                                    strategy=strategy, optim_args={"lr": 0.1},
                                    dataloader_args={"batch_size": 4, "shuffle": False})
    loss = float(res.train_step(next(iter(res.dataloader))))
    params = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in res.model.parameters()]
    return repr(res.strategy), [n for n in res.notes if "strategy from" in n], loss, [p.tolist() for p in params]


def main():
    out = {}
    r = notebook_launcher(train, (2.0,), nproc=2, kwargs={"offset": 1})
    out["rank0"] = [r[0].value, r[1], r[2]]
    out["all"] = [x[1]["RANK"] for x in notebook_launcher(train, (1.0,), nproc=2, all_ranks=True)]
    try:
        notebook_launcher(fail_on_rank1, nproc=2, timeout=60)
    except NotebookLaunchError as e:
        out["error"] = {"rank": e.rank, "message": str(e), "traceback": e.traceback, "failed": sorted(e.failures)}
    t0 = time.monotonic()
    try:
        notebook_launcher(sleep_forever, nproc=2, timeout=2)
    except NotebookLaunchError as e:
        out["timeout"] = {"message": str(e), "seconds": time.monotonic() - t0}
    refusals = {}
    main_file = sys.modules["__main__"].__dict__.pop("__file__")  # a notebook's __main__ has no file
    try:
        notebook_launcher(train, (1.0,), nproc=2, start_method="spawn")
    except RuntimeError as e:
        refusals["spawn"] = str(e)
    sys.modules["__main__"].__file__ = main_file
    real = torch.cuda.is_initialized
    torch.cuda.is_initialized = lambda: True
    try:
        notebook_launcher(train, (1.0,), nproc=2)
    except RuntimeError as e:
        refusals["cuda"] = str(e)
    torch.cuda.is_initialized = real
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        notebook_launcher(train, (1.0,), nproc=2)
    except RuntimeError as e:
        refusals["group"] = str(e)
    dist.destroy_process_group()
    out["refusals"] = refusals

    with tempfile.TemporaryDirectory() as d:
        good, other, bad = Path(d, "good.yaml"), Path(d, "other.yaml"), Path(d, "bad.yaml")
        good.write_text("config_version: 1\nstrategy: [fsdp]\n")
        other.write_text("config_version: 1\nstrategy: [ddp]\n")
        bad.write_text("config_version: 1\nstrategy: [fsdpp]\n")
        out["pickup"] = {
            "same": notebook_launcher(config_pickup, ([str(good)] * 2,), nproc=2, all_ranks=True),
            "one_rank_without": notebook_launcher(config_pickup, ([str(good), "none"],), nproc=2, all_ranks=True),
            "different": notebook_launcher(config_pickup, ([str(good), str(other)],), nproc=2, all_ranks=True),
            "one_rank_invalid": notebook_launcher(config_pickup, ([str(good), str(bad)],), nproc=2, all_ranks=True),
        }
        out["from_file"] = notebook_launcher(accelerate_with_file, (str(good), None), nproc=2, all_ranks=True)
        out["explicit"] = notebook_launcher(accelerate_with_file, ("none", ["fsdp"]), nproc=2, all_ranks=True)
    print("RESULT " + json.dumps(out))


if __name__ == "__main__":
    main()
