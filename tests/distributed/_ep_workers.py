"""Rank functions for the expert-parallel tests, and their one-process reference.

Reference semantics (common to issue [8]): a global batch split over ``dp`` ranks, each running its
micro-batches with gradient accumulation, equals ONE process running every rank's micro-batches one by one
and accumulating ``loss / (dp * accum)``: the load-balancing loss is computed per micro-batch, as the model
computes it (``output_router_logits=True``: ``output.loss`` includes it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchloom
from tests.models import full_params, lm_loss, tiny_moe, token_batches

LR, MOMENTUM = 0.1, 0.9  # SGD with momentum: float differences stay at rounding level
SEQ = 8


def is_expert_param(name: str) -> bool:
    return ".experts." in name and "shared_expert" not in name


def bias_router(model, bias: dict[int, list[int]] | None) -> None:
    """Make experts ``bias[layer]`` of a Mixtral-style model receive no tokens: their router logits get -1e4
    before the softmax and top-k (the router's own math otherwise; case C05). In place, on the instance."""
    import torch.nn.functional as F

    for layer, idle in (bias or {}).items():
        gate = model.model.layers[layer].mlp.gate
        offset = torch.zeros(gate.num_experts)
        offset[idle] = -1e4

        def forward(hidden_states, gate=gate, offset=offset):
            hidden_states = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hidden_states, gate.weight) + offset.to(hidden_states.device)
            probs = torch.softmax(logits.float(), dim=-1)
            top, idx = torch.topk(probs, gate.top_k, dim=-1)
            return logits, top / top.sum(dim=-1, keepdim=True), idx

        gate.forward = forward


class _Out:
    """The few output fields the workers read (``loss``; aux/router fields for the probe)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class LoomMoEBlock(torch.nn.Module):
    def __init__(self, cfg):
        from torchloom.moe import MoE

        super().__init__()
        self.norm = torch.nn.RMSNorm(cfg.dim)
        self.moe = MoE(cfg)

    def forward(self, h):
        return h + self.moe(self.norm(h))


class LoomMoELM(torch.nn.Module):
    """A tiny causal LM of :class:`torchloom.moe.MoE` blocks (no attention: the experts are what is tested):
    4 experts, top-2, capacity factor 1.0 (so some assignments are dropped: index E reaches the dispatch),
    one shared expert, load-balancing and z losses (added through the layer's autoscaler, scaled by
    ``train_step``)."""

    def __init__(self, vocab: int = 128, dim: int = 32, layers: int = 2, experts: int = 4):
        from torchloom.moe import MoEConfig

        super().__init__()
        cfg = MoEConfig(dim=dim, hidden_dim=48, num_experts=experts, top_k=2, capacity_factor=1.0,
                        num_shared_experts=1, aux_loss_weight=0.01, z_loss_weight=1e-3)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.layers = torch.nn.ModuleList(LoomMoEBlock(cfg) for _ in range(layers))
        self.norm = torch.nn.RMSNorm(dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        logits = self.head(self.norm(h))
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        aux = sum(v for b in self.layers for v in b.moe.last_aux.values())
        load = torch.stack([b.moe.last_load.float() for b in self.layers])
        return _Out(loss=loss, aux_loss=aux.detach(), router_logits=tuple(load))


def build(family: str, bias=None, seed: int = 0, **kw):
    if family == "loom_moe":
        torch.manual_seed(seed)
        return LoomMoELM(**kw)
    model = tiny_moe(family, seed=seed, **kw)
    bias_router(model, bias)
    return model


def rank_batches(steps: int, global_batch: int, dp: int, micro: int, seq: int = SEQ):
    """``batches[step][rank]`` = that rank's list of micro-batches (int64 ``[micro, seq]``)."""
    data = token_batches(steps * global_batch, seq=seq)
    per = global_batch // dp
    out = []
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        out.append([[xs[r * per + k * micro: r * per + (k + 1) * micro] for k in range(per // micro)]
                    for r in range(dp)])
    return out


def _probe_outputs(model, batches) -> list[dict]:
    """Loss, aux loss and router logits of each rank's first micro-batch of step 0 (no grad)."""
    out = []
    with torch.no_grad():
        for x in batches:
            o = model(input_ids=x, labels=x)
            routed = getattr(o, "router_logits", None)  # None without output_router_logits
            out.append({"loss": o.loss.float().item(),
                        "aux": None if o.aux_loss is None else o.aux_loss.float().item(),
                        "router": None if routed is None else torch.stack([r.float() for r in routed]).cpu()})
    return out


def reference(family: str, steps: int, global_batch: int, dp: int, micro: int, bias=None,
              autocast_dtype=None, expert_grad_scale: float = 1.0, lr: float = LR, **kw):
    """One process: every rank's micro-batches in turn, ``loss / (dp * accum)`` accumulated, SGD step.

    ``expert_grad_scale`` scales the expert gradients before each step (to build wrong runs: 2.0 is "experts
    averaged over edp=2 instead of dp=4"). Returns losses (per step, mean over the global batch), the final
    parameters, the expert gradients of the first step (after the 1/(dp*accum) scaling) and the probe
    outputs of each rank's first micro-batch after training."""
    from torchloom.moe import aux_loss_scale

    model = build(family, bias, **kw)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    batches = rank_batches(steps, global_batch, dp, micro)
    accum = global_batch // dp // micro
    losses, first_grads = [], None
    for s in range(steps):
        total = 0.0
        for r in range(dp):
            for x in batches[s][r]:
                with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
                    loss = model(input_ids=x, labels=x).loss
                with aux_loss_scale(1.0 / (dp * accum)):  # torchloom.moe layers: the main loss's factor
                    (loss / (dp * accum)).backward()
                total += loss.item()
        for n, p in model.named_parameters():
            if is_expert_param(n) and p.grad is not None:
                p.grad.mul_(expert_grad_scale)
        if first_grads is None:
            first_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if is_expert_param(n)}
        opt.step()
        opt.zero_grad()
        losses.append(total / (dp * accum))
    params = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "params": params, "grads": first_grads,
            "probe": _probe_outputs(model, [batches[0][r][0] for r in range(dp)])}


