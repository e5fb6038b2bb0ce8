"""Rank functions for tests/distributed/test_replica_consistency.py: parameters without a gradient under
DDP/FSDP, and the replica checksum. The parent compares with single-process references."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches

LR = 0.1


class BranchNet(nn.Module):
    """``body -> (+ branch when batch['branch']) -> head, aux``: ``aux`` is an output the loss may ignore,
    ``branch`` a module used on some steps (or ranks) only."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(8, 16)
        self.branch = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.aux = nn.Linear(16, 4)

    def forward(self, batch):
        h = torch.relu(self.body(batch["x"]))
        if batch["branch"]:
            h = h + self.branch(h)
        return self.head(h), self.aux(h)


def head_loss(batch, out):
    return out[0].pow(2).mean()


def both_loss(batch, out):
    return out[0].pow(2).mean() + out[1].pow(2).mean()


LOSSES = {"head": head_loss, "both": both_loss}


def branch_flag(rule: str, step: int, rank: int) -> bool:
    return {"never": False, "even_steps": step % 2 == 0, "odd_steps": step % 2 == 1, "rank0": rank == 0,
            "always": True}[rule]


def rank_batch(step: int, rank: int, rule: str) -> dict:
    g = torch.Generator().manual_seed(100 * step + rank)
    return {"x": torch.randn(4, 8, generator=g), "branch": branch_flag(rule, step, rank)}


def reference_branch_net(steps: int, world: int, rule: str, loss: str, freeze_at: int | None = None
                         ) -> dict[str, torch.Tensor]:
    """One process: each step's loss is the mean over the ranks' micro-batch losses (each with its own
    branch flag), so the gradient is the exact data-parallel average (a rank without the branch adds 0).
    ``freeze_at``: ``body`` is frozen from that step on."""
    model = BranchNet()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for s in range(steps):
        if s == freeze_at:
            model.body.requires_grad_(False)
        total = sum(LOSSES[loss](b, model(b)) for b in (rank_batch(s, r, rule) for r in range(world))) / world
        total.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_branch_net(strategy, steps: int, rule: str, loss: str, plain_loop: bool = False,
                     older_torch_fsdp: bool = False, accum: int = 1, freeze_at: int | None = None,
                     unfreeze_aux_at: int | None = None) -> dict:
    """Train BranchNet; stop at the first error. Returns the error, the optimizer steps taken and the full
    parameters (gathered under FSDP) on every rank. ``older_torch_fsdp``: build as on a torch without
    ``FSDPModule.set_reduce_scatter_unused_params`` (torchloom's post-backward fill is used instead).
    ``accum``: micro-batches per optimizer step (``steps`` and ``rule`` count micro-batches).
    ``freeze_at``: ``body.requires_grad_(False)`` after auto_accelerate, before that step;
    ``unfreeze_aux_at``: ``aux`` frozen before auto_accelerate and unfrozen before that step."""
    from torch.distributed.fsdp import FSDPModule

    model = BranchNet()
    if unfreeze_aux_at is not None:
        model.aux.requires_grad_(False)

    hidden = FSDPModule.__dict__.get("set_reduce_scatter_unused_params") if older_torch_fsdp else None
    if hidden is not None:
        delattr(FSDPModule, "set_reduce_scatter_unused_params")
    try:
        data = {"batch_size": 4 * accum * dist.get_world_size(), "micro_batch_size": 4} if accum > 1 else None
        res = torchloom.auto_accelerate(model, torch.optim.SGD, None, LOSSES[loss], strategy=strategy,
                                        optim_args={"lr": LR}, dataloader_args=data)
        assert res.grad_accum_steps == accum
    finally:
        if hidden is not None:
            FSDPModule.set_reduce_scatter_unused_params = hidden
    if older_torch_fsdp:  # the fallback really is what runs
        assert all(getattr(g, "_torchloom_zero_fill", False) for m in res.model.modules()
                   if isinstance(m, FSDPModule) for g in m._get_fsdp_state()._fsdp_param_groups)
    rank, done, error = dist.get_rank(), 0, None
    try:
        for s in range(steps):
            b = rank_batch(s, rank, rule)
            if s == freeze_at:
                model.body.requires_grad_(False)
            if s == unfreeze_aux_at:
                model.aux.requires_grad_(True)
            if plain_loop:  # backward on every micro-batch (no no_sync), a step every ``accum``
                LOSSES[loss](b, res.model(b)).backward()
                if (s + 1) % accum == 0:
                    res.optimizer.step()
                    res.optimizer.zero_grad()
            else:
                res.train_step(b)
            done += 1
    except Exception as e:  # noqa: BLE001 - the parent checks the type and message
        error = (type(e).__name__, str(e))
    return {"error": error, "steps": done, "params": full_params(res.model)}


