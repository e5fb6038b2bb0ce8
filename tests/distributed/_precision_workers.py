"""Precision tests (amp / half): single-process replays of what each precision path computes, and the rank
functions that run the same training with ``auto_accelerate`` and record which dtypes actually ran.

A replay plays the ``dp`` ranks in one process on exactly the micro-batches they see (same shapes, so the same
low-precision kernels and roundings) and averages their gradients as DDP/FSDP do (each divided by ``dp``, then
summed: exact for dp = 2). It therefore matches a correct distributed run to fp32 rounding, while a run in
another precision, or a wrong one (no update, wrong gradient scale), is orders of magnitude further away.
"""
from __future__ import annotations

import collections
import copy
import dataclasses
import warnings

import torch
import torch.distributed as dist
from torch import nn

import torchloom
from tests.cases._workers import TinyCNN, canon, cnn_loss
from tests.models import full_params, lm_loss, tiny_llama, token_batches
from torchloom.parallel.buffers import running_stat_buffers

LR, MOMENTUM = 0.1, 0.9
STEPS, GB, DP = 3, 8, 2
LOW = torch.bfloat16


def sgd(params, lr: float = LR):
    return torch.optim.SGD(params, lr=lr, momentum=MOMENTUM)


def _micro(data, s: int, r: int, gb: int = GB, dp: int = DP):
    per = gb // dp
    return data[s * gb + r * per: s * gb + (r + 1) * per]


def _is_running_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats


def cast_params(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Parameters to ``dtype`` except those of normalisation layers with running statistics; no buffer
    changes (torchloom's ``half`` rule)."""
    keep = {id(p) for m in model.modules() if _is_running_norm(m) for p in m.parameters()}
    for p in model.parameters():
        if id(p) not in keep:
            p.data = p.data.to(dtype)
    return model


# ------------------------------------------------------------------------------------------ Llama replays
def replay_llama(mode: str, steps: int = STEPS, lr: float = LR, grad_factor: float = 1.0, precast: bool = False,
                 skip: frozenset = frozenset()):
    """Train a tiny Llama for ``steps`` SGD steps as ``DP`` data-parallel ranks would, in one process.

    mode: "fp32"; "autocast" (``torch.autocast(cpu, bf16)`` around the forward: amp without fsdp); "fsdp_mp"
    (FSDP2 MixedPrecisionPolicy: every parameter cast to bf16 for the whole forward and backward, bf16
    gradients upcast to fp32 and averaged into fp32 master weights); "half" (bf16 parameters, gradients and
    optimizer state; gradients averaged in bf16). ``grad_factor`` scales the averaged gradient (a wrongly
    scaled run, for the distance checks). ``precast``: start from the model rounded to bf16 and brought back
    to fp32 (what amp makes of a model handed in as ``model.to(torch.bfloat16)``). Returns (losses per step,
    {name: fp32 param}). ``skip``: steps whose update is dropped (as an fp16 overflow does).
    """
    model = tiny_llama()
    if precast:
        model.to(LOW).float()
    if mode == "half":
        cast_params(model, LOW)
    params = dict(model.named_parameters())
    opt = sgd(params.values(), lr)
    data = token_batches(steps * GB)
    losses = []
    for s in range(steps):
        total = {n: None for n in params}
        step_loss = 0.0
        for r in range(DP):
            x = _micro(data, s, r)
            if mode == "fsdp_mp":
                work = copy.deepcopy(model)
                cast_params(work, LOW)
            else:
                work = model
            with torch.autocast("cpu", dtype=LOW, enabled=mode == "autocast"):
                loss = work(input_ids=x, labels=x).loss.float()
            loss.backward()
            step_loss += loss.item() / DP
            for n, p in work.named_parameters():
                g = p.grad.to(params[n].dtype) / DP  # DDP and FSDP on 2 ranks: each divided by dp, then summed
                total[n] = g if total[n] is None else total[n] + g
                p.grad = None
        for n, p in params.items():
            p.grad = total[n] * grad_factor
        if s not in skip:
            opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss)
    return losses, {n: p.detach().float().clone() for n, p in params.items()}


def replay_fp16_scaler(steps: int, init_scale: float, growth_interval: int):
    """amp fp16 on ``DP`` ranks replayed with ``torch.amp.GradScaler`` (the reference semantics for dynamic
    loss scaling): scaled losses backpropagated per rank, the scaled gradients averaged, then
    ``scaler.step`` (unscale, inf check, skip) and ``scaler.update``. Returns (scale after each step,
    skipped per step, params)."""
    model = tiny_llama()
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                                  growth_interval=growth_interval)
    data = token_batches(steps * GB)
    params = dict(model.named_parameters())
    scales, skipped = [], []
    for s in range(steps):
        total = {n: None for n in params}
        for r in range(DP):
            x = _micro(data, s, r)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(input_ids=x, labels=x).loss.float()
            scaler.scale(loss).backward()
            for n, p in params.items():
                g = p.grad / DP
                total[n] = g if total[n] is None else total[n] + g
                p.grad = None
        for n, p in params.items():
            p.grad = total[n]
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        skipped.append(scaler.get_scale() < before)
        scales.append(scaler.get_scale())
        opt.zero_grad(set_to_none=True)
    return scales, skipped, {n: p.detach().clone() for n, p in params.items()}


