"""Rank functions for tests/distributed/test_checkpoint_optimizer_state.py (imported by qualified name).

The scenario, under one strategy (built by ``auto_accelerate``):

* two parameter groups: the 2-D weights (AdamW lr 1e-2, weight decay 0.01) and the 1-D norm weights
  (lr 5e-3, no weight decay, other betas); ``zero1`` supports one group, so there it is a single group;
* the norm weights are frozen (``requires_grad=False``) for steps 1-2, so they never receive a gradient
  and have no optimizer state when the checkpoint is taken: the second group has no state yet;
* ``layers.0.mlp.down_proj.weight`` trains at step 1 and is frozen at step 2: a frozen parameter whose
  optimizer state must survive;
* save after step 2; unfreeze everything; steps 3-4.

A resumed run builds everything fresh (other seed, other learning rate), loads the checkpoint with
``strict=True`` and must hold the same optimizer state (every tensor bitwise, the same parameters with
state, every group's hyperparameters) and then train steps 3-4 to the same bits as the uninterrupted run.
Bitwise, because the resumed run replays the same float operations on the same bits (CPU kernels and gloo
are deterministic); a dropped AdamW state restarts its bias correction and moves a coordinate by ~lr =
1e-2, an invented state (step 1, zero moments) by a similar amount.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.distributed._ckpt_workers import seed_all, tiny_llama

FROZEN_AFTER_STEP1 = "layers.0.mlp.down_proj.weight"


def _two_groups(params, lr):
    big = [p for p in params if p.ndim >= 2]
    small = [p for p in params if p.ndim < 2]
    return torch.optim.AdamW([{"params": big}, {"params": small, "lr": lr / 2, "weight_decay": 0.0,
                                                "betas": (0.8, 0.9)}], lr=lr, weight_decay=0.01)


def build(strategy, seed: int, lr: float, groups: bool, micro: int = 2):
    import torchloom
    from tests.distributed._train_workers import lm_loss

    seed_all(seed)
    optim = (lambda params, lr: _two_groups(params, lr)) if groups else torch.optim.AdamW
    return torchloom.auto_accelerate(
        tiny_llama(seed), optim, None, lm_loss, strategy=strategy, optim_args={"lr": lr},
        dataloader_args={"batch_size": 4, "micro_batch_size": micro}, model_input_format="unpack_dict")


def _params(res, suffix: str):
    return [p for n, p in res.model.named_parameters() if n.endswith(suffix)]


def set_trainable(res, *, norms: bool, down_proj: bool) -> None:
    for n, p in res.model.named_parameters():
        if n.endswith("norm.weight"):
            p.requires_grad_(norms)
    for p in _params(res, FROZEN_AFTER_STEP1):
        p.requires_grad_(down_proj)


def train(res, steps: range) -> None:
    from tests.distributed._train_workers import token_batches

    xs = token_batches(16, seq=16)
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    for s in steps:
        x = xs[(s - 1) * 4:s * 4][r * (4 // dp):(r + 1) * (4 // dp)]
        m = res.micro_batch_size
        for k in range(res.grad_accum_steps):
            mb = x[k * m:(k + 1) * m]
            res.train_step({"input_ids": mb, "labels": mb})


def _full(v):
    if hasattr(v, "full_tensor"):
        v = v.full_tensor()
    return v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v


def _plain(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", _full(v))
    return v


def optimizer_snapshot(res) -> dict:
    """This rank's optimizer state, strategy-independent: ``{"state": {name: {key: full tensor}},
    "groups": [(sorted member names, hyperparameters)]}`` (ZeRO: the rank's local partition)."""
    from torchloom.checkpoint.state import canonical_key, is_zero_optimizer, wrapper_components

    comps = wrapper_components(res.model)
    names: dict[int, str] = {}
    for n, p in res.model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), canonical_key(n, comps))
    opts = res.optimizer if isinstance(res.optimizer, (list, tuple)) else [res.optimizer]
    opts = [o.optim if is_zero_optimizer(o) else o for o in opts]
    state, groups = {}, []
    for o in opts:
        for g in o.param_groups:
            groups.append((sorted(names[id(p)] for p in g["params"]),
                           {k: _plain(v) for k, v in sorted(g.items()) if k != "params"}))
            for p in g["params"]:
                if p in o.state and o.state[p]:
                    state[names[id(p)]] = {k: _full(v) for k, v in sorted(o.state[p].items())}
    return {"state": state, "groups": sorted(groups, key=lambda g: g[0])}


