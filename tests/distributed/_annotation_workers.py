"""Rank functions for the annotation tests: train an annotated model (strategy derived from its
``replicate``/``split`` scopes) or the same model with the equivalent hand-written strategy, and the
single-process references they are compared with."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchloom
from tests.models import lm_loss, tiny_llama, token_batches

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


# -- models ------------------------------------------------------------------------------------------
def annotated_llama(annotate: bool = True, split: str | None = None):
    """Tiny 2-layer HF Llama; stage 0 = embedding + layer 0, stage 1 = layer 1 + norm + head (function form).
    ``split="mlp"``/``"layers"``: instead, every layer's MLP / every whole decoder layer in a split(2) scope
    (the built-in Llama plan restricted to those modules)."""
    model = tiny_llama()
    if split is not None:
        for layer in model.model.layers:
            torchloom.split(layer.mlp if split == "mlp" else layer, device_count=2)
    elif annotate:
        torchloom.replicate(model.model.embed_tokens, model.model.layers[0], name="stage0")
        torchloom.replicate(model.model.layers[1], model.model.norm, model.lm_head, name="stage1")
    return model


class Classifier(nn.Module):
    """A replicated body and a split part: a Megatron MLP (fc1 colwise, fc2 rowwise) and a lone classifier
    head (colwise_gather), written with the context-manager form."""

    def __init__(self, annotate: bool = True):
        super().__init__()
        torch.manual_seed(0)
        with (torchloom.replicate(1, name="body") if annotate else _Null()):
            self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        with (torchloom.split(device_count=2) if annotate else _Null()):
            self.fc1 = nn.Linear(32, 64)
            self.fc2 = nn.Linear(64, 32)
            self.head = nn.Linear(32, 10)

    def forward(self, x, y=None):
        h = self.body(x)
        h = h + self.fc2(F.gelu(self.fc1(h)))
        return self.head(h)


class SeqNet(nn.Sequential):
    """A token model as an ``nn.Sequential`` whose ``__init__`` opens two replicate scopes (context-manager
    form): stage 0 = embed, fc1, act1; stage 1 = fc2, act2, head."""

    def __init__(self, annotate: bool = True):
        super().__init__()
        torch.manual_seed(0)
        with (torchloom.replicate(1, name="s0") if annotate else _Null()):
            self.add_module("embed", nn.Embedding(32, 16))
            self.add_module("fc1", nn.Linear(16, 32))
            self.add_module("act1", nn.Tanh())
        with (torchloom.replicate(1, name="s1") if annotate else _Null()):
            self.add_module("fc2", nn.Linear(32, 16))
            self.add_module("act2", nn.Tanh())
            self.add_module("head", nn.Linear(16, 32))


def seq_loss(batch, out):
    """Predict each token itself (enough to train): cross-entropy of (B, S, 32) logits against the ids."""
    return F.cross_entropy(out.flatten(0, 1), batch.flatten())


def seq_data(steps: int, global_batch: int) -> list[tuple[torch.Tensor]]:
    x = token_batches(steps * global_batch, seq=8, vocab=32)
    return [(x[s * global_batch:(s + 1) * global_batch],) for s in range(steps)]


CLASSIFIER_PLAN = {"fc1": "colwise", "fc2": "rowwise", "head": "colwise_gather"}


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def classifier_data(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(global_batch, 16, generator=g), torch.randint(0, 10, (global_batch,), generator=g))
            for _ in range(steps)]


def ce_loss(batch, out):
    return F.cross_entropy(out, batch[1])


# -- references --------------------------------------------------------------------------------------
def reference_classifier(steps: int, global_batch: int):
    model = Classifier(annotate=False)
    opt = SGD[0](model.parameters(), **SGD[1])
    losses = []
    for x, y in classifier_data(steps, global_batch):
        loss = ce_loss((x, y), model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


def reference_seqnet(steps: int, global_batch: int):
    model = SeqNet(annotate=False)
    opt = SGD[0](model.parameters(), **SGD[1])
    losses = []
    for (x,) in seq_data(steps, global_batch):
        loss = seq_loss(x, model(x))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.named_parameters()}


# -- rank functions ----------------------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def _run(res, batches, micro: int, to_input=lambda b: b) -> list[float]:
    """Feed this rank's share of each global batch (tuples of tensors, sliced by rows, then ``to_input``);
    per-step loss averaged over the whole global batch."""
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    losses = []
    for batch in batches:
        n = batch[0].shape[0] // dp
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            lo = r * n + k * micro
            acc += res.train_step(to_input(tuple(t[lo:lo + micro] for t in batch))).detach().float()
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return losses


def train_llama(annotated: bool, steps: int, global_batch: int, micro: int, strategy=None, split=None) -> dict:
    """Annotated Llama with ``strategy=None`` (derived), or the plain model with ``strategy``."""
    model = annotated_llama(annotate=annotated, split=split)
    res = torchloom.auto_accelerate(
        model, SGD[0], None, lm_loss, strategy=strategy, optim_args=SGD[1],
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro}, model_input_format="unpack_dict",
    )
    data = token_batches(steps * global_batch)
    batches = [(data[s * global_batch:(s + 1) * global_batch],) for s in range(steps)]
    losses = _run(res, batches, micro, to_input=lambda b: {"input_ids": b[0], "labels": b[0]})
    return {"losses": losses, "params": {n: _full(p) for n, p in res.model.named_parameters()},
            "strategy": res.strategy.to_dict(), "notes": res.notes, "mesh": res.mesh.dims.as_dict()}


def train_classifier(annotated: bool, steps: int, global_batch: int, micro: int, strategy=None) -> dict:
    model = Classifier(annotate=annotated)
    res = torchloom.auto_accelerate(
        model, SGD[0], None, ce_loss, strategy=strategy, optim_args=SGD[1],
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro}, model_input_format="unpack_sequence",
    )
    losses = _run(res, classifier_data(steps, global_batch), micro)
    return {"losses": losses, "params": {n: _full(p) for n, p in res.model.named_parameters()},
            "strategy": res.strategy.to_dict(), "notes": res.notes, "mesh": res.mesh.dims.as_dict()}


def train_seqnet(steps: int, global_batch: int, micro: int) -> dict:
    res = torchloom.auto_accelerate(
        SeqNet(), SGD[0], None, seq_loss, optim_args=SGD[1],
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro},
    )
    losses = _run(res, seq_data(steps, global_batch), micro, to_input=lambda b: b[0])
    return {"losses": losses, "params": {n: _full(p) for n, p in res.model.named_parameters()},
            "strategy": res.strategy.to_dict(), "notes": res.notes, "mesh": res.mesh.dims.as_dict()}


def run_many(configs: list[tuple[str, dict]]) -> list[dict]:
    """Several runs in one launch (a launch costs seconds): ``(function name, kwargs)`` pairs."""
    fns = {"llama": train_llama, "classifier": train_classifier, "seqnet": train_seqnet}
    out = []
    for fn, kw in configs:
        try:
            out.append(fns[fn](**kw))
        except Exception as e:
            raise RuntimeError(f"{fn} {kw} failed: {type(e).__name__}: {e}") from e
    return out
