"""Replica-consistency check: data-parallel replicas must hold bitwise-identical parameters.

Every data-parallel method keeps replicas identical by construction (DDP and ZeRO-1 all-reduce gradients
or broadcast updates; HSDP all-reduces shard gradients over ``dp_replicate``), and every rank then runs the
same deterministic update on the same inputs, so any difference is a bug: gradients that were never
all-reduced, a rank that skipped a step, a stray in-place write, a bad resume. This module finds one
cheaply: each rank hashes every parameter it holds into three numbers, and one ``all_gather`` per replica
group compares them (a few bytes per parameter, never the tensors).

Which ranks must agree on a parameter (the "replica group"): a plain tensor (DDP, ZeRO-1) is replicated
over the whole flattened ``dp`` group; a DTensor (FSDP2, tensor parallel) over the data-parallel mesh
dimensions on which its placement is ``Replicate()``: ``dp_replicate`` for HSDP, none for plain FSDP
(each rank holds a different shard). Tensor-parallel shards and pipeline stages differ legitimately and
are never compared.

The hash of a tensor: its bits read as integers (int32 for fp32, int16 for bf16/fp16), summed and
sum-of-squared in int64 with wrap-around, so it is exact and independent of the reduction order; plus the
float64 sum, reported in the message.
"""
from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..errors import ReplicaDivergenceError
from .mesh import ParallelMesh
from .unused_params import clean_name

log = logging.getLogger("torchloom")

_DP_DIMS = ("dp_replicate", "dp_shard")
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements hashed at once (bounds the int64 temporary)


@dataclass
class ReplicaReport:
    """Result of :func:`check_replicas`.

    Attributes:
        ok: every replica group agreed on every parameter (on this rank's groups and, through the final
            flag, on every rank's).
        compared: parameters this rank compared with at least one replica (0 = nothing is replicated).
        diverged: ``(fqn, ranks_that_differ, reference_rank)`` for each differing parameter, model order.
        message: the error text ("" when ok).
    """

    ok: bool
    compared: int
    diverged: list[tuple[str, list[int], int]] = field(default_factory=list)
    message: str = ""


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """``[int64 sum of bits, int64 sum of squared bits, float64 sum viewed as int64]`` of a (local) tensor.

    Exact: the integer sums wrap around modulo 2**64, so any reduction order gives the same value; two
    tensors with the same fingerprint are the same tensor up to an improbable collision (or a permutation
    of elements, which no training bug produces). Shape (3,), int64, on ``t``'s device.
    """
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    flat = t.contiguous().view(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]) if flat.is_floating_point() else flat
    s = torch.zeros((), dtype=torch.int64, device=flat.device)
    sq = torch.zeros((), dtype=torch.int64, device=flat.device)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    for chunk, raw in zip(bits.split(_CHUNK), flat.split(_CHUNK)):
        c = chunk.to(torch.int64)
        s += c.sum()
        sq += (c * c).sum()
        total += raw.double().sum()
    return torch.stack([s, sq, total.view(torch.int64)])


def replica_groups(modules: Iterable[nn.Module], mesh: ParallelMesh) -> dict[str, tuple[dist.ProcessGroup, list]]:
    """``{group key: (process group, [(fqn, local tensor), ...])}`` for the parameters with replicas.

    Keys are the same on every member of a group (members hold the same parameters). Parameters shared by
    several modules are listed once.
    """
    groups: dict[str, tuple[dist.ProcessGroup, list]] = {}
    seen: set[int] = set()
    for i, module in enumerate(modules):
        for name, p in module.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            key, pg, local = _replicas_of(p, mesh)
            if pg is None or dist.get_world_size(pg) < 2:
                continue
            fqn = clean_name(name) if i == 0 else f"[part {i}] {clean_name(name)}"
            groups.setdefault(key, (pg, []))[1].append((fqn, local))
    return groups


def _replicas_of(p: torch.Tensor, mesh: ParallelMesh):
    if not isinstance(p, DTensor):
        return "dp", (mesh.group("dp") if mesh.dp_size > 1 else None), p
    names = p.device_mesh.mesh_dim_names or ()
    dims = [n for n, pl in zip(names, p.placements) if n in _DP_DIMS and pl.is_replicate()]
    if not dims:
        return "", None, None
    key = "+".join(dims)
    pg = p.device_mesh.get_group(dims[0]) if len(dims) == 1 else mesh.group("dp")
    return f"dtensor:{key}", pg, p.to_local()


