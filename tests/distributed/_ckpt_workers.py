"""Rank functions for tests/distributed/test_checkpoint_dcp.py (imported by qualified name in spawned ranks)."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

VOCAB = 128


def tiny_llama(seed: int, tie: bool = True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(cfg)


class Cursor:
    """A minimal stateful "dataloader": a per-rank position (state differs between ranks)."""

    def __init__(self, rank: int):
        self.rank, self.index = rank, 0

    def state_dict(self) -> dict:
        return {"rank": self.rank, "index": self.index}

    def load_state_dict(self, state: dict) -> None:
        self.index = state["index"]


def batch() -> torch.Tensor:
    # Draws from all three RNGs that checkpoints restore (torch, python, numpy).
    ids = torch.randint(0, VOCAB, (2, 16))
    return (ids + random.randrange(7) + int(np.random.randint(7))) % VOCAB


def train_llama(model, opt, sched, cursor, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        ids = batch()
        cursor.index += 1
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        losses.append(loss.item())
    return losses


def fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def llama_setup(seed: int, lr: float):
    model = fsdp(tiny_llama(seed))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    return model, opt, sched, Cursor(dist.get_rank())


def seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def small_net() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def train_net(net, opt, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = net(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def checkpoint_rank(tmp: str) -> dict:
    """FSDP2 resume (bitwise), save/keep_last, safetensors export, and DDP + ZeroRedundancyOptimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchloom.checkpoint import export_safetensors, load, load_safetensors, save
    from torchloom.checkpoint.state import full_model_state

    tmp_p = Path(tmp)
    root = tmp_p / "llama"
    rank = dist.get_rank()
    out: dict = {"rank": rank}

    # ---- FSDP2 Llama: train 2, save, (export), train 2 more, save again.
    seed_all(1000 + rank)
    model, opt, sched, cursor = llama_setup(seed=0, lr=1e-2)
    train_llama(model, opt, sched, cursor, 2)
    p2 = save(root, step=2, model=model, optimizer=opt, lr_scheduler=sched, dataloader=cursor,
              extra={"note": "two", "pair": (1, 2)}, scaler_state={"scale": 1024.0}, keep_last=2)
    full2 = full_model_state(model)
    osd2 = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # Copy now: cpu_offload does not copy tensors already on CPU (AdamW's "step" aliases the live state).
    osd2_state = {k: {n: t.clone() for n, t in v.items()} for k, v in osd2.get("state", {}).items()}
    osd2_lr = osd2["param_groups"][0]["lr"] if osd2 else None
    export_safetensors(model, tmp_p / "llama.safetensors")
    out["losses_a"] = train_llama(model, opt, sched, cursor, 2)
    p4 = save(root, step=4, model=model, optimizer=opt, lr_scheduler=sched, dataloader=cursor, keep_last=2)
    full_a = full_model_state(model)
    out["paths"] = [str(p2), str(p4)]

    # ---- A fresh model, optimizer, scheduler and RNG; load step 2 and redo steps 3-4.
    seed_all(55)
    model2, opt2, sched2, cursor2 = llama_setup(seed=7, lr=0.5)
    info = load(p2, model=model2, optimizer=opt2, lr_scheduler=sched2, dataloader=cursor2)
    out["info"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in info.items()}
    out["cursor_after_load"] = cursor2.index
    out["lr_after_load"] = opt2.param_groups[0]["lr"]
    out["losses_b"] = train_llama(model2, opt2, sched2, cursor2, 2)
    out["tie_after_load"] = model2.lm_head.weight is model2.model.embed_tokens.weight
    full_b = full_model_state(model2)

    # ---- The consolidated file also loads back into a sharded (FSDP2, DTensor) model.
    model3 = fsdp(tiny_llama(seed=11))
    load_safetensors(model3, tmp_p / "llama.safetensors", strict=True)
    full3 = full_model_state(model3)
    out["fsdp_tie_after_safetensors"] = model3.lm_head.weight is model3.model.embed_tokens.weight
    if rank == 0:
        out["full2"] = full2
        out["osd2_state"] = osd2_state
        out["osd2_lr"] = osd2_lr
        out["max_abs_diff"] = max((full_a[k] - full_b[k]).abs().max().item() for k in full_a)
        out["fsdp_safetensors_equal"] = full3.keys() == full2.keys() and all(torch.equal(full3[k], full2[k]) for k in full2)
        out["bitwise_equal"] = all(torch.equal(full_a[k], full_b[k]) for k in full_a) and full_a.keys() == full_b.keys()

    # ---- Failures reach every rank (no hang): a torn checkpoint, and a save that fails on one rank.
    from torchloom.checkpoint import CheckpointError

    if rank == 0:
        import shutil

        shutil.copytree(p4, tmp_p / "torn" / p4.name)
        rng1 = tmp_p / "torn" / p4.name / "rng" / "rank1.pt"
        rng1.write_bytes(rng1.read_bytes()[:-10])
    dist.barrier()
    errors = []
    for target in (tmp_p / "torn" / p4.name, tmp_p / "torn"):
        try:
            load(target, model=model2)
            errors.append(None)
        except CheckpointError as e:
            errors.append(str(e))
    try:
        save(tmp_p / "failed", step=1, model=model2, extra={"x": object()} if rank == 1 else {})
        errors.append(None)
    except CheckpointError as e:
        errors.append(str(e))
    out["errors"] = errors

    # ---- DDP + ZeroRedundancyOptimizer (consolidated into the FQN layout).
    seed_all(3 + rank)
    torch.manual_seed(3)
    net = DDP(small_net())
    zero = ZeroRedundancyOptimizer(net.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
    torch.manual_seed(30 + rank)
    train_net(net, zero, 2)
    zroot = tmp_p / "zero"
    save(zroot, step=2, model=net, optimizer=zero)
    export_safetensors(net, tmp_p / "ddp.safetensors")
    zero_params2 = {k: v.detach().clone() for k, v in net.module.state_dict().items()}
    out["zero_losses_a"] = train_net(net, zero, 1)
    params_a = {k: v.detach().clone() for k, v in net.module.state_dict().items()}

    torch.manual_seed(9)
    net2 = DDP(small_net())
    zero2 = ZeroRedundancyOptimizer(net2.parameters(), optimizer_class=torch.optim.AdamW, lr=0.3)
    load(zroot, model=net2, optimizer=zero2)
    out["zero_losses_b"] = train_net(net2, zero2, 1)
    params_b = {k: v.detach().clone() for k, v in net2.module.state_dict().items()}
    out["zero_params_equal"] = all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    if rank == 0:
        out["zero_params2"] = zero_params2
    return out