def model_snapshot(res) -> dict:
    from torchloom.checkpoint.state import canonical_key, wrapper_components

    comps = wrapper_components(res.model)
    return {canonical_key(n, comps): _full(p) for n, p in res.model.named_parameters()}


def diff(a, b, where: str = "") -> list[str]:
    """Human-readable differences between two snapshots (empty: bitwise equal)."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = [f"{where}: keys only in saved {sorted(set(a) - set(b))[:4]}, only in loaded {sorted(set(b) - set(a))[:4]}"] \
            if a.keys() != b.keys() else []
        for k in sorted(set(a) & set(b), key=str):
            out += diff(a[k], b[k], f"{where}.{k}")
        return out
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            d = (a.double() - b.double()).abs().max().item() if a.shape == b.shape else "shape"
            return [f"{where}: tensors differ (max abs diff {d})"]
        return []
    return [] if a == b else [f"{where}: {a!r} vs {b!r}"]


def case(tmp: str, strategy, groups: bool, flash: bool, micro: int = 2) -> dict:
    """One strategy: the uninterrupted run, and resumes from its checkpoint (disk, and with ``flash`` also
    from a flash snapshot in memory). Returns lists of differences (empty = pass) and the load errors."""
    from torchloom import checkpoint

    root = Path(tmp) / "ckpt"
    out: dict = {"errors": []}
    res = build(strategy, seed=0, lr=1e-2, groups=groups, micro=micro)
    set_trainable(res, norms=False, down_proj=True)
    train(res, range(1, 2))
    set_trainable(res, norms=False, down_proj=False)
    train(res, range(2, 3))
    checkpoint.save(root, step=2, model=res.model, optimizer=res.optimizer, train_step=res.train_step)
    fc = None
    if flash:
        fc = checkpoint.FlashCheckpointer(Path(tmp) / "flash", model=res.model, optimizer=res.optimizer,
                                          train_step=res.train_step, shm_dir=Path(tmp) / "shm",
                                          saver_timeout_s=120.0)
        fc.save(2, persist=False)
    saved = optimizer_snapshot(res)
    out["frozen_has_state"] = any(k.endswith(FROZEN_AFTER_STEP1) for k in saved["state"])
    out["norms_without_state"] = not any(k.endswith("norm.weight") for k in saved["state"])
    set_trainable(res, norms=True, down_proj=True)
    train(res, range(3, 5))
    final = {"model": model_snapshot(res), "optim": optimizer_snapshot(res)}
    if fc is not None:
        fc.finalize(unlink=False)

    def resumed(tag: str, frozen_at_load: bool, load) -> None:
        new = build(strategy, seed=7, lr=0.5, groups=groups, micro=micro)
        if frozen_at_load:  # the user rebuilds the freezing of the saving run, then loads
            set_trainable(new, norms=False, down_proj=False)
        try:
            load(new)
        except Exception as e:  # noqa: BLE001 - reported to the test
            out["errors"].append(f"{tag}: {type(e).__name__}: {str(e)[:400]}")
            return
        out[f"{tag}_state"] = diff(saved, optimizer_snapshot(new), tag)
        set_trainable(new, norms=True, down_proj=True)
        train(new, range(3, 5))
        out[f"{tag}_final"] = diff(final, {"model": model_snapshot(new), "optim": optimizer_snapshot(new)}, tag)

    def disk(new):
        info = checkpoint.load(root, model=new.model, optimizer=new.optimizer, train_step=new.train_step,
                               strict=True)
        assert info["step"] == 2

    resumed("disk_frozen", True, disk)  # frozen parameters frozen again before the load
    resumed("disk_trainable", False, disk)  # everything trainable at load, frozen later by the user
    if flash:
        def memory(new):
            f = checkpoint.FlashCheckpointer(Path(tmp) / "flash", model=new.model, optimizer=new.optimizer,
                                             train_step=new.train_step, shm_dir=Path(tmp) / "shm",
                                             saver_timeout_s=120.0)
            info = f.load(strict=True)
            assert info["source"] == "memory" and info["step"] == 2, info
            f.finalize(unlink=False)

        resumed("memory_frozen", True, memory)
        resumed("memory_trainable", False, memory)
    return out


def cases(tmp: str, specs: list) -> dict:
    """Several :func:`case` runs in one launch (a launch costs seconds): ``specs`` = [(name, strategy,
    groups, flash[, micro batch])]."""
    out = {}
    for name, strategy, groups, flash, *micro in specs:
        out[name] = case(str(Path(tmp) / name), strategy, groups, flash, *micro)
        dist.barrier()
    return out
