"""Workers for test_expert_groups: the data-parallel readers (ddp, fsdp, zero1, clipping) with expert
parameters placed by hand on ``mesh["ep"]``.

The model (:class:`ToyMoE`) has a fused experts module following ``torchloom.moe.protocol`` whose forward
computes only the experts this rank holds (no all-to-all): each rank's expert gradient then comes from its
own tokens only, and the reduction the readers must do is exactly ``sum over edp / dp`` (for dense
parameters: ``sum over dp / dp``). The single-process reference (:func:`reference`) runs every dp rank's
micro-batch with the experts that rank can see and sums the gradients / dp, for every parameter.

``_ExpertShard`` is a test-only method at stage 22 (where ``expert_parallel`` runs) that turns the experts'
parameters into DTensors ``Shard(0)`` on ``mesh["ep"]`` from this rank's own tensor (no communication: ranks
built from different seeds keep different experts, so the broadcast over edp is visible) and fills
``ctx.param_groups``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from torchloom.parallel.param_groups import EXPERT
from torchloom.strategy.registry import Method, register_method

V, H, E, K, S = 64, 16, 4, 2, 8  # vocab, hidden, experts, top-k, sequence length
LR = 0.1
MAX_NORM = 0.05  # clipping threshold of the second step (the reference norm is larger: the test asserts it)


class ToyExperts(nn.Module):
    """Fused experts ``w [E, H, H]``, ``b [E, H]``; forward per the experts-module protocol, computing only
    the experts visible on this rank (``visible`` when plain; the ep shard of a DTensor ``w``). ``drop_all``
    drops every token (case C05: a rank whose experts receive no tokens)."""

    def __init__(self, experts: int = E):
        super().__init__()
        self.num_experts = experts
        self.w = nn.Parameter(torch.empty(experts, H, H))
        self.b = nn.Parameter(torch.empty(experts, H))
        self.visible: tuple[int, int] = (0, experts)
        self.drop_all = False
        self.reset_parameters()

    def reset_parameters(self) -> None:  # also what meta-device materialisation replays
        with torch.no_grad():
            self.w.normal_(0.0, 0.3)
            self.b.normal_(0.0, 0.1)

    def forward(self, hidden, top_k_index, top_k_weights):
        w, b, (lo, hi) = self.w, self.b, self.visible
        if isinstance(w, DTensor):
            n = w.to_local().shape[0]
            mesh = w.device_mesh
            lo = (mesh.get_local_rank("ep") if mesh.ndim > 1 else mesh.get_local_rank()) * n
            hi = lo + n
            w, b = w.to_local(), b.to_local()
        else:
            w, b = w[lo:hi], b[lo:hi]
        out = torch.zeros_like(hidden)
        if self.drop_all:
            # the router still gets a (zero) gradient: with real dispatch this rank's tokens go to other ranks
            return out + 0.0 * top_k_weights.sum()
        for j in range(top_k_index.shape[1]):
            idx = top_k_index[:, j]
            for e in range(lo, hi):
                sel = idx == e
                if sel.any():
                    h = hidden[sel]
                    y = torch.tanh(h @ w[e - lo] + b[e - lo])
                    out = out.index_add(0, sel.nonzero().squeeze(1), y * top_k_weights[sel, j:j + 1])
        return out


class ToyBlock(nn.Module):
    def __init__(self, experts: int):
        super().__init__()
        self.norm = nn.LayerNorm(H)
        self.router = nn.Linear(H, experts, bias=False)
        self.experts = ToyExperts(experts)

    def forward(self, x):
        t = self.norm(x).reshape(-1, H)
        probs = torch.softmax(self.router(t), dim=-1)
        weights, index = torch.topk(probs, K, dim=-1)
        return x + self.experts(t, index, weights).reshape(x.shape)


class ToyMoE(nn.Module):
    def __init__(self, experts: int = E):
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.layers = nn.ModuleList([ToyBlock(experts), ToyBlock(experts)])
        self.head = nn.Linear(H, V)

    def forward(self, batch):
        x = self.embed(batch[:, :-1])
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def loss_fn(batch, logits):
    return nn.functional.cross_entropy(logits.reshape(-1, V), batch[:, 1:].reshape(-1))


def build(seed: int, experts: int = E) -> ToyMoE:
    torch.manual_seed(seed)
    return ToyMoE(experts)


def batches(dp: int, steps: int = 2) -> list[list[torch.Tensor]]:
    """``[step][dp rank]`` micro-batches of shape (2, S + 1)."""
    g = torch.Generator().manual_seed(99)
    return [[torch.randint(0, V, (2, S + 1), generator=g) for _ in range(dp)] for _ in range(steps)]


def expert_modules(model: nn.Module) -> list[tuple[str, ToyExperts]]:
    return [(q, m) for q, m in model.named_modules() if isinstance(m, ToyExperts)]


@register_method(override=True)
class _ExpertShard(Method):
    """Test-only stand-in for ``expert_parallel``'s placement (stage 22): experts ``Shard(0)`` on ep."""

    name = "_test_expert_shard"
    stage = 22
    mesh_dims = ("ep",)

    def apply(self, ctx) -> None:
        mesh = ctx.mesh["ep"]
        ep, r = mesh.size(), mesh.get_local_rank()
        for part in ctx.model_parts:
            for q, mod in expert_modules(part):
                for name, p in list(mod.named_parameters(recurse=False)):
                    local = p.detach().chunk(ep, dim=0)[r].clone()
                    setattr(mod, name, nn.Parameter(DTensor.from_local(local, mesh, [Shard(0)], run_check=False)))
                ctx.param_groups.add(EXPERT, q, mod)