# ------------------------------------------------------------------------------------------- dtype probes
class DtypeProbe:
    """Forward hooks on every ``nn.Linear``/conv/BatchNorm of a model: the dtypes of the input, the output and
    the weight *as the forward saw it* (under FSDP2 that is the unsharded, possibly cast, parameter)."""

    def __init__(self, model: nn.Module, types=(nn.Linear, nn.Conv2d, nn.modules.batchnorm._NormBase)):
        self.seen: dict[str, set[tuple[str, str, str]]] = {}
        self.handles = []
        for name, m in model.named_modules():
            if isinstance(m, types):
                self.handles.append(m.register_forward_hook(self._hook(canon(name))))

    def _hook(self, name):
        def hook(mod, args, out):
            x = next(a for a in args if isinstance(a, torch.Tensor))
            self.seen.setdefault(name, set()).add((str(x.dtype), str(out.dtype), str(mod.weight.dtype)))
        return hook

    def remove(self) -> dict[str, list]:
        for h in self.handles:
            h.remove()
        return {k: sorted(v) for k, v in self.seen.items()}


def _state_dtypes(res) -> dict:
    """Dtypes of master parameters, their gradients at the optimizer step and the optimizer state (local
    shards for FSDP DTensors)."""
    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    opt = res.optimizer
    return {
        "param_dtypes": sorted({str(local(p).dtype) for g in opt.param_groups for p in g["params"]}),
        "opt_state": sorted({str(local(v).dtype) for st in opt.state.values() for v in st.values()
                             if isinstance(v, torch.Tensor)}),
    }


def _record_grad_dtypes(res, into: set) -> None:
    def pre(opt, args, kwargs):
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    into.add(str((p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).dtype))
    res.optimizer.register_step_pre_hook(pre)


# --------------------------------------------------------------------------------------- rank functions
LLAMA_CONFIGS = {
    "ddp_amp": ["ddp", "amp"],
    "fsdp_amp": ["fsdp", "amp"],
    "ddp_half": ["ddp", "half"],
    # a user hands in a model already cast to bf16: amp must still train fp32 master weights
    "ddp_amp_precast": ["ddp", "amp"],
    "fsdp_amp_precast": ["fsdp", "amp"],
}


def llama_precision_runs() -> dict:
    """Each LLAMA_CONFIGS entry on this rank: per-step losses, final params, the dtypes that ran."""
    out = {}
    data = token_batches(STEPS * GB)
    for tag, strategy in LLAMA_CONFIGS.items():
        model = tiny_llama()
        if tag.endswith("_precast"):
            model.to(LOW)  # what a user does with `model.to(torch.bfloat16)` (buffers included)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = torchloom.auto_accelerate(
                model, sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
                dataloader_args={"batch_size": GB, "micro_batch_size": GB // DP},
            )
        grads: set = set()
        _record_grad_dtypes(res, grads)
        probe = DtypeProbe(res.model)
        logits_dtypes, losses = set(), []
        r = res.mesh.dp_rank
        for s in range(STEPS):
            x = _micro(data, s, r)
            out_holder = {}
            h = res.model.register_forward_hook(lambda m, a, k, o: out_holder.update(o=o), with_kwargs=True)
            loss = res.train_step({"input_ids": x, "labels": x})
            h.remove()
            o = out_holder["o"]
            logits_dtypes.add((str(o.logits.dtype), str(o.loss.dtype)))
            acc = loss.detach().clone()
            dist.all_reduce(acc)
            losses.append(acc.item() / DP)
        out[tag] = {
            "losses": losses, "params": full_params(res.model), "modules": probe.remove(),
            "outputs": sorted(logits_dtypes), "grads": sorted(grads), **_state_dtypes(res),
            "buffers": {canon(n): (str(b.dtype), b.detach().float().clone()) for n, b in res.model.named_buffers()},
            "warnings": [str(w.message) for w in caught], "notes": list(res.notes),
            "compute_dtype": str(res.compute_dtype),
        }
    return out


