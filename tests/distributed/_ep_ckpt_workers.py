"""Rank functions for tests/distributed/test_expert_checkpoint.py: checkpoints of models whose experts are
sharded over ``ep`` (imported by qualified name in spawned ranks).

Two ways to build the expert-parallel state. By hand (independent of ``expert_parallel``'s dispatch, so
those runs see only the checkpoint code): a tiny Mixtral whose fused experts' parameters are DTensors
``Shard(0)`` on ``mesh["ep"]``, as the ``ParamGroups`` contract describes, with

* ``fsdp``: the experts module its own FSDP unit over ``mesh["edp"]`` (placements ``(_StridedShard(0),
  Shard(0))`` on the sparse mesh), gradients divided by ``dp`` (FSDP's ``edp``, times ``1/ep`` before the
  step: gloo has no PREMUL_SUM for a divide factor); decoder layers and the root over ``dp``;
* ``ddp``: the experts left out of DDP (over ``dp``) and their gradients summed over ``edp`` and divided by
  ``dp`` before the step;
* ``plain``: one process, no process group (ep = 1).

And ``auto-fsdp`` / ``auto-ddp``: ``auto_accelerate`` with ``expert_parallel`` (its all-to-all dispatch)
and ``fsdp`` / ``ddp``, trained through ``TrainStep``.

By hand, tokens reach the experts by an all-gather over ``ep`` (each rank runs its local experts on every ep peer's
tokens; the partial outputs are summed back to their owners): slower than an all-to-all but the same
mathematics, so the gradient rules of ``ParamGroups`` (expert grads summed over edp, divided by dp) hold.

Data: the global batch of every step is ``GLOBAL`` sequences; each data-parallel rank takes its share and
runs it as micro-batches of ONE sequence with gradient accumulation, so every layout computes the same
mean over the same micro-batches (the load-balancing loss is per micro-batch) as the one-process
reference with accumulation.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from tests.models import full_params, tiny_moe, token_batches

GLOBAL, SEQ, STEPS, SAVE_AT = 4, 8, 4, 2
OPTIMS = {
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}),
}


def build_model(seed: int = 0):
    return tiny_moe("mixtral", seed=seed, experts=4, top_k=2, layers=2)


# ------------------------------------------------------------------------------ all-gather dispatch
class _GatherTokens(torch.autograd.Function):
    """Forward: concatenate every ep rank's tensor (rank order). Backward: sum the gradient over ep, keep ours."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group, ctx.n = group, x.shape[0]
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        r = dist.get_rank(ctx.group)
        return g[r * ctx.n:(r + 1) * ctx.n], None


class _SumToOwner(torch.autograd.Function):
    """Forward: sum the partial outputs over ep and keep this rank's tokens. Backward: gather the gradient."""

    @staticmethod
    def forward(ctx, y, group):
        ctx.group = group
        n = y.shape[0] // dist.get_world_size(group)
        y = y.contiguous().clone()
        dist.all_reduce(y, group=group)
        r = dist.get_rank(group)
        return y[r * n:(r + 1) * n].clone()

    @staticmethod
    def backward(ctx, g):
        parts = [torch.empty_like(g) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, g.contiguous(), group=ctx.group)
        return torch.cat(parts), None


def _ep_forward(module, group, ep_rank: int, ep: int):
    """A forward for an experts module whose parameters are DTensors Shard(0) over ep (the module's own
    forward does the math on the local expert rows)."""
    cls_forward = type(module).forward
    e_local = module.num_experts // ep
    lo = ep_rank * e_local

    def forward(hidden, top_k_index, top_k_weights):
        # hidden states and routing weights travel in ONE autograd collective: two would be free to run
        # their backward all-reduces in a different order on different ranks (routing differs) and mismatch
        k = top_k_weights.shape[1]
        hw = _GatherTokens.apply(torch.cat([hidden, top_k_weights.to(hidden.dtype)], dim=1), group)
        h, w = hw[:, :-k], hw[:, -k:].to(top_k_weights.dtype)
        idx = torch.cat(_gather_plain(top_k_index, group))
        # index e_local = "no expert"; HF's grouped_mm path masks those rows only with _is_expert_parallel
        # (else their input gradient is uninitialised memory)
        mine = (idx >= lo) & (idx < lo + e_local)
        local_idx = torch.where(mine, idx - lo, torch.full_like(idx, e_local))
        local = _LocalExperts(module, {n: p.to_local() for n, p in module.named_parameters(recurse=False)},
                              num_experts=e_local, _is_expert_parallel=True)
        return _SumToOwner.apply(cls_forward(local, h, local_idx, w), group).clone()

    return forward


class _LocalExperts:
    """The experts module seen with only its local expert rows (attributes not overridden come from it)."""

    def __init__(self, module, params: dict, **attrs):
        self.__dict__.update(params, **attrs)
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)