def _train_losses(res, batches, r: int, dp: int) -> list[float]:
    """Train on rank ``r``'s micro-batches of every step; the global-batch mean loss per step."""
    losses = []
    for step in batches:
        acc = torch.zeros(())
        for x in step[r]:
            acc += res.train_step({"input_ids": x, "labels": x})
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    return losses


def train_many(configs: list[dict]) -> list[dict]:
    """Several :func:`train` configurations in one launch (a launch costs seconds)."""
    out = []
    for cfg in configs:
        try:
            out.append(train(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg} failed: {e}") from e
    return out


def train(strategy, family: str, steps: int, global_batch: int, micro: int, bias=None, probe_calls: bool = False,
          meta: bool = False, **kw) -> dict:
    """Train with ``strategy`` (its parallel_mode gives ep); losses averaged over the global batch, full
    parameters, the expert gradients of the first step as the optimizer sees them (full tensors), the probe
    outputs of this rank's first micro-batch, evidence of what was applied. ``meta``: the model is built on
    the meta device (experts sharded as meta DTensors, materialised by fsdp shard by shard)."""
    from torchloom.parallel.param_groups import param_groups_of

    if meta:
        with torch.device("meta"):
            model = build(family, bias, **kw)
    else:
        model = build(family, bias, **kw)
    res = torchloom.auto_accelerate(
        model, torch.optim.SGD, None, lm_loss, strategy=strategy, optim_args={"lr": LR, "momentum": MOMENTUM},
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro}, model_input_format="unpack_dict")
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    grads: dict = {}

    def record(*_):  # an optimizer step pre-hook registered last: sees the reduced gradients
        if not grads:
            for n, p in _named(res.model):
                if is_expert_param(n):
                    g = p.grad
                    grads[n] = None if g is None else (g.full_tensor() if isinstance(g, DTensor) else g).clone()

    res.optimizer.register_step_pre_hook(record)
    batches = rank_batches(steps, global_batch, dp, micro)
    losses = _train_losses(res, batches, r, dp)
    experts = [(n, p) for n, p in _named(res.model) if is_expert_param(n)]
    placements = {n: _ep_placement(p) for n, p in experts}
    out = {"losses": losses, "params": full_params(res.model), "grads": grads, "notes": res.notes,
           "ep_placements": placements, "groups": {k: len(v) for k, v in param_groups_of(res.model).modules.items()},
           "probe": _probe_outputs(res.model, [batches[0][r][0]])[0], "rank": r, "dp": dp}
    if probe_calls:
        out["dispatches"] = count_dispatches(res, batches[0][r][0])
    return out


def _ep_placement(p) -> bool:
    """``p`` is split over the ``ep`` mesh dimension on dim 0 (the expert dimension)."""
    from torch.distributed.tensor import Shard

    if not isinstance(p, DTensor) or "ep" not in (p.device_mesh.mesh_dim_names or ()):
        return False
    return p.placements[p.device_mesh.mesh_dim_names.index("ep")] == Shard(0)


def _named(model):
    inner = getattr(model, "module", model)  # DDP
    return list(inner.named_parameters())


def count_dispatches(res, x) -> list[int]:
    """Dispatch calls per experts module in one forward/backward (2 = recomputed by activation checkpointing)."""
    mods = [m for m in getattr(res.model, "module", res.model).modules() if getattr(m, "_ep_dispatcher", None)]
    calls = [0] * len(mods)
    for i, m in enumerate(mods):
        d = m._ep_dispatcher
        inner = d.dispatch

        def counted(*a, i=i, inner=inner, **k):
            calls[i] += 1
            return inner(*a, **k)

        d.dispatch = counted
    res.model(input_ids=x, labels=x).loss.backward()
    res.optimizer.zero_grad(set_to_none=True)
    for m in mods:
        del m._ep_dispatcher.dispatch
    return calls


def pp_train(steps: int, global_batch: int, micro: int, schedule: str = "1f1b") -> dict:
    """pp=2 x dp=2 (ddp) x ep=2 on 4 ranks: a 2-layer Mixtral without the aux loss (its router logits do not
    cross pipeline stages), one layer per stage, each stage's experts split over its ep group (= its dp ranks).
    Returns the losses and this rank's stage parameters (full tensors, by name)."""
    model = build("mixtral", output_router_logits=False)
    strategy = ["ddp", "expert_parallel", ("pipeline_parallel", {"schedule": schedule, "num_microbatches": 2}),
                ("parallel_mode", {"pp": 2, "ep": 2})]
    res = torchloom.auto_accelerate(
        model, torch.optim.SGD, None, lm_loss, strategy=strategy, optim_args={"lr": LR, "momentum": MOMENTUM},
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro}, model_input_format="unpack_dict")
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    batches = rank_batches(steps, global_batch, dp, micro)
    losses = _train_losses(res, batches, r, dp)
    params = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone()
              for n, p in res.model.named_parameters()}
    experts = {n: _ep_placement(p) for n, p in res.model.named_parameters() if is_expert_param(n)}
    return {"losses": losses, "params": params, "notes": res.notes, "ep_placements": experts}