def fp16_scaler_run(steps: int, init_scale: float, growth_interval: int) -> dict:
    """ddp + amp fp16 with a small ``growth_interval``: the scale after every step, the skips, the params."""
    res = torchloom.auto_accelerate(
        tiny_llama(), sgd, None, lm_loss,
        strategy=["ddp", ("amp", {"dtype": "float16", "init_scale": init_scale, "growth_interval": growth_interval})],
        model_input_format="unpack_dict", dataloader_args={"batch_size": GB, "micro_batch_size": GB // DP},
    )
    data = token_batches(steps * GB)
    probe = DtypeProbe(res.model)
    scales, skipped = [], []
    for s in range(steps):
        res.train_step({"input_ids": _micro(data, s, res.mesh.dp_rank), "labels": _micro(data, s, res.mesh.dp_rank)})
        scales.append(res.loss_scaler.scale)
        skipped.append(res.train_step.last_step_skipped)
    return {"scales": scales, "skipped": skipped, "params": full_params(res.model), "modules": probe.remove(),
            "state": res.loss_scaler.state_dict()}


# --------------------------------------------------------------------------------------- BatchNorm CNN
CNN_STEPS, CNN_GB = 3, 8
CNN_CONFIGS = {
    "fsdp_amp": ["fsdp", "amp"],
    "fsdp_half": ["fsdp", "half"],
    "ddp_half": ["ddp", "half"],
    "ddp_amp": ["ddp", "amp"],
    "fsdp_amp_meta": ["fsdp", "amp"],  # built on the meta device: the fp32 units are materialised too
}


def cnn_data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(CNN_STEPS * CNN_GB, 3, 6, 6, generator=g) * 2 + 0.5
    y = torch.randint(0, 10, (CNN_STEPS * CNN_GB,), generator=g)
    return x, y


def replay_cnn(mode: str):
    """TinyCNN (conv + BatchNorm blocks) on ``DP`` ranks in one process.

    mode: "fp32"; "autocast" (amp without fsdp); "fsdp_mp" (conv and head parameters cast to bf16 for
    compute, BatchNorm kept in fp32 as its own unit; input cast to bf16; logits back to fp32; fp32 master
    weights); "half" (conv and head parameters bf16, BatchNorm parameters and statistics fp32; input in
    bf16, cast by the caller's ``prepare_input``, as half does not cast inputs). Running statistics: each rank updates them
    from its micro-batch starting from the same values, then they are averaged (torchloom's sync_buffers).
    Returns ({buffer: tensor}, {param: fp32 tensor}).
    """
    model = TinyCNN()
    if mode == "half":
        cast_params(model, LOW)
    params = dict(model.named_parameters())
    opt = sgd(params.values())
    x, y = cnn_data()
    per = CNN_GB // DP
    for s in range(CNN_STEPS):
        start = {n: b.detach().clone() for n, b in model.named_buffers()}
        ends, total = [], {n: None for n in params}
        for r in range(DP):
            lo = s * CNN_GB + r * per
            xb, yb = x[lo:lo + per], y[lo:lo + per]
            if mode == "fsdp_mp":
                work = cast_params(copy.deepcopy(model), LOW)
            else:
                work = model
            if mode in ("fsdp_mp", "half"):
                xb = xb.to(LOW)
            with torch.no_grad():
                for n, b in work.named_buffers():
                    b.copy_(start[n])
            with torch.autocast("cpu", dtype=LOW, enabled=mode == "autocast"):
                out = work(xb)
            if mode in ("fsdp_mp", "autocast"):
                out = out.float()
            torch.nn.functional.cross_entropy(out, yb).backward()
            ends.append({n: b.detach().clone() for n, b in work.named_buffers()})
            for n, p in work.named_parameters():
                g = p.grad.to(params[n].dtype) / DP
                total[n] = g if total[n] is None else total[n] + g
                p.grad = None
        with torch.no_grad():
            for n, b in model.named_buffers():
                vals = torch.stack([e[n] for e in ends])
                b.copy_(vals.double().mean(0) if b.is_floating_point() else vals.max(0).values)
        for n, p in params.items():
            p.grad = total[n]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return ({canon(n): b.detach().clone() for n, b in model.named_buffers()},
            {n: p.detach().float().clone() for n, p in params.items()})


def _bf16_images(batch, device):
    """half does not cast inputs: the user's prepare_input does (docs/methods/half.md)."""
    return {"x": batch["x"].to(device, LOW), "labels": batch["labels"].to(device)}


def cnn_precision_runs() -> dict:
    x, y = cnn_data()
    out = {}
    for tag, strategy in CNN_CONFIGS.items():
        try:
            if tag.endswith("_meta"):
                with torch.device("meta"):
                    model = TinyCNN()
            else:
                model = TinyCNN()
            res = torchloom.auto_accelerate(
                model, sgd, None, cnn_loss, strategy=strategy, model_input_format="unpack_dict",
                dataloader_args={"batch_size": CNN_GB, "micro_batch_size": CNN_GB // DP},
                prepare_input=_bf16_images if "half" in strategy else None,
            )
            probe = DtypeProbe(res.model)
            per, r = CNN_GB // DP, res.mesh.dp_rank
            for s in range(CNN_STEPS):
                lo = s * CNN_GB + r * per
                res.train_step({"x": x[lo:lo + per], "labels": y[lo:lo + per]})
            out[tag] = {"buffers": {canon(n): b.detach().clone() for n, b in res.model.named_buffers()},
                        "params": full_params(res.model), "modules": probe.remove(), "notes": list(res.notes),
                        "running": [canon(n) for n, _ in running_stat_buffers(res.model)]}
        except Exception as e:  # noqa: BLE001 - reported per configuration, so one failure does not hide the rest
            out[tag] = {"error": f"{type(e).__name__}: {e}"}
    return out


# ------------------------------------------------------------------------------------ inputs in containers
@dataclasses.dataclass
class Extra:
    scale: torch.Tensor
    steps: torch.Tensor


Pair = collections.namedtuple("Pair", "a b")


def container_batch() -> dict:
    """Floating and integer tensors inside every container kind the input rule covers."""
    f = torch.linspace(-1, 1, 8).reshape(2, 4)
    return {"x": f, "ids": torch.arange(8).reshape(2, 4), "nested": {"f": f + 1, "i": torch.ones(2, dtype=torch.int32)},
            "tup": (f * 2, torch.zeros(2, dtype=torch.long)), "lst": [f * 3], "nt": Pair(f * 4, torch.arange(2)),
            "dc": Extra(scale=f * 5, steps=torch.arange(2)), "mask": torch.ones(2, 4, dtype=torch.bool)}


class InputProbe(nn.Module):
    """Records the dtype of every tensor its forward receives (by path), then computes a loss from ``x``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen: dict[str, str] = {}

    def forward(self, batch):
        def walk(path, v):
            if isinstance(v, torch.Tensor):
                self.seen[path] = str(v.dtype)
            elif isinstance(v, dict):
                for k, w in v.items():
                    walk(f"{path}.{k}", w)
            elif dataclasses.is_dataclass(v):
                for fld in dataclasses.fields(v):
                    walk(f"{path}.{fld.name}", getattr(v, fld.name))
            elif isinstance(v, (tuple, list)):
                for i, w in enumerate(v):
                    walk(f"{path}[{i}]", w)
        walk("batch", batch)
        x = batch["x"]
        return self.lin(x.to(self.lin.weight.dtype) if x.dtype != self.lin.weight.dtype else x)


def input_dtypes(strategy) -> dict[str, str]:
    """The dtypes ``InputProbe`` receives from ``train_step(container_batch())`` under ``strategy``."""
    torch.manual_seed(0)
    model = InputProbe()
    res = torchloom.auto_accelerate(model, sgd, None, lambda b, o: o.float().pow(2).mean(), strategy=strategy)
    res.train_step(container_batch())
    return dict(model.seen)


def input_rule_runs() -> dict:
    return {tag: input_dtypes(s) for tag, s in {"fsdp_amp": ["fsdp", "amp"], "ddp_amp": ["ddp", "amp"],
                                                  "ddp_half": ["ddp", "half"]}.items()}