# ------------------------------------------------------------------------------------------------ reference
def effective_model(ep: int, experts: int = E) -> ToyMoE:
    """The model the ranks train after the start-of-training broadcasts: dense parameters from rank 0 (seed
    0), ep shard ``e`` of the experts from rank ``e`` (seed ``e``: dp rank = edp_index * ep + ep_index, and
    each edp group broadcasts from its first rank)."""
    model = build(0, experts)
    n = experts // ep
    for e in range(1, ep):
        other = build(e, experts)
        for (_, m), (_, o) in zip(expert_modules(model), expert_modules(other)):
            with torch.no_grad():
                for name in ("w", "b"):
                    getattr(m, name)[e * n:(e + 1) * n] = getattr(o, name)[e * n:(e + 1) * n]
    return model


def _grads(model, batch, ep_index, ep, drop: bool):
    n = expert_modules(model)[0][1].num_experts // ep
    for _, m in expert_modules(model):
        m.visible = (ep_index * n, (ep_index + 1) * n)
        m.drop_all = drop
    model.zero_grad(set_to_none=True)
    loss_fn(batch, model(batch)).backward()
    return {k: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for k, p in model.named_parameters()}


def reference(dp: int, ep: int, drop_rank: int | None, expert_scale: float = 1.0, experts: int = E) -> dict:
    """Single-process reference of two SGD steps: every parameter's gradient is the sum of the dp ranks'
    gradients (each with its visible experts) / dp; the second step is clipped to ``MAX_NORM``.
    ``expert_scale`` multiplies the expert gradients (a wrong run: 2.0 = averaged over edp instead of dp).

    Returns ``{"grads1", "params1", "norm2", "params2"}`` (full tensors by parameter name)."""
    model = effective_model(ep, experts)
    out = {}
    for step, micro in enumerate(batches(dp)):
        per_rank = [_grads(model, micro[r], r % ep, ep, r == drop_rank) for r in range(dp)]
        grads = {k: sum(g[k] for g in per_rank) / dp for k in per_rank[0]}
        for k in grads:
            if k.endswith("experts.w") or k.endswith("experts.b"):
                grads[k] = grads[k] * expert_scale
        coef = 1.0
        if step == 1:
            norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads.values())).float()
            out["norm2"] = float(norm)
            coef = min(1.0, MAX_NORM / (float(norm) + 1e-6))
        with torch.no_grad():
            for k, p in model.named_parameters():
                p -= LR * coef * grads[k]
        if step == 0:
            out["grads1"] = grads
        out[f"params{step + 1}"] = {k: p.detach().clone() for k, p in model.named_parameters()}
    return out