def check_replicas(modules: Iterable[nn.Module], mesh: ParallelMesh, device: torch.device | None = None, *,
                   raise_error: bool = True, step: int | None = None) -> ReplicaReport:
    """Compare every replicated parameter across its data-parallel replicas. A collective: every rank
    must call it at the same point (e.g. after the same optimizer step).

    Args:
        modules: the model (or its pipeline stage modules); names in the report are their FQNs.
        mesh: the job's :class:`ParallelMesh` (which ranks are replicas).
        device: where the collectives run (the job's device; needed for NCCL when parameters are
            offloaded to the CPU). Default: each group's tensors' device.
        raise_error: raise on a difference (default) instead of returning the report.
        step: the optimizer step, for the message.

    Returns:
        :class:`ReplicaReport`.

    Raises:
        ReplicaDivergenceError: (``raise_error``) a parameter differs between replicas: names the first
            one in model order, the ranks that differ and the reference rank; or the replicas hold
            different parameter lists.
    """
    if not dist.is_initialized():
        return ReplicaReport(ok=True, compared=0)
    modules = list(modules)
    groups = replica_groups(modules, mesh)
    diverged: list[tuple[str, list[int], int]] = []
    problems: list[str] = []
    compared = 0
    for key in sorted(groups):
        pg, items = groups[key]
        compared += len(items)
        dev = device if device is not None else items[0][1].device
        ranks = dist.get_process_group_ranks(pg)
        header = torch.tensor([len(items), zlib.crc32("\n".join(n for n, _ in items).encode())],
                              dtype=torch.int64, device=dev)
        headers = [h.cpu() for h in _all_gather(header, pg)]
        if any(not torch.equal(h, headers[0]) for h in headers):
            problems.append(f"the {key} replicas (ranks {ranks}) hold different parameter lists "
                            f"(counts {[int(h[0]) for h in headers]}); they were built from different models")
            continue
        local = torch.stack([fingerprint(t).to(dev) for _, t in items])
        rows = [r.cpu() for r in _all_gather(local, pg)]  # compared on the host: no sync per parameter
        for j, (name, _) in enumerate(items):
            ref = rows[0][j]
            bad = [ranks[r] for r in range(1, len(rows)) if not torch.equal(rows[r][j], ref)]
            if bad:
                diverged.append((name, bad, ranks[0]))
                if len(diverged) == 1:
                    sums = {ranks[r]: rows[r][j][2:].view(torch.float64).item() for r in [0, *range(1, len(rows))]}
                    problems.append(_divergence_text(name, bad, ranks[0], key, sums))
    # every rank learns whether any group failed, so all stop together (groups are disjoint)
    flag = torch.tensor([1 if problems else 0], dtype=torch.int64,
                        device=device if device is not None else torch.device(mesh.device_type, _index(mesh)))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    where = f" after optimizer step {step}" if step is not None else ""
    if problems:
        more = f" ({len(diverged)} parameters differ in all)" if len(diverged) > 1 else ""
        message = (f"replica check{where}: " + "; ".join(problems) + more + ". Replicas of one data-parallel "
                   "model must be bitwise identical; training on would average gradients of different models. "
                   "Resume from the last checkpoint (every replica loads the same values) and look for what "
                   "updates ranks differently: gradients that were not all-reduced, a rank-dependent in-place "
                   "write to a parameter, a step skipped on some ranks.")
    elif flag.item():
        message = f"replica check{where}: replicas differ on another rank's group (see its error)."
    else:
        message = ""
    report = ReplicaReport(ok=not message, compared=compared, diverged=diverged, message=message)
    if message and raise_error:
        raise ReplicaDivergenceError(message)
    return report


def _divergence_text(name: str, bad: list[int], ref: int, key: str, sums: dict[int, float]) -> str:
    group = "dp" if key == "dp" else key.split(":", 1)[1]
    shown = ", ".join(f"rank {r}: {v:.17g}" for r, v in list(sums.items())[:4])
    return (f"parameter {name!r} differs across its {group} replicas: rank(s) {bad} differ from rank {ref} "
            f"(float64 sums {shown})")


def _all_gather(t: torch.Tensor, pg: dist.ProcessGroup) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(pg))]
    dist.all_gather(out, t, group=pg)
    return out


def _index(mesh: ParallelMesh) -> int | None:
    if mesh.device_type == "cpu":
        return None
    mod = getattr(torch, mesh.device_type, None)
    return mod.current_device() if mod is not None and hasattr(mod, "current_device") else None


class ReplicaMonitor:
    """Runs :func:`check_replicas` after the first optimizer step and then every ``every`` steps, as an
    optimizer step post-hook (so both ``train_step`` and a plain ``optimizer.step()`` loop are covered).

    Args:
        modules / mesh / device: as :func:`check_replicas`.
        every: steps between checks (>= 1).

    Raises (from the hook): ReplicaDivergenceError on a difference.
    """

    def __init__(self, modules: Iterable[nn.Module], mesh: ParallelMesh, device: torch.device | None, every: int):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"check_replicas_every must be a positive int or None (off), got {every!r}.")
        self.modules, self.mesh, self.device, self.every = list(modules), mesh, device, every
        self.steps = 0
        self.checks = 0

    def attach(self, optimizer: torch.optim.Optimizer) -> "ReplicaMonitor":
        optimizer.register_step_post_hook(self._after_step)
        return self

    def _after_step(self, *_args) -> None:
        self.steps += 1
        if self.steps == 1 or self.steps % self.every == 0:
            self.checks += 1
            check_replicas(self.modules, self.mesh, self.device, step=self.steps)
