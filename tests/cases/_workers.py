"""Rank functions and single-process references for the failure-case tests (tests/cases/test_cXX_*.py).

Each ``cXX_*`` function runs on every rank of a :func:`torchloom.testing.run_ranks` launch and returns
picklable CPU data; the test compares it with a reference built in the pytest process (same model, data
and seed, no torchloom). Several checks share one launch because a launch costs seconds.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

import torchloom
from tests.models import full_params, lm_loss, tiny_llama, token_batches

# ------------------------------------------------------------------------------------------ helpers
_WRAPPER_PARTS = ("module.", "_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


def canon(name: str) -> str:
    """A parameter name as the plain model spells it (no DDP/compile/checkpoint wrapper components)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 CPU copy of every gradient (collective under FSDP: call on every rank)."""
    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        out[canon(n)] = g.detach().float().cpu().clone()
    return out


def record_grads(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[dict[str, torch.Tensor]]:
    """Append the full gradients seen by ``optimizer.step`` (after normalisation/clipping) to a list."""
    seen: list[dict[str, torch.Tensor]] = []
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: seen.append(full_grads(model)))
    return seen


def fsdp_units(model: nn.Module) -> list[list[str]]:
    """Names of the modules in each FSDP unit (modules sharded by one ``fully_shard`` call)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    units: dict[int, list[str]] = {}
    for n, mod in model.named_modules():
        if isinstance(mod, FSDPModule):
            units.setdefault(id(fully_shard.state(mod)), []).append(n)
    return list(units.values())


def rank_slice(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n:(rank + 1) * n]


def sgd(params, lr: float = 0.05):
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def plain_train(model: nn.Module, batches, loss_fn, opt_fn=sgd, max_grad_norm=None):
    """Reference loop: one optimizer step per batch; returns (losses, grads per step, params)."""
    opt = opt_fn([p for p in model.parameters() if p.requires_grad])
    losses, grads = [], []
    for b in batches:
        loss = loss_fn(model, b)
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def llama_loss(model, x):
    return model(input_ids=x, labels=x).loss


def accel_train(res, batches_per_rank) -> list[float]:
    """Run ``res.train_step`` over this rank's micro-batches; the global mean loss per optimizer step."""
    losses, acc, k = [], torch.zeros(()), 0
    for x in batches_per_rank:
        acc += res.train_step({"input_ids": x, "labels": x})
        k += 1
        if k == res.grad_accum_steps:
            acc /= k
            dist.all_reduce(acc, group=res.mesh.group("dp"))
            losses.append((acc / res.mesh.dp_size).item())
            acc, k = torch.zeros(()), 0
    return losses


# ------------------------------------------------------------------- C01 tied embedding and head
C01_STEPS, C01_GBS = 3, 8


def c01_batches():
    return list(token_batches(C01_STEPS * C01_GBS).split(C01_GBS))


def c01_reference():
    losses, _, params = plain_train(tiny_llama(tie=True), c01_batches(), llama_loss)
    return losses, params


def c01_tied(export_dir: str):
    """Train a tied Llama under FSDP with the default per-block units and with explicit Embedding/Linear
    units; report the tie, the params, the notes and where the consolidated export went."""
    from torchloom.checkpoint import export_safetensors

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for tag, strategy in [
        ("blocks", ["fsdp"]),
        ("explicit", [("fsdp", {"wrap_cls": ["LlamaDecoderLayer", "Embedding", "Linear"]})]),
    ]:
        model = tiny_llama(tie=True)
        res = torchloom.auto_accelerate(
            model, sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C01_GBS},
        )
        m = res.model
        tied_before = m.model.embed_tokens.weight is m.lm_head.weight
        losses = accel_train(res, [rank_slice(b, rank, world) for b in c01_batches()])
        out[tag] = {
            "tied_before": tied_before,
            "tied_after": m.model.embed_tokens.weight is m.lm_head.weight,
            "tied_local_equal": torch.equal(m.model.embed_tokens.weight.to_local(), m.lm_head.weight.to_local()),
            "losses": losses,
            "params": full_params(m),
            "notes": list(res.notes),
            "units": fsdp_units(m),
        }
        out[tag]["export"] = str(export_safetensors(m, f"{export_dir}/{tag}.safetensors"))
    return out