# ------------------------------------------------------------------------------------------------ workers
def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().float().cpu().clone()


def _named(model) -> dict:
    inner = model.module if hasattr(model, "module") else model
    return dict(inner.named_parameters())


def _strip(name: str) -> str:
    return name.removeprefix("module.")


def _run(method: str | tuple, drop_rank: int | None, experts: int = E, meta: bool = False,
         mode: dict | None = None) -> dict:
    from torchloom import auto_accelerate
    from torchloom.parallel.loss_scaler import DynamicLossScaler
    from torchloom.parallel.param_groups import param_groups_of

    rank, dp = dist.get_rank(), dist.get_world_size()
    ep = 2
    if meta:  # every rank materialises the same model (auto_accelerate seeds 0 before applying)
        with torch.device("meta"):
            model = build(0, experts)
    else:
        model = build(rank, experts)  # different models per rank: the broadcasts must make them one model
    if rank == drop_rank:
        for _, m in expert_modules(model):
            m.drop_all = True
    res = auto_accelerate(model, torch.optim.SGD, loss_func=loss_fn, optim_args={"lr": LR},
                          strategy=[("parallel_mode", {"ep": ep, **(mode or {})}), method, "_test_expert_shard"],
                          max_grad_norm=MAX_NORM)
    groups = param_groups_of(res.model)
    out = {"groups": len(groups.members("expert")), "notes": list(res.notes)}
    params = _named(res.model)
    # after the broadcasts: each rank's local expert shard, and a dense parameter
    out["local_w0"] = next(p for k, p in params.items() if k.endswith("layers.0.experts.w")).to_local() \
        .detach().float().clone() if method == "ddp" else None
    out["start"] = {_strip(k): _full(p) for k, p in params.items()}
    out["placements"] = {_strip(k): str(p.placements) for k, p in params.items()
                         if isinstance(p, DTensor) and ".experts." in k}
    if meta:
        return out

    micro = batches(dp)
    # step 1: a plain loop (the reducer runs in the optimizer's step pre-hook), with the loss scaled by 2**10
    # and the gradients unscaled by DynamicLossScaler (exact: a power of two), which must reach the expert
    # DTensors (on ep or on the (edp, ep) mesh) as well as the dense gradients
    scaler = DynamicLossScaler(init_scale=2.0**10)
    scaler.scale_loss(loss_fn(micro[0][rank], res.model(micro[0][rank]))).backward()
    out["found_inf"] = scaler.unscale_([p for p in params.values() if p.grad is not None])
    res.optimizer.step()
    out["grads1"] = {_strip(k): _full(p.grad) for k, p in params.items() if p.grad is not None}
    out["params1"] = {_strip(k): _full(p) for k, p in params.items()}
    res.optimizer.zero_grad(set_to_none=True)
    # step 2: train_step (pre-step hooks, clipping, then optimizer.step: reduced once)
    res.train_step(micro[1][rank])
    out["norm2"] = float(res.train_step.last_grad_norm)
    out["params2"] = {_strip(k): _full(p) for k, p in params.items()}
    return out


def ddp_and_fsdp(drop_rank: int | None) -> dict:
    """One launch: ddp, fsdp, fsdp with 2 experts (edp x ep > E: sharded on dim 1), fsdp from the meta
    device, HSDP (dense 2 x 2, experts over edp), fsdp with the experts class named in wrap_cls, then zero1
    refusing experts."""
    from torchloom.errors import StrategyError

    out = {"ddp": _run("ddp", drop_rank), "fsdp": _run("fsdp", drop_rank),
           "fsdp_e2": _run("fsdp", drop_rank, experts=2), "fsdp_meta": _run("fsdp", None, meta=True),
           "hsdp": _run("fsdp", drop_rank, mode={"dp_replicate": 2, "dp_shard": 2}),
           "fsdp_wrap_experts": _run(("fsdp", {"wrap_cls": ["ToyBlock", "ToyExperts"]}), drop_rank)}
    try:
        _run("zero1", None)
        out["zero1"] = None
    except StrategyError as e:
        out["zero1"] = str(e)
    return out
