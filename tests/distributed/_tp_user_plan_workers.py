"""Rank functions for tensor parallelism with a *user* plan on a custom GPT-like model written in the common
style whose attention reshapes with its own head-count attribute (``q.reshape(B, T, self.n_heads, -1)``).

Attention variants (``heads_in``):
- ``"attr"``: ``self.n_heads`` (an int attribute torchloom can divide by tp);
- ``"closure"``: the head count lives in a closure (torchloom cannot see or adjust it);
- ``"tuple"``: ``self.shape = (n_heads,)`` (a tuple: not adjusted either).
``fused``: one ``qkv`` Linear (``fused_qkv`` style) chunked into q, k, v, instead of three Linears.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchloom
from tests.distributed import _tp_workers
from tests.models import full_params, tiny_llama, token_batches

VOCAB = 128
# eager attention also returns per-head attention weights (split over the tp ranks): the probe compares the
# attention output only
_tp_workers.MODELS.setdefault("llama_eager", lambda seed=0: tiny_llama(seed, attn_implementation="eager"))


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, heads_in: str = "attr", fused: bool = False):
        super().__init__()
        self.fused = fused
        if fused:
            self.qkv = nn.Linear(dim, 3 * dim)
        else:
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        if heads_in == "attr":
            self.n_heads = n_heads
            self.split = lambda t: t.reshape(*t.shape[:-1], self.n_heads, -1)
        elif heads_in == "closure":
            self.split = lambda t: t.reshape(*t.shape[:-1], n_heads, -1)
        elif heads_in == "tuple":
            self.shape = (n_heads,)
            self.split = lambda t: t.reshape(*t.shape[:-1], *self.shape, -1)
        else:
            raise ValueError(heads_in)

    def forward(self, x):
        B, T, _ = x.shape
        if self.fused:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q, k, v = self.q(x), self.k(x), self.v(x)
        q, k, v = (self.split(t).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_dim)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, dim, n_heads, **attn_kw):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = Attention(dim, n_heads, **attn_kw), MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CustomGPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, untied head. ``forward(input_ids)`` -> logits
    ``(B, T, VOCAB)``."""

    def __init__(self, dim: int = 64, n_heads: int = 4, layers: int = 2, **attn_kw):
        super().__init__()
        self.tok_emb, self.pos_emb = nn.Embedding(VOCAB, dim), nn.Embedding(64, dim)
        self.blocks = nn.ModuleList(Block(dim, n_heads, **attn_kw) for _ in range(layers))
        self.ln_f, self.head = nn.LayerNorm(dim), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.tok_emb(input_ids) + self.pos_emb(torch.arange(input_ids.size(1), device=input_ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def plan(fused: bool = False) -> dict[str, str]:
    """The user plan: q/k/v (or the fused qkv) column-wise, o row-wise, MLP fc1/fc2, vocab-parallel ends."""
    attn = ({"blocks.*.attn.qkv": "fused_qkv"} if fused else
            {f"blocks.*.attn.{n}": "colwise" for n in ("q", "k", "v")})
    return {**attn, "blocks.*.attn.o": "rowwise", "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise",
            "tok_emb": "vocab_embedding", "head": "lm_head"}


def build(seed: int = 0, **model_kw) -> CustomGPT:
    torch.manual_seed(seed)
    return CustomGPT(**model_kw)


def loss_fn(batch, logits):
    """Next-token cross-entropy over the sequence."""
    x = batch["input_ids"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def reference(steps: int = 3, global_batch: int = 8, seq: int = 16, **model_kw) -> dict:
    """Plain single-process SGD (lr 0.1, momentum 0.9): losses and parameters."""
    net = build(**model_kw)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        batch = {"input_ids": data[s * global_batch:(s + 1) * global_batch]}
        loss = loss_fn(batch, net(**batch))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach().clone() for k, v in net.state_dict().items()}}


def train(tp: int, steps: int = 3, global_batch: int = 8, seq: int = 16, tp_config: dict | None = None,
          model_kw: dict | None = None) -> dict:
    """``auto_accelerate`` with ``tensor_parallel`` and the user plan on ``tp`` of the world's ranks (the
    rest data parallel); per-step global mean loss, full params, notes and the warnings raised."""
    import warnings

    model_kw = model_kw or {}
    cfg = {"plan": plan(model_kw.get("fused", False)), **(tp_config or {})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        res = torchloom.auto_accelerate(
            build(**model_kw), torch.optim.SGD, None, loss_fn,
            strategy=[("parallel_mode", {"tp": tp}), ("tensor_parallel", cfg)],
            optim_args={"lr": 0.1, "momentum": 0.9}, dataloader_args={"batch_size": global_batch},
            model_input_format="unpack_dict",
        )
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        loss = res.train_step({"input_ids": xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]})
        loss = torch.as_tensor(loss, dtype=torch.float32).clone()
        dist.all_reduce(loss, group=res.mesh.group("dp"))
        losses.append((loss / dp).item())
    attn = res.model.blocks[0].attn
    return {"losses": losses, "params": full_params(res.model), "notes": list(res.notes),
            "warnings": [str(w.message) for w in caught if str(w.message).startswith("tensor_parallel")],
            "n_heads": getattr(attn, "n_heads", None)}


def error_of(fn, *args, **kwargs) -> str | None:
    """The message of the torchloom error ``fn`` raises (None if it returns)."""
    try:
        fn(*args, **kwargs)
    except torchloom.TorchloomError as e:  # StrategyError and friends
        return f"{type(e).__name__}: {e}"
    return None


def suite(tp: int, train_cases: dict[str, dict], error_cases: dict[str, dict],
          builtin: dict[str, dict] | None = None) -> dict:
    """One launch: every training case, every case that must stop with a torchloom error, and built-in
    plans (Hugging Face families, ``tests.distributed._tp_workers.train`` kwargs)."""
    return {"train": {name: train(tp, **kw) for name, kw in train_cases.items()},
            "errors": {name: error_of(train, tp, **kw) for name, kw in error_cases.items()},
            "builtin": {name: _tp_workers.train(**kw) for name, kw in (builtin or {}).items()}}