# ------------------------------------------------------------ C03 non-persistent buffers on meta
C03_STRATEGIES = {"fsdp": ["fsdp"], "ddp": ["ddp"], "none": None}


def c03_reference():
    """A fresh CPU build: its buffers, state dict and logits on a fixed batch."""
    model = tiny_llama()
    x = token_batches(2)
    with torch.no_grad():
        logits = model(input_ids=x).logits
    return {n: b.clone() for n, b in model.named_buffers()}, model.state_dict(), logits


def c03_meta_buffers(ref_state: dict):
    """Build the Llama on the meta device, accelerate it (fsdp / ddp / no strategy), then load the reference
    weights: every buffer afterwards, the loaded model's logits, and the names it holds as non-persistent."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    out = {}
    for tag, strategy in C03_STRATEGIES.items():
        with torch.device("meta"):
            model = tiny_llama()
        sd_keys = set(model.state_dict())
        non_persistent = sorted(n for n, _ in model.named_buffers() if n not in sd_keys)
        res = torchloom.auto_accelerate(model, sgd, None, lm_loss, strategy=strategy, seed=dist.get_rank())
        m = res.model
        buffers = {canon(n): b.detach().cpu().clone() for n, b in m.named_buffers()}
        # a copy: set_model_state_dict(full_state_dict=True) replaces the dict's values with DTensors under FSDP
        set_model_state_dict(m, dict(ref_state), options=StateDictOptions(full_state_dict=True, strict=True))
        with torch.no_grad():
            logits = m(input_ids=token_batches(2)).logits.detach().cpu()
        out[tag] = {"buffers": buffers, "non_persistent": non_persistent, "logits": logits,
                    "notes": list(res.notes)}
    return out


class TinyRotary(nn.Module):
    """A plain module whose rotary table and position ids are non-persistent buffers."""

    def __init__(self, dim: int = 8, seq: int = 16):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("freqs", self._freqs(dim), persistent=False)
        self.register_buffer("pos", torch.arange(seq), persistent=False)

    @staticmethod
    def _freqs(dim: int) -> torch.Tensor:
        return 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)

    def forward(self, x):
        angles = self.pos[: x.shape[1], None].float() * self.freqs
        return self.proj(x * torch.cat([angles.cos(), angles.sin()], -1))


class TinyRotaryWithInit(TinyRotary):
    def _init_buffers(self):
        self.freqs.copy_(self._freqs(self.freqs.numel() * 2))
        self.pos.copy_(torch.arange(self.pos.numel()))


# --------------------------------------------------------------- C04 BatchNorm under data parallel
class ConvBlock(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)
        self.bn = nn.BatchNorm2d(cout)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class TinyCNN(nn.Module):
    """Two conv+BatchNorm blocks (FSDP units) and a linear head; ``labels`` is accepted and ignored."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.blocks = nn.ModuleList([ConvBlock(3, 8), ConvBlock(8, 8)])
        self.head = nn.Linear(8, 10)

    def forward(self, x, labels=None):
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean((2, 3)))