def _gather_plain(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _dispatch_group(ep_mesh):
    """A process group of this rank's ep peers used by the dispatch only: the mesh's own ep group can be the
    very group FSDP/DDP reduce over (the world, when ep = dp), and their asynchronous collectives issued
    in a data-dependent order would pair with the dispatch's. Every rank creates every ep group."""
    world = dist.get_world_size()
    ep = ep_mesh.size()
    mine = ep_mesh.mesh.flatten().tolist()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    made = {}
    for ranks in everyone:
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = dist.new_group(list(key))
    assert all(len(k) == ep for k in made), made
    return made[tuple(sorted(mine))]


def experts_modules(model):
    from torchloom.moe.protocol import find_experts_modules

    return find_experts_modules(model)


# ------------------------------------------------------------------------------------ layouts
class Job:
    """One model + optimizer in one layout. ``layout`` in ``fsdp``, ``ddp``, ``plain`` (built by hand, see the
    module docstring), ``auto-fsdp``, ``auto-ddp`` (``auto_accelerate`` with ``expert_parallel``)."""

    def __init__(self, layout: str, ep: int, optim: str, seed: int = 0, tp: int = 1):
        from torch.distributed.tensor import Shard, distribute_tensor

        from torchloom.parallel.mesh import ParallelDims, ParallelMesh

        self.layout, self.ep, self.res = layout, ep, None
        model = build_model(seed)
        self.expert_params: list = []
        self.expert_scale: list = []
        if layout.startswith("auto-"):
            self._accelerate(model, layout.split("-", 1)[1], ep, optim)
            return
        if layout == "plain":
            self.mesh, self.dp, self.dp_rank = None, 1, 0
        else:
            world = dist.get_world_size()
            # tp > 1 only splits the world (no tensor parallelism is applied): tp peers read the same data and
            # each rank's (edp, ep) mesh holds other ranks than its tp peer's (a per-rank sub-mesh)
            dims = (ParallelDims(dp_shard=world // tp, tp=tp, ep=ep) if layout == "fsdp"
                    else ParallelDims(dp_replicate=world, ep=ep))
            self.mesh = ParallelMesh(dims)
            self.dp, self.dp_rank = self.mesh.dp_size, self.mesh.dp_rank
            ep_mesh = self.mesh["ep"]
            if ep > 1:
                group = _dispatch_group(ep_mesh)
                for _q, m in experts_modules(model):
                    for n, p in list(m.named_parameters(recurse=False)):
                        setattr(m, n, torch.nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)])))
                    m.forward = _ep_forward(m, group, ep_mesh.get_local_rank(), ep)
            if layout == "fsdp":
                from torch.distributed.fsdp import fully_shard

                for _q, m in experts_modules(model):
                    fully_shard(m, mesh=self.mesh["edp"] if ep > 1 else self.mesh["dp"])
                # FSDP divides by edp; expert grads are divided by dp (torchloom.parallel.param_groups), the
                # remaining 1/ep is applied before the step (gloo has no PREMUL_SUM for a divide factor)
                if ep > 1:
                    self.expert_scale = [(p, 1.0 / ep) for _q, m in experts_modules(model)
                                         for p in m.parameters(recurse=False)]
                for layer in model.model.layers:
                    fully_shard(layer, mesh=self.mesh["dp"])
                fully_shard(model, mesh=self.mesh["dp"])
            else:
                from torch.nn.parallel import DistributedDataParallel as DDP

                if ep > 1:
                    self.expert_params = [p for _q, m in experts_modules(model) for p in m.parameters(recurse=False)]
                    ignore = [f"{q}.{n}" for q, m in experts_modules(model)
                              for n, _ in m.named_parameters(recurse=False)]
                    DDP._set_params_and_buffers_to_ignore_for_model(model, ignore)
                model = DDP(model, process_group=self.mesh["dp"].get_group())
        self.model = model
        cls, kw = OPTIMS[optim]
        self.opt = cls(model.parameters(), **kw)

    def _accelerate(self, model, method: str, ep: int, optim: str) -> None:
        """``auto_accelerate`` with ``expert_parallel`` (when ep > 1) and ``method`` (fsdp/ddp) over all ranks."""
        import torchloom

        world = dist.get_world_size()
        mode = {"dp_shard": world, "ep": ep} if method == "fsdp" else {"dp_replicate": world, "ep": ep}
        strategy = [("parallel_mode", mode)] + (["expert_parallel"] if ep > 1 else []) + [method]
        cls, kw = OPTIMS[optim]
        res = torchloom.auto_accelerate(
            model, cls, None, lambda batch, out: out.loss, strategy=strategy, optim_args=kw,
            dataloader_args={"batch_size": GLOBAL, "micro_batch_size": 1}, model_input_format="unpack_dict")
        self.res, self.model, self.opt, self.mesh = res, res.model, res.optimizer, res.mesh
        self.dp, self.dp_rank = res.mesh.dp_size, res.mesh.dp_rank

    def step(self, step: int) -> float:
        """Optimizer step ``step`` (1-based) on its global batch; returns the global mean loss."""
        data = token_batches(GLOBAL * STEPS, SEQ)[(step - 1) * GLOBAL: step * GLOBAL]
        per = GLOBAL // self.dp
        mine = data[self.dp_rank * per:(self.dp_rank + 1) * per]
        total = torch.zeros(())
        if self.res is not None:  # TrainStep accumulates and steps the optimizer after `per` micro-batches
            for i in range(per):
                ids = mine[i:i + 1]
                total += self.res.train_step({"input_ids": ids, "labels": ids}).detach() / per
            dist.all_reduce(total, group=self.mesh["dp"].get_group())
            return float(total / self.dp)
        for i in range(per):
            ids = mine[i:i + 1]
            loss = self.model(input_ids=ids, labels=ids).loss / per
            loss.backward()
            total += loss.detach()
        if self.expert_params:  # DDP layout: experts are outside DDP
            edp = self.mesh["edp"].get_group()
            for p in self.expert_params:
                g = p.grad.to_local()
                dist.all_reduce(g, group=edp)
                g.div_(self.dp)
        for p, scale in self.expert_scale:
            p.grad.mul_(scale)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        if self.mesh is not None:
            dist.all_reduce(total, group=self.mesh["dp"].get_group())
            total /= self.dp
        return float(total)

    def full(self) -> dict:
        return full_params(self.model)

    def optim_full(self) -> dict:
        """Every optimizer state tensor, full (DTensors gathered), keyed ``<param name>/<state name>``."""
        from torchloom.checkpoint.optimizer_state import param_names

        names = param_names(self.model)
        out = {}
        for p, st in self.opt.state.items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    v = v.full_tensor() if hasattr(v, "full_tensor") else v
                    out[f"{names[id(p)]}/{k}"] = v.detach().float().cpu().clone()
                elif isinstance(v, torch.Tensor):
                    out[f"{names[id(p)]}/{k}"] = v.detach().float().cpu().clone()
        return out


