"""Rank functions for tests/distributed/test_hf_loss_data.py: ``SumLoss.from_hf`` under accumulation and
padding on 2 ranks, the global loss ``train_step`` returns, and a Hugging Face ``IterableDataset`` resumed
through its own ``state_dict()``. One launch runs everything (a launch costs seconds)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
import torch.distributed as dist

import torchloom
from tests.cases._workers import C10_LENGTHS, c10_batch, c10_micro, record_grads, sgd
from tests.models import full_params, lm_loss, tiny_llama

#: valid targets of the 8 C10 sequences (what HF's Trainer would pass as num_items_in_batch)
C10_TOKENS = sum(n - 1 for n in C10_LENGTHS)
HF_ROWS, HF_MICRO, HF_GLOBAL, HF_STOP = 48, 2, 8, 5  # 24 rows / 12 batches a rank; stop after 5 (mid-window)


def from_hf_loss(batch, out):
    return torchloom.SumLoss.from_hf(out, batch["labels"])


def from_hf_loss_with_num_items(batch, out):  # what a port of an HF Trainer loss function passes
    return torchloom.SumLoss.from_hf(out, batch["labels"], num_items_in_batch=torch.tensor(C10_TOKENS))


def c10_run(strategy, loss_func, loss_report: str = "global") -> dict:
    """This rank's 4 sequences as 4 micro-batches of 1 (one optimizer step): the gradient the optimizer
    applied, the parameters after the SGD step, the returned loss per call and this rank's own loss."""
    rank, world = dist.get_rank(), dist.get_world_size()
    res = torchloom.auto_accelerate(
        tiny_llama(), sgd, None, loss_func, strategy=strategy, model_input_format="unpack_dict",
        dataloader_args={"batch_size": len(C10_LENGTHS), "micro_batch_size": 1},
    )
    step = res.train_step
    step.loss_report = loss_report
    grads = record_grads(res.optimizer, res.model)
    batch, n = c10_batch(), len(C10_LENGTHS) // world
    losses, local = [], []
    for k in range(n):
        lo = rank * n + k
        losses.append(step(c10_micro(batch, lo, lo + 1)).item())
        local.append(step.last_local_loss.item())
    assert step.optimizer_steps == 1 and len(grads) == 1
    return {"grads": grads[0], "params": full_params(res.model), "losses": losses, "local": local}


def hf_dataset(rank: int, world: int, reads: list[int]):
    """48 rows in 4 shards, this rank's half via ``split_dataset_by_node``; ``reads[0]`` counts the rows
    the dataset produced (its ``map`` runs once per row read)."""
    import datasets
    from datasets.distributed import split_dataset_by_node

    def count(row):
        reads[0] += 1
        return row

    ds = datasets.Dataset.from_dict({"x": list(range(HF_ROWS))}).to_iterable_dataset(num_shards=4)
    return split_dataset_by_node(ds, rank=rank, world_size=world).map(count)


def hf_loader(rank, world, reads):
    from torchloom.data.loader import build_dataloader

    return build_dataloader(hf_dataset(rank, world, reads), dp_rank=rank, dp_size=world,
                            micro_batch_size=HF_MICRO, global_batch_size=HF_GLOBAL)


def hf_resume(root: str) -> dict:
    """Uninterrupted pass vs a pass stopped after HF_STOP batches (inside an accumulation window: the
    ranks' join has read the whole window), saved with ``torchloom.checkpoint`` and resumed in a fresh
    loader. Returns the batches, rows read and the saved document's dataloader entries."""
    from torchloom import checkpoint as ckpt

    rank, world = dist.get_rank(), dist.get_world_size()
    reads = [0]
    full = [b["x"].tolist() for b in hf_loader(rank, world, reads)]
    full_reads, reads[0] = reads[0], 0
    loader, first = hf_loader(rank, world, reads), []
    for b in loader:
        first.append(b["x"].tolist())
        if len(first) == HF_STOP:
            break
    first_reads = reads[0]
    model = torch.nn.Linear(1, 1)
    path = ckpt.save(root, step=1, model=model, dataloader=loader)
    reads[0] = 0
    resumed = hf_loader(rank, world, reads)
    ckpt.load(root, model=model, dataloader=resumed)
    mode = resumed.resumes_from_dataset_state
    rest = [b["x"].tolist() for b in resumed]
    doc = json.loads((Path(path) / "trainer_state.json").read_text())
    return {"full": full, "full_reads": full_reads, "first": first, "first_reads": first_reads, "rest": rest,
            "rest_reads": reads[0], "state_mode": mode, "doc_dataloader": doc.get("dataloader"),
            "doc_per_rank": doc.get("dataloader_per_rank")}


def all_checks(root: str) -> dict:
    return {
        "ddp": c10_run(None, from_hf_loss),
        "ddp_num_items_local": c10_run(None, from_hf_loss_with_num_items, loss_report="local"),
        "ddp_mean": c10_run(None, lm_loss),
        "hf_resume": hf_resume(root) if importlib.util.find_spec("datasets") else None,  # the [hf] extra
    }