C04_STEPS, C04_GBS = 3, 8
C04_CONFIGS = {
    # name: (strategy, micro-batch per rank)
    "hsdp": ([("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"], 2),
    "ddp_accum": (["ddp"], 1),
    "fsdp_nosync": ([("fsdp", {"sync_buffers": False})], 2),
}


def c04_data():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(C04_STEPS * C04_GBS, 3, 6, 6, generator=g) * 2 + 0.5
    y = torch.randint(0, 10, (C04_STEPS * C04_GBS,), generator=g)
    x_eval = torch.randn(4, 3, 6, 6, generator=g)
    return x, y, x_eval


def cnn_loss(batch, out):
    return torch.nn.functional.cross_entropy(out, batch["labels"])


def _stats(model: nn.Module) -> dict[str, torch.Tensor]:
    return {canon(n): b.detach().clone() for n, b in model.named_buffers()}


def c04_reference(dp: int, micro: int):
    """One process playing ``dp`` ranks: each rank's micro-batches update the running statistics from the
    step's starting value, the updates are averaged (what torchloom's sync does); gradients are the
    global-batch mean."""
    model = TinyCNN()
    opt = sgd(model.parameters())
    x, y, x_eval = c04_data()
    per_rank, accum = C04_GBS // dp, C04_GBS // dp // micro
    for s in range(C04_STEPS):
        start, ends = _stats(model), []
        for r in range(dp):
            with torch.no_grad():
                for n, b in model.named_buffers():
                    b.copy_(start[n])
            for k in range(accum):
                lo = s * C04_GBS + r * per_rank + k * micro
                out = model(x[lo:lo + micro])
                (torch.nn.functional.cross_entropy(out, y[lo:lo + micro]) / (dp * accum)).backward()
            ends.append(_stats(model))
        with torch.no_grad():
            for n, b in model.named_buffers():
                vals = torch.stack([e[n] for e in ends])
                b.copy_(vals.double().mean(0) if b.is_floating_point() else vals.max(0).values)
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        eval_out = model(x_eval)
    return _stats(model), {n: p.detach().clone() for n, p in model.named_parameters()}, eval_out


def c04_batchnorm():
    rank = dist.get_rank()
    x, y, x_eval = c04_data()
    out = {}
    for tag, (strategy, micro) in C04_CONFIGS.items():
        res = torchloom.auto_accelerate(
            TinyCNN(), sgd, None, cnn_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C04_GBS, "micro_batch_size": micro},
        )
        dp, r = res.mesh.dp_size, res.mesh.dp_rank
        per_rank = C04_GBS // dp
        for s in range(C04_STEPS):
            for k in range(res.grad_accum_steps):
                lo = s * C04_GBS + r * per_rank + k * micro
                res.train_step({"x": x[lo:lo + micro], "labels": y[lo:lo + micro]})
        res.model.eval()
        with torch.no_grad():
            eval_out = res.model(x_eval).detach().clone()
        out[tag] = {"buffers": _stats(res.model), "params": full_params(res.model), "eval": eval_out,
                    "dp": dp, "accum": res.grad_accum_steps, "notes": list(res.notes), "rank": rank}
    return out


# ------------------------------------------------------------------ C06/C07 LoRA (frozen + trainable)
class LoRALinear(nn.Module):
    """``base(x) + scale * x A^T B^T`` with a frozen ``base`` and trainable rank-``r`` factors. ``B`` starts
    non-zero (unlike the LoRA paper) so that both factors receive a gradient from the first step."""

    def __init__(self, base: nn.Linear, r: int = 4, alpha: float = 8.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(r, base.in_features) * 0.05)
        self.lora_B = nn.Parameter(torch.randn(base.out_features, r) * 0.05)
        self.scale = alpha / r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale


def lora_llama(seed: int = 0, layers: int = 2) -> nn.Module:
    """Tiny Llama, everything frozen, rank-4 adapters on every q_proj and v_proj."""
    model = tiny_llama(seed=seed, layers=layers)
    model.requires_grad_(False)
    torch.manual_seed(seed + 1)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LoRALinear(layer.self_attn.v_proj)
    return model


LORA_STEPS, LORA_GBS = 3, 8


def lora_batches():
    return list(token_batches(LORA_STEPS * LORA_GBS, seed=99).split(LORA_GBS))


def lora_reference():
    return plain_train(lora_llama(), lora_batches(), llama_loss)