def placements(job: Job) -> list[str]:
    return sorted({f"{type(p).__name__}:{p.device_mesh.mesh_dim_names}:{p.placements}"
                   for _q, m in experts_modules(job.model) for p in m.parameters(recurse=False)
                   if hasattr(p, "placements")})


# ------------------------------------------------------------------------------------------ rank functions
def _flash(root: Path, job: Job):
    from torchloom.checkpoint.flash import FlashCheckpointer

    return FlashCheckpointer(root / "flash", model=job.model, optimizer=job.opt, shm_dir=root / "shm",
                             saver_timeout_s=120.0)


def save_job(tmp: str, name: str, layout: str, ep: int, optim: str, tp: int = 1) -> dict:
    """The uninterrupted run: STEPS steps, saving after SAVE_AT to both tiers (disk: ``<tmp>/<name>/disk``;
    flash, persisted by its savers: ``<tmp>/<name>/flash``, snapshot kept in ``<tmp>/<name>/shm``) and
    exporting the live model (``<tmp>/<name>/live.safetensors``)."""
    from torchloom import checkpoint

    root = Path(tmp) / name
    job = Job(layout, ep, optim, tp=tp)
    out = {"placements": placements(job), "losses": []}
    for s in range(1, SAVE_AT + 1):
        out["losses"].append(job.step(s))
    checkpoint.save(root / "disk", step=SAVE_AT, model=job.model, optimizer=job.opt)
    fc = _flash(root, job)
    fc.save(SAVE_AT, persist=True)
    fc.finalize(unlink=False)  # the snapshot stays for the in-memory resumes
    out["saved"], out["saved_optim"] = job.full(), job.optim_full()
    checkpoint.export_safetensors(job.model, root / "live.safetensors")  # gathered from the live shards
    for s in range(SAVE_AT + 1, STEPS + 1):
        out["losses"].append(job.step(s))
    out["final"] = job.full()
    return out


def load_job(tmp: str, source: str, tier: str, layout: str, ep: int, optim: str) -> dict:
    """A fresh model (another seed) in ``layout``/``ep`` loads ``source``'s step-SAVE_AT checkpoint from
    ``tier`` (``disk``; ``flash``: FlashCheckpointer.load, from memory when the world size is the
    snapshot's, else from the savers' disk copy; ``flash-disk``: the savers' copy with checkpoint.load),
    then trains to STEPS."""
    from torchloom import checkpoint

    root = Path(tmp) / source
    job = Job(layout, ep, optim, seed=5)
    out = {"placements": placements(job)}
    if tier == "flash":
        fc = _flash(root, job)
        info = fc.load()
        fc.finalize(unlink=False)
        out["source"] = info["source"]
    else:
        info = checkpoint.load(root / ("disk" if tier == "disk" else "flash"), model=job.model, optimizer=job.opt)
    out["step"] = info["step"]
    out["loaded"], out["loaded_optim"] = job.full(), job.optim_full()
    out["losses"] = [job.step(s) for s in range(SAVE_AT + 1, STEPS + 1)]
    out["final"] = job.full()
    return out


def run_jobs(tmp: str, jobs: list[dict]) -> list[dict]:
    """Run ``save_job``/``load_job`` for each ``{"kind": "save" | "load", **kwargs}`` in order; rank 0's
    results (full values are the same on every rank)."""
    out = []
    for j in jobs:
        j = dict(j)
        fn = save_job if j.pop("kind") == "save" else load_job
        r = fn(tmp, **j)
        out.append(r if dist.get_rank() == 0 else None)
    return out