def unused_parameter_cases(cases: list[dict]) -> list[dict]:
    """Several :func:`train_branch_net` runs in one launch."""
    return [train_branch_net(**c) for c in cases]


# ------------------------------------------------------------------------------------------ replica check
def _llama_run(strategy, steps: int, global_batch: int = 8, check_every: int | None = 1):
    model = tiny_llama()
    res = torchloom.auto_accelerate(
        model, torch.optim.SGD, None, lm_loss, strategy=strategy, optim_args={"lr": LR, "momentum": 0.9},
        dataloader_args={"batch_size": global_batch}, model_input_format="unpack_dict",
        check_replicas_every=check_every)
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches(steps * global_batch)
    per = global_batch // dp
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch][r * per:(r + 1) * per]
        res.train_step({"input_ids": x, "labels": x})
    return res


def _perturb(res, name_part: str, rank: int) -> str:
    """Add 1e-3 to one element of the first parameter whose name contains ``name_part``, on ``rank`` only
    (the local shard of a DTensor). Returns the parameter's clean name (None: not on this rank's stage)."""
    from torch.distributed.tensor import DTensor

    from torchloom.parallel.unused_params import clean_name

    found = next(((n, p) for n, p in res.model.named_parameters() if name_part in n), None)
    if found is None:  # another pipeline stage holds it
        return None
    name, p = found
    if dist.get_rank() == rank:
        with torch.no_grad():
            local = p.to_local() if isinstance(p, DTensor) else p
            local.view(-1)[0] += 1e-3
    return clean_name(name)


def _params(res) -> dict[str, torch.Tensor]:
    """Full parameters by plain name: all of them, or this rank's pipeline stages' under pipelining."""
    from torchloom.parallel.unused_params import clean_name

    if getattr(res.model, "parts", None) is None:
        return full_params(res.model)
    return {clean_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().cpu().clone()
            for n, p in res.model.named_parameters()}


def replica_check_cases(cases: list[dict]) -> list[dict]:
    """Each case: a correct run with the check every step (must pass), then one element perturbed on one
    rank: the explicit check's report, and one more train step (the monitor must raise)."""
    out = []
    for c in cases:
        res = _llama_run(c["strategy"], steps=3)
        clean = res.check_replicas(raise_error=True)  # raises on a false positive
        item = {"compared": clean.compared, "monitor_checks": res.replica_monitor.checks,
                "notes": res.notes, "params": _params(res)}
        if c.get("perturb") is not None:
            name = _perturb(res, c["perturb"], c["perturb_rank"])
            report = res.check_replicas(raise_error=False)
            item.update(perturbed=name, ok=report.ok, diverged=report.diverged, message=report.message)
            try:
                x = token_batches(8)[:8 // res.mesh.dp_size]
                res.train_step({"input_ids": x, "labels": x})
                item["monitor_error"] = None
            except Exception as e:  # noqa: BLE001
                item["monitor_error"] = (type(e).__name__, str(e))
        out.append(item)
    return out


def llama_reference(steps: int = 3, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """Single-process SGD+momentum on the same data (as ``_llama_run`` with dp ranks)."""
    model = tiny_llama()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = token_batches(steps * global_batch)
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch]
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def suite(unused: list[dict], replica: list[dict]) -> tuple[list[dict], list[dict]]:
    """Both kinds of cases in one launch (a launch costs seconds)."""
    return unused_parameter_cases(unused), replica_check_cases(replica)