def _train_lora(strategy):
    rank, world = dist.get_rank(), dist.get_world_size()
    res = torchloom.auto_accelerate(
        lora_llama(), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
        dataloader_args={"batch_size": LORA_GBS},
    )
    m = res.model
    seen = {"grads": [], "frozen_with_grad": [], "local_grad_numel": []}

    def pre_step(opt, args, kwargs):
        seen["grads"].append(full_grads(m))
        seen["frozen_with_grad"] += [n for n, p in m.named_parameters() if not p.requires_grad and p.grad is not None]
        seen["local_grad_numel"].append(sum(
            (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).numel()
            for p in m.parameters() if p.grad is not None))

    res.optimizer.register_step_pre_hook(pre_step)
    losses = accel_train(res, [rank_slice(b, rank, world) for b in lora_batches()])
    local = lambda p: p.to_local() if isinstance(p, DTensor) else p  # noqa: E731
    params = dict(m.named_parameters())
    opt_params = {id(p) for g in res.optimizer.param_groups for p in g["params"]}
    state_ids = {id(p) for p in res.optimizer.state}
    return {
        "losses": losses,
        "grads": seen["grads"],
        "frozen_with_grad": seen["frozen_with_grad"],
        "local_grad_numel": seen["local_grad_numel"],
        "local_trainable_numel": sum(local(p).numel() for p in params.values() if p.requires_grad),
        "local_frozen_numel": sum(local(p).numel() for p in params.values() if not p.requires_grad),
        "optimizer_params": sorted(canon(n) for n, p in params.items() if id(p) in opt_params),
        "optimizer_state": sorted(canon(n) for n, p in params.items() if id(p) in state_ids),
        "params": full_params(m),
        "units": fsdp_units(m),
        "notes": list(res.notes),
    }


def c06_lora():
    return _train_lora(["fsdp"])


def c07_lora_checkpoint():
    return {"checkpoint": _train_lora(["fsdp", "checkpoint"]),
            "atorch_style": _train_lora(["fsdp", ("checkpoint", ("LlamaDecoderLayer",))]),
            "plain": _train_lora(["fsdp"])}


# ----------------------------------------------------------- C08 dropout RNG across recomputation
C08_STEPS, C08_GBS, C08_SEED = 2, 8, 1000


def c08_batches():
    return list(token_batches(C08_STEPS * C08_GBS, seed=5).split(C08_GBS))


def c08_seed(step: int, rank: int, world: int) -> int:
    """The seed each rank sets before its forward (dropout masks are then a function of step and rank)."""
    return C08_SEED + step * world + rank


def c08_reference(world: int = 2):
    """One process, no checkpointing: the global gradient is the mean of each rank's shard gradient,
    each shard's forward seeded as that rank seeds it."""
    from tests.models import tiny_gpt2

    model = tiny_gpt2(dropout=0.1)
    model.train()
    opt = sgd(model.parameters())
    grads = []
    for s, batch in enumerate(c08_batches()):
        for r in range(world):
            torch.manual_seed(c08_seed(s, r, world))
            x = rank_slice(batch, r, world)
            (model(input_ids=x, labels=x).loss / world).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def c08_dropout():
    from tests.models import tiny_gpt2

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for tag, strategy in [("plain", ["fsdp"]), ("checkpoint", ["fsdp", "checkpoint"])]:
        res = torchloom.auto_accelerate(
            tiny_gpt2(dropout=0.1), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C08_GBS},
        )
        res.model.train()
        grads = record_grads(res.optimizer, res.model)
        for s, batch in enumerate(c08_batches()):
            torch.manual_seed(c08_seed(s, rank, world))
            x = rank_slice(batch, rank, world)
            res.train_step({"input_ids": x, "labels": x})
        out[tag] = {"grads": grads, "params": full_params(res.model), "notes": list(res.notes)}
    try:
        torchloom.auto_accelerate(tiny_gpt2(dropout=0.1), sgd, None, lm_loss,
                                  strategy=["fsdp", ("checkpoint", {"preserve_rng_state": False})])
        out["refused"] = None
    except torchloom.StrategyError as e:
        out["refused"] = str(e)
    return out


# ------------------------------------------------- C09 checkpointed blocks with kwargs (T5)
C09_STEPS, C09_GBS = 2, 4


def c09_batches():
    """Encoder inputs with right padding (the mask differs per row) and full-length decoder labels."""
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(C09_STEPS):
        ids = torch.randint(2, 128, (C09_GBS, 12), generator=g)
        mask = torch.ones_like(ids)
        for i, n in enumerate([12, 9, 7, 4][:C09_GBS]):
            mask[i, n:] = 0
        ids = ids * mask
        labels = torch.randint(2, 128, (C09_GBS, 8), generator=g)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _t5_rank_batch(b, rank, world):
    return {k: rank_slice(v, rank, world) for k, v in b.items()}


