"""Single-process replays of DDP gradient communication, for checking the comm hooks bit for bit.

:func:`replay_ddp` trains the tiny Llama of ``_train_workers.reference_llama`` as ``world`` DDP ranks
would: each simulated rank computes the gradient of its slice of the global batch, and a *combiner*
turns the per-rank gradients into the gradient every rank steps with, following the documented order of
operations of one communication scheme:

- :func:`exact_mean`: DDP's default all-reduce (``default_hooks._allreduce_fut``: divide, then sum in fp32).
- :func:`fp16_hook`: PyTorch's ``fp16_compress_hook``: round each rank's gradient to fp16, divide by the
  world size in fp16, sum in fp16 (each pairwise add rounded to fp16), cast back.
- :func:`bf16_gloo_hook`: torchloom's ``bf16_compress_hook_gloo`` (``parallel/comm_hooks.py``): round each
  rank's gradient to bf16, sum the bf16 values in fp32 in rank order, divide by the world size in fp32,
  round the mean to bf16, cast back.
- :class:`PowerSGDReplay`: PyTorch's per-tensor ``powerSGD_hook`` (error feedback, warm start,
  ``min_compression_rate`` 2, Q drawn from ``numpy.random.RandomState(0)`` seeds), bucket by bucket in the
  bucket layout the DDP run reports.

The simulated ranks run the same kernels on the same shapes as the real ones, so a replay of the right
scheme matches the multi-process run to the last bit or nearly (a 2-rank sum is commutative: no order
question); a different scheme (no compression, another rounding order, a doubled gradient) does not.
Only 2-rank replays are exact for fp16: gloo's ring order over more ranks is not replayed here.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _orthogonalize, _should_compress

from tests.models import tiny_llama, token_batches

Grads = list[list[torch.Tensor]]  # [rank][parameter]


def exact_mean(grads: Grads, names: list[str]) -> list[torch.Tensor]:
    world = len(grads)
    out = []
    for i in range(len(names)):
        total = grads[0][i] / world
        for r in range(1, world):
            total = total + grads[r][i] / world
        out.append(total)
    return out


def fp16_hook(grads: Grads, names: list[str]) -> list[torch.Tensor]:
    world = len(grads)
    out = []
    for i in range(len(names)):
        total = grads[0][i].to(torch.float16).div_(world)
        for r in range(1, world):
            total = total + grads[r][i].to(torch.float16).div_(world)  # fp16 + fp16, rounded to fp16
        out.append(total.float())
    return out


def bf16_gloo_hook(grads: Grads, names: list[str]) -> list[torch.Tensor]:
    world = len(grads)
    out = []
    for i in range(len(names)):
        total = torch.zeros_like(grads[0][i], dtype=torch.float32)
        for r in range(world):
            total += grads[r][i].to(torch.bfloat16).float()
        out.append((total / world).to(torch.bfloat16).float())
    return out


class PowerSGDReplay:
    """PyTorch's ``powerSGD_hook`` for ``world`` simulated ranks, with the state torchloom builds
    (``PowerSGDState(matrix_approximation_rank=rank, start_powerSGD_iter=start_iter, use_error_feedback=True,
    warm_start=True)``, other options default). ``buckets`` lists the parameter names of each DDP bucket in
    bucket order (``reducer._get_zeros_like_grad_buckets()`` of the real run, after DDP's rebuild)."""

    def __init__(self, buckets: list[list[str]], rank: int = 1, start_iter: int = 2, min_compression_rate=2):
        self.buckets, self.k, self.start, self.min_rate = buckets, rank, start_iter, min_compression_rate
        self.rng = np.random.RandomState(0)
        self.iter = 0
        self.error: dict[int, list[torch.Tensor]] = {}  # bucket -> per-rank flat error
        self.q_memory: dict[int, list[torch.Tensor]] = {}  # bucket -> Q of each compressed tensor

    def __call__(self, grads: Grads, names: list[str]) -> list[torch.Tensor]:
        if self.iter < self.start:
            self.iter += 1
            return exact_mean(grads, names)
        index = {n: i for i, n in enumerate(names)}
        out: list[torch.Tensor | None] = [None] * len(names)
        for b, bucket in enumerate(self.buckets):
            for n, g in zip(bucket, self._bucket(b, [[ranks[index[n]] for n in bucket] for ranks in grads])):
                out[index[n]] = g
        self.iter += 1
        assert all(g is not None for g in out), "a parameter is in no bucket"
        return out

    def _bucket(self, b: int, grads: Grads) -> list[torch.Tensor]:
        world = len(grads)
        shapes = [g.shape for g in grads[0]]
        sizes = [g.numel() for g in grads[0]]
        flat = [torch.cat([g.reshape(-1) for g in ranks]) for ranks in grads]  # the bucket buffer of each rank
        if b in self.error:
            for r in range(world):
                flat[r].add_(self.error[b][r])
        else:
            self.error[b] = [torch.zeros_like(flat[0]) for _ in range(world)]
        before = [f.clone() for f in flat]
        views = [list(torch.split(f, sizes)) for f in flat]
        mats = [[v.view(s[0], -1) for v, s in zip(vs, shapes)] for vs in views]
        compress = [_should_compress(*m.shape, min(*m.shape, self.k), self.min_rate)[0] for m in mats[0]]
        # uncompressed tensors: one all-reduce of their concatenation, then divide
        idx = [i for i, c in enumerate(compress) if not c]
        if idx:
            total = torch.cat([mats[0][i].reshape(-1) for i in idx])
            for r in range(1, world):
                total = total + torch.cat([mats[r][i].reshape(-1) for i in idx])
            total = total.div_(world)
            off = 0
            for i in idx:
                for r in range(world):
                    mats[r][i].copy_(total[off:off + sizes[i]].view_as(mats[r][i]))
                off += sizes[i]
        # compressed tensors in the hook's order: grouped by shape (first appearance), then bucket order
        groups: dict[torch.Size, list[int]] = {}
        for i, c in enumerate(compress):
            if c:
                groups.setdefault(mats[0][i].shape, []).append(i)
        order = [i for members in groups.values() for i in members]
        if b not in self.q_memory:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.rng.randint(1_000_000_000))
                qs = []
                for i in order:
                    n, m = mats[0][i].shape
                    q = torch.randn(1, m, min(n, m, self.k))
                    _orthogonalize(q, 0)
                    qs.append(q)
            self.q_memory[b] = qs
        else:
            for q in self.q_memory[b]:
                _orthogonalize(q, 0)
        qs = self.q_memory[b]
        ps = []
        for i, q in zip(order, qs):
            p = torch.bmm(mats[0][i].unsqueeze(0), q)
            for r in range(1, world):
                p = p + torch.bmm(mats[r][i].unsqueeze(0), q)
            _orthogonalize(p, 0)
            ps.append(p)
        for j, (i, p) in enumerate(zip(order, ps)):
            q = torch.bmm(mats[0][i].unsqueeze(0).transpose(1, 2), p)
            for r in range(1, world):
                q = q + torch.bmm(mats[r][i].unsqueeze(0).transpose(1, 2), p)
            qs[j] = q.div_(world)
        for i, p, q in zip(order, ps, qs):
            approx = torch.bmm(p, q.transpose(1, 2))[0]
            for r in range(world):
                mats[r][i].copy_(approx)
        for r in range(world):
            self.error[b][r] = before[r] - flat[r]
        return [v.view(s).clone() for v, s in zip(views[0], shapes)]


def replay_ddp(steps: int, global_batch: int, world: int, combine: Callable[[Grads, list[str]], list[torch.Tensor]],
               lr: float = 0.1, grad_scale: float = 1.0, seq: int = 16) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step mean losses and final parameters of ``world`` simulated DDP ranks (micro-batch = the rank's
    whole slice, SGD lr ``lr`` momentum 0.9 as ``_train_workers.OPTIMS['sgd']``). ``grad_scale`` multiplies
    the combined gradient (2.0 = a wrongly scaled run); ``lr=0`` = an untrained run."""
    model = tiny_llama()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    opt = torch.optim.SGD([p for _, p in named], lr=lr, momentum=0.9)
    data = token_batches(steps * global_batch, seq=seq)
    per = global_batch // world
    losses = []
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        grads, step_loss = [], 0.0
        for r in range(world):
            x = xs[r * per:(r + 1) * per]
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            grads.append([p.grad.detach().clone() for _, p in named])
            opt.zero_grad(set_to_none=True)
            step_loss += loss.item()
        for (_, p), g in zip(named, combine(grads, names)):
            p.grad = g * grad_scale if grad_scale != 1.0 else g
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss / world)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_param_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest absolute elementwise difference over the parameters both dicts hold."""
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
