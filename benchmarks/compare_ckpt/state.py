"""The training state every contender checkpoints: a DDP-wrapped stack of square ``nn.Linear`` layers
(fp32, no bias) with AdamW, on the gloo process group. Every rank holds the full replica (DDP), so the
checkpointed state is ``params + exp_avg + exp_avg_sq`` = 12 bytes per parameter per rank (the step
counters are negligible). A real optimizer step runs between saves (forward, backward, DDP all-reduce of
the gradients, AdamW), so the state changes and the background writers compete with training for CPU.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn as nn


@dataclass
class State:
    """The live training objects and their sizes (bytes are per rank)."""

    model: nn.Module          # the DDP wrapper
    optimizer: torch.optim.Optimizer
    width: int
    n_layers: int
    n_params: int
    state_bytes: int          # params + both AdamW moments, fp32, per rank
    batch: int


def build(gb: float, width: int = 4096, batch: int = 4) -> State:
    """Builds the DDP model (same seed on every rank, as DDP requires) and an AdamW with its state
    initialised by one step, sized so that params + AdamW moments are about ``gb`` GB (1e9 bytes)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    n_layers = max(1, round(gb * 1e9 / 12 / (width * width)))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(n_layers)])
    ddp = DDP(net)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    n_params = sum(p.numel() for p in net.parameters())
    st = State(ddp, opt, width, n_layers, n_params, n_params * 12, batch)
    assert isinstance(ddp, DDP) and dist.get_world_size() >= 1
    train_step(st, 0)                 # AdamW moments exist from here on: the full state is in place
    return st


def train_step(st: State, step: int) -> float:
    """One optimizer step on a deterministic batch (seeded by step and rank); returns the loss."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 * step + dist.get_rank())
    x = torch.randn(st.batch, st.width, generator=g)
    loss = st.model(x).pow(2).mean()
    loss.backward()
    st.optimizer.step()
    st.optimizer.zero_grad(set_to_none=True)
    return float(loss)


def fingerprint(st: State) -> str:
    """SHA-256 (first 16 hex digits) over the parameters and the AdamW moments, to check that a restore
    brought back exactly the saved state of the step it claims."""
    h = hashlib.sha256()
    net = st.model.module
    for p in net.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
        s = st.optimizer.state.get(p, {})
        for k in ("exp_avg", "exp_avg_sq"):
            if k in s:
                h.update(s[k].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