def c09_reference(world: int = 2):
    """One process, no checkpointing; the global gradient is the mean of the ranks' shard gradients
    (each rank's loss is the mean over its own label tokens)."""
    from tests.models import tiny_t5

    model = tiny_t5()
    opt = sgd(model.parameters())
    grads = []
    for b in c09_batches():
        for r in range(world):
            (model(**_t5_rank_batch(b, r, world)).loss / world).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad(set_to_none=True)
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def c09_t5():
    from tests.models import tiny_t5

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # the no-checkpoint run without a decoder cache does the same arithmetic as checkpointed training (which
    # drops the cache), so the two compare bit for bit; the reference keeps the default cache
    for tag, strategy, extra in [("plain_nocache", ["fsdp"], {"use_cache": False}),
                                 ("checkpoint", ["fsdp", "checkpoint"], {})]:
        res = torchloom.auto_accelerate(
            tiny_t5(), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C09_GBS},
        )
        grads = record_grads(res.optimizer, res.model)
        losses = [res.train_step({**_t5_rank_batch(b, rank, world), **extra}).item() for b in c09_batches()]
        out[tag] = {"grads": grads, "losses": losses, "params": full_params(res.model), "notes": list(res.notes)}
    return out


# --------------------------------------------------- C10 accumulation with variable token counts
C10_LENGTHS = [10, 128, 37, 64, 15, 100, 23, 77]  # rank 0 gets 239 tokens, rank 1 gets 215


def c10_batch() -> dict[str, torch.Tensor]:
    """8 sequences of 10-128 tokens, right-padded to 128; padding labels are -100."""
    ids = token_batches(len(C10_LENGTHS), seq=max(C10_LENGTHS), seed=21)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(C10_LENGTHS):
        mask[i, :n] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def c10_micro(batch, lo: int, hi: int):
    return {k: v[lo:hi] for k, v in batch.items()}


def token_sum_loss(batch, out):
    """Summed next-token cross entropy and the number of valid target tokens."""
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return torchloom.SumLoss(total, int((labels != -100).sum()))


def c10_reference():
    """One batch of 8: the loss is the sum over every valid token divided by their number."""
    model = tiny_llama()
    out = token_sum_loss(c10_batch(), model(**c10_batch()))
    (out.total / out.count).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}, out.count


def c10_accumulate(world: int = 1, rank: int = 0, strategy=None, loss_func=token_sum_loss, micro: int = 1):
    """This rank's share of the 8 sequences in micro-batches of ``micro``, through torchloom's TrainStep:
    directly (one process, ``world == 1``) or from ``auto_accelerate`` (a launched rank)."""
    model = tiny_llama()
    batch, n = c10_batch(), len(C10_LENGTHS) // world
    accum = n // micro
    if world == 1:
        opt = sgd(model.parameters())
        step = torchloom.TrainStep(model=model, optimizer=opt, loss_func=loss_func, device=torch.device("cpu"),
                                   grad_accum_steps=accum, model_input_format="unpack_dict")
    else:
        res = torchloom.auto_accelerate(
            model, sgd, None, loss_func, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": len(C10_LENGTHS), "micro_batch_size": micro},
        )
        model, opt, step = res.model, res.optimizer, res.train_step
        assert step.grad_accum_steps == accum
    grads = record_grads(opt, model)
    for k in range(accum):
        lo = rank * n + k * micro
        step(c10_micro(batch, lo, lo + micro))
    assert len(grads) == 1
    return grads[0]


def c10_ranks():
    rank, world = dist.get_rank(), dist.get_world_size()
    return {
        "ddp_sum": c10_accumulate(world, rank, None),
        "fsdp_sum": c10_accumulate(world, rank, ["fsdp"]),
        "ddp_mean": c10_accumulate(world, rank, None, loss_func=lm_loss),
    }


