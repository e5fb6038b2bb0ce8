"""Rank functions: train a tiny model with a strategy; the parent compares with a 1-process reference."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches


OPTIMS = {
    # SGD with momentum keeps float differences at rounding level, so parameters compare tightly;
    # AdamW divides by sqrt(v) and amplifies 1e-7 gradient noise where gradients are near eps.
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
}


def reference_llama(steps: int, global_batch: int, optim: str = "sgd", tie: bool = False, max_grad_norm=None,
                    seq: int = 16, autocast_dtype=None):
    """Plain single-process training: one batch of ``global_batch`` per step."""
    model = tiny_llama(tie=tie)
    cls, kw = OPTIMS[optim]
    opt = cls(model.parameters(), **kw)
    data = token_batches(steps * global_batch, seq=seq)
    losses = []
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch]
        with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_many(configs: list[dict]) -> list[dict]:
    """Run several ``train_llama`` configurations in one launch (a launch costs seconds here)."""
    out = []
    for cfg in configs:
        try:
            out.append(train_llama(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg} failed: {e}") from e
    return out


def train_llama(strategy, steps: int, global_batch: int, micro_batch: int, optim: str = "sgd", tie: bool = False,
                max_grad_norm=None, seq: int = 16, meta: bool = False, seed_by_rank: bool = False,
                probe: bool = False):
    """Per-step mean loss (averaged over the global batch) and full params on every rank.

    ``seed_by_rank``: rank r builds its model from seed r (rank 0's is the reference model), and ``init``
    (the full parameters right after ``auto_accelerate``) is returned: the strategy must make every rank start
    from rank 0's weights. ``probe``: after training, one more forward/backward records what the methods did
    (:func:`applied`). A DDP model also returns its bucket layout (parameter names per bucket)."""
    seed = dist.get_rank() if seed_by_rank else 0
    if meta:
        with torch.device("meta"):
            model = tiny_llama(seed=seed, tie=tie)
    else:
        model = tiny_llama(seed=seed, tie=tie)
    cls, kw = OPTIMS[optim]
    res = torchloom.auto_accelerate(
        model, cls, None, lm_loss, strategy=strategy, optim_args=kw,
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict", max_grad_norm=max_grad_norm,
    )
    init = full_params(res.model) if seed_by_rank else None
    graphs_before = _dynamo_graphs()
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches(steps * global_batch, seq=seq)
    losses, grads_mid_window = [], None
    for s in range(steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        per_rank = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = per_rank[k * micro_batch:(k + 1) * micro_batch]
            acc += res.train_step({"input_ids": x, "labels": x})
            if s == 0 and k == 0 and res.grad_accum_steps > 1:
                # FSDP2 sets .grad (the reduced shard) only when it reduce-scatters: mid-window, only when
                # every micro-batch reduces (accumulate_sharded)
                grads_mid_window = any(p.grad is not None for p in res.model.parameters())
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
    out = {"losses": losses, "params": full_params(res.model), "notes": res.notes,
           "strategy": repr(res.strategy), "accum": res.grad_accum_steps, "init": init,
           "buckets": ddp_buckets(res.model), "graphs_in_training": _dynamo_graphs() - graphs_before,
           "grads_mid_window": grads_mid_window}
    if probe:
        out["applied"] = applied(res, data[:micro_batch])
    return out


def _dynamo_graphs() -> int:
    """Graphs torch.compile (Dynamo) has built in this process so far."""
    import torch._dynamo

    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def ddp_buckets(model) -> list[list[str]] | None:
    """Parameter names of each DDP gradient bucket in bucket order (the layout after DDP's rebuild at
    iteration 1), or None for a model that is not DDP."""
    if not isinstance(model, DistributedDataParallel):
        return None
    names = {id(p): n for n, p in model.module.named_parameters()}
    return [[names[id(p)] for p in b.parameters()] for b in model.reducer._get_zeros_like_grad_buckets()]


def applied(res, x: torch.Tensor) -> dict:
    """Evidence that the methods changed the model, from one extra forward/backward on ``x`` (collective;
    the optimizer does not step):

    - ``compiled``: blocks compiled in place (``nn.Module.compile`` sets ``_compiled_call_impl``; the caller
      also reports ``graphs_in_training``, the graphs Dynamo built while training);
    - ``wrapped``: blocks whose ``forward`` the ``checkpoint`` method replaced, and ``attn_calls``: calls of
      each block's attention per forward/backward (2 = recomputed in backward); not collected for compiled
      blocks (a new hook would recompile them);
    - ``unsharded_at_norm``: blocks whose parameters are plain tensors (unsharded) when the final norm runs,
      i.e. after every block's forward: FSDP ZeRO-3 has resharded them to DTensors, ZeRO-2 keeps them;
    - ``offload``: per FSDP block, whether every sharded parameter is CPU-offloaded (``FSDPParam``) and the
      group's offload policy is ``CPUOffloadPolicy``; ``shard_devices``: devices of the local shards."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule
    from torch.distributed.tensor import DTensor

    model = res.model.module if isinstance(res.model, DistributedDataParallel) else res.model
    layers = list(model.model.layers)
    ev = {"compiled": sum(getattr(b, "_compiled_call_impl", None) is not None for b in layers),
          "wrapped": sum("forward" in vars(b) for b in layers), "attn_calls": None}
    calls = [0] * len(layers)
    hooks = []
    if not ev["compiled"]:
        for i, b in enumerate(layers):
            hooks.append(b.self_attn.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1)))
    seen = {}

    def at_norm(module, args):
        seen["unsharded"] = sum(not any(isinstance(p, DTensor) for p in b.parameters()) for b in layers)

    hooks.append(model.model.norm.register_forward_pre_hook(at_norm))
    res.model(input_ids=x, labels=x).loss.backward()
    for h in hooks:
        h.remove()
    res.optimizer.zero_grad(set_to_none=True)
    ev["unsharded_at_norm"] = seen["unsharded"]
    if not ev["compiled"]:
        ev["attn_calls"] = calls
    fsdp = [b for b in layers if isinstance(b, FSDPModule)]
    groups = [b._get_fsdp_state()._fsdp_param_group for b in fsdp]
    ev["fsdp_blocks"] = len(fsdp)
    ev["offload"] = [isinstance(g.offload_policy, CPUOffloadPolicy) and all(fp.offload_to_cpu for fp in g.fsdp_params)
                     for g in groups]
    ev["shard_devices"] = sorted({str(p.to_local().device) for b in fsdp for p in b.parameters()})
    return ev