# ---------------------------------------------------------- C12 fp16 overflow on one rank only
C12_STEPS, C12_GBS, C12_INIT_SCALE = 3, 8, 2.0**10
C12_INJECT = "model.layers.0.mlp.down_proj.weight"


def c12_batches():
    return list(token_batches(C12_STEPS * C12_GBS, seed=31).split(C12_GBS))


def c12_reference(skip: set[int]):
    """One process, fp16 autocast with fp32 master weights and a loss scale, skipping the steps in ``skip``
    (the scale halves there, as the dynamic scaler does)."""
    model = tiny_llama()
    opt = sgd(model.parameters())
    scale, params = C12_INIT_SCALE, []
    for s, x in enumerate(c12_batches()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = model(input_ids=x, labels=x).loss
        (loss.float() * scale).backward()
        if s in skip:
            scale /= 2
        else:
            for p in model.parameters():
                p.grad.div_(scale)
            opt.step()
        opt.zero_grad(set_to_none=True)
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return params


def _poison_on_rank1(res, inject_at):
    """Wrap ``train_step.step`` so that, before unscaling, rank 1 (only) writes inf into its local shard of
    one gradient at the optimizer steps in ``inject_at`` (``"all"`` = every step)."""
    ts, rank = res.train_step, dist.get_rank()
    orig, calls = ts.step, [0]

    def step():
        if rank == 1 and (inject_at == "all" or calls[0] in inject_at):
            for n, p in res.model.named_parameters():
                if canon(n) == C12_INJECT:
                    g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    g.view(-1)[0] = float("inf")
        calls[0] += 1
        orig()

    ts.step = step


def c12_fp16_overflow():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for tag, base in [("fsdp", ["fsdp"]), ("ddp", ["ddp"])]:
        amp = ("amp", {"dtype": "float16", "init_scale": C12_INIT_SCALE})
        res = torchloom.auto_accelerate(
            tiny_llama(), sgd, None, lm_loss, strategy=[*base, amp], model_input_format="unpack_dict",
            dataloader_args={"batch_size": C12_GBS},
        )
        _poison_on_rank1(res, {1})
        steps = []
        for x in c12_batches():
            xr = rank_slice(x, rank, world)
            res.train_step({"input_ids": xr, "labels": xr})
            steps.append({"skipped": res.train_step.last_step_skipped, "scale": res.loss_scaler.scale,
                          "params": full_params(res.model)})
        out[tag] = {"steps": steps, "skipped_steps": res.loss_scaler.skipped_steps, "notes": list(res.notes)}

        # overflow at every step: the scale backs off 4 -> 2 -> 1, then hits the floor
        amp = ("amp", {"dtype": "float16", "init_scale": 4.0, "min_scale": 1.0})
        res = torchloom.auto_accelerate(
            tiny_llama(), sgd, None, lm_loss, strategy=[*base, amp], model_input_format="unpack_dict",
            dataloader_args={"batch_size": C12_GBS},
        )
        _poison_on_rank1(res, "all")
        floor = {"error": None, "at_step": None, "scale": None}
        for s, x in enumerate(c12_batches()):
            xr = rank_slice(x, rank, world)
            try:
                res.train_step({"input_ids": xr, "labels": xr})
            except torchloom.LossScaleError as e:
                floor = {"error": str(e), "at_step": s, "scale": res.loss_scaler.scale}
                break
        out[tag]["floor"] = floor
    return out


# --------------------------------------------------------- C13 global gradient-norm clipping
C13_MAX_NORM, C13_STEPS, C13_GBS = 0.5, 2, 8
C13_MESHES = {
    "fsdp4": ["fsdp"],
    "hsdp2x2": [("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"],
}


def c13_fixed_grads() -> dict[str, torch.Tensor]:
    """A fixed gradient for every parameter of ``tiny_llama()``, scales spread over 3 decades."""
    out = {}
    for i, (n, p) in enumerate(tiny_llama().named_parameters()):
        g = torch.Generator().manual_seed(100 + i)
        out[n] = torch.randn(p.shape, generator=g) * 10 ** (i % 3 - 2)
    return out


def c13_reference():
    """torch.nn.utils.clip_grad_norm_ on the plain model: (norm, clipped grads) for norm 2 and inf, and the
    per-step norms and final params of plain training with clipping."""
    out = {}
    for norm_type in (2.0, float("inf")):
        model = tiny_llama()
        for n, p in model.named_parameters():
            p.grad = c13_fixed_grads()[n].clone()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), C13_MAX_NORM, norm_type=norm_type)
        out[norm_type] = (total, {n: p.grad.clone() for n, p in model.named_parameters()})
    model = tiny_llama()
    opt, norms = sgd(model.parameters()), []
    for x in token_batches(C13_STEPS * C13_GBS, seed=41).split(C13_GBS):
        model(input_ids=x, labels=x).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), C13_MAX_NORM))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["train"] = (torch.stack(norms), {n: p.detach().clone() for n, p in model.named_parameters()})
    return out


def c13_clipping():
    from torch.distributed.tensor import distribute_tensor

    from torchloom.parallel.grad_norm import clip_grad_norm_

    out = {}
    fixed = c13_fixed_grads()
    for tag, strategy in C13_MESHES.items():
        res = torchloom.auto_accelerate(
            tiny_llama(), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C13_GBS}, max_grad_norm=C13_MAX_NORM,
        )
        m, r = res.model, {"mesh": res.mesh.dims.as_dict()}
        for norm_type in (2.0, float("inf")):
            for n, p in m.named_parameters():
                p.grad = distribute_tensor(fixed[canon(n)].clone(), p.device_mesh, p.placements)
            total = clip_grad_norm_(list(m.parameters()), C13_MAX_NORM, norm_type=norm_type)
            r[norm_type] = (total.clone(), full_grads(m))
        res.optimizer.zero_grad(set_to_none=True)
        dp, rank = res.mesh.dp_size, res.mesh.dp_rank
        norms = []
        for x in token_batches(C13_STEPS * C13_GBS, seed=41).split(C13_GBS):
            xr = rank_slice(x, rank, dp)
            res.train_step({"input_ids": xr, "labels": xr})
            norms.append(res.train_step.last_grad_norm.clone())
        r["train"] = (torch.stack(norms), full_params(m))
        out[tag] = r
    return out


# ------------------------------------------------------------------- C14 size-1 mesh dimensions
C14_STEPS, C14_GBS = 2, 8
_R2S1 = ("parallel_mode", {"dp_replicate": 2, "dp_shard": 1})
C14_CONFIGS = {
    # name: (strategy, micro-batch per rank, max_grad_norm)
    "ddp": (["ddp"], 4, None),
    "hsdp_2x1": ([_R2S1, "fsdp"], 4, None),
    "hsdp_2x1_accum_clip": ([_R2S1, "fsdp"], 2, 0.5),
    "ddp_2x1": ([_R2S1, "ddp"], 4, None),
    "zero1_2x1": ([_R2S1, "zero1"], 4, None),
    "fsdp_1x2": ([("parallel_mode", {"dp_replicate": 1, "dp_shard": 2}), "fsdp"], 4, None),
}


def c14_batches():
    return list(token_batches(C14_STEPS * C14_GBS, seed=51).split(C14_GBS))


def c14_reference(max_grad_norm=None):
    return plain_train(tiny_llama(), c14_batches(), llama_loss, max_grad_norm=max_grad_norm)


def c14_size_one():
    out = {}
    for tag, (strategy, micro, clip) in C14_CONFIGS.items():
        res = torchloom.auto_accelerate(
            tiny_llama(), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C14_GBS, "micro_batch_size": micro}, max_grad_norm=clip,
        )
        grads = record_grads(res.optimizer, res.model)
        dp, r = res.mesh.dp_size, res.mesh.dp_rank
        micro_batches = [mb for b in c14_batches() for mb in rank_slice(b, r, dp).split(micro)]
        losses = accel_train(res, micro_batches)
        out[tag] = {"mesh": res.mesh.dims.as_dict(), "accum": res.grad_accum_steps, "losses": losses,
                    "grads": grads, "params": full_params(res.model), "notes": list(res.notes)}
    return out
