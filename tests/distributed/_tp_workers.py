"""Rank functions for the tensor-parallel tests: train tiny Hugging Face models of several families with a
strategy; the parent compares with a single-process reference (``reference``)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import torchloom
from tests.models import full_params, tiny_gpt2, tiny_llama, token_batches

OPTIMS = {
    # SGD + momentum keeps differences at rounding level; AdamW/Adam divide by sqrt(v) (looser tolerance)
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2}),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
}


def tiny_bert(seed: int = 0):
    """BERT masked LM (hidden 64, 4 heads, 2 layers, vocab 128; decoder tied to the word embeddings)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0)
    return BertForMaskedLM(cfg)


def tiny_mistral(seed: int = 0):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def tiny_mixtral(seed: int = 0):
    """Mixtral, 4 experts, top-2 routing."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                            num_experts_per_tok=2, max_position_embeddings=64))


MODELS = {"llama": tiny_llama, "llama_tied": lambda seed=0: tiny_llama(seed, tie=True), "gpt2": tiny_gpt2,
          "bert": tiny_bert, "mistral": tiny_mistral, "mixtral": tiny_mixtral}


def lm_loss(batch, output):
    return output.loss


def logits_cross_entropy(batch, output):
    """A user loss on the logits (next-token cross-entropy with F.cross_entropy), as loss_parallel supports."""
    logits = output.logits[:, :-1]
    labels = batch["input_ids"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1))


LOSSES = {"hf": lm_loss, "logits_ce": logits_cross_entropy}


def batch_of(x: torch.Tensor, padded: bool = False) -> dict:
    """A causal-LM batch; ``padded``: every other sequence ends in 4 padding positions (attention_mask 0,
    labels -100), so a mask reaches every decoder layer as a keyword argument."""
    batch = {"input_ids": x, "labels": x}
    if padded:
        mask = torch.ones_like(x)
        mask[::2, -4:] = 0
        batch = {"input_ids": x, "attention_mask": mask, "labels": x.masked_fill(mask == 0, -100)}
    return batch


def reference(model: str = "llama", steps: int = 3, global_batch: int = 8, optim: str = "sgd", max_grad_norm=None,
              seq: int = 16, loss: str = "hf", autocast_dtype=None, eval_batch: int | None = None,
              padded: bool = False):
    """Plain single-process training, one batch of ``global_batch`` per step: losses, grad norms, params
    (and the loss of the first ``eval_batch`` sequences after training)."""
    net = MODELS[model]()
    cls, kw = OPTIMS[optim]
    opt = cls(net.parameters(), **kw)
    data = token_batches(steps * global_batch, seq=seq)
    losses, norms = [], []
    for s in range(steps):
        x = data[s * global_batch:(s + 1) * global_batch]
        batch = batch_of(x, padded)
        with torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None):
            out = LOSSES[loss](batch, net(**batch))
        out.backward()
        if max_grad_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(net.parameters(), max_grad_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(out.item())
    result = {"losses": losses, "norms": norms, "params": {k: v.detach().clone() for k, v in net.state_dict().items()}}
    if eval_batch:
        x = token_batches(eval_batch, seq=seq)
        with torch.no_grad():
            result["eval_loss"] = LOSSES[loss]({"input_ids": x, "labels": x}, net(input_ids=x, labels=x)).item()
    return result


def train_many(configs: list[dict]) -> list[dict]:
    """Several ``train`` configurations in one launch (a launch costs seconds)."""
    out = []
    for cfg in configs:
        try:
            out.append(train(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg} failed: {e}") from e
    return out


def accelerate(model: str, strategy, global_batch: int = 8, micro_batch: int = 4, optim: str = "sgd",
               max_grad_norm=None, loss: str = "hf", optim_args=None, seed: int = 0, meta: bool = False):
    """``auto_accelerate`` on a fresh tiny model (built on the meta device when ``meta``)."""
    with torch.device("meta" if meta else "cpu"):
        net = MODELS[model](seed)
    cls, kw = OPTIMS[optim]
    return torchloom.auto_accelerate(
        net, cls, None, LOSSES[loss], strategy=strategy, optim_args={**kw, **(optim_args or {})},
        dataloader_args={"batch_size": global_batch, "micro_batch_size": micro_batch},
        model_input_format="unpack_dict", max_grad_norm=max_grad_norm,
    )


def run_steps(res, steps: int, global_batch: int = 8, seq: int = 16, first: int = 0,
              padded: bool = False) -> tuple[list, list]:
    """Steps ``first .. first+steps-1`` of the fixed data: (global mean loss per step, grad norm per step)."""
    micro = res.micro_batch_size
    dp, r = res.mesh.dp_size, res.mesh.dp_rank
    data = token_batches((first + steps) * global_batch, seq=seq)
    losses, norms = [], []
    for s in range(first, first + steps):
        xs = data[s * global_batch:(s + 1) * global_batch]
        per_rank = xs[r * (global_batch // dp):(r + 1) * (global_batch // dp)]
        acc = torch.zeros(())
        for k in range(res.grad_accum_steps):
            x = per_rank[k * micro:(k + 1) * micro]
            acc += res.train_step(batch_of(x, padded))
        acc /= res.grad_accum_steps
        dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
        if res.train_step.max_grad_norm is not None:
            norms.append(res.train_step.last_grad_norm.item())
    return losses, norms


def train(strategy, model: str = "llama", steps: int = 3, global_batch: int = 8, micro_batch: int = 4,
          optim: str = "sgd", max_grad_norm=None, seq: int = 16, loss: str = "hf", optim_args=None,
          eval_loss: bool = False, meta: bool = False, padded: bool = False):
    """Per-step mean loss, grad norms, full params (every rank) and layout facts of the TP model."""
    res = accelerate(model, strategy, global_batch, micro_batch, optim, max_grad_norm, loss, optim_args, meta=meta)
    losses, norms = run_steps(res, steps, global_batch, seq, padded=padded)
    data = token_batches(micro_batch, seq=seq)
    out = {"losses": losses, "norms": norms, "params": full_params(res.model), "notes": res.notes,
           "layouts": _layouts(res.model), "optimizer_foreach": res.optimizer.defaults.get("foreach")}
    if eval_loss:
        x = data[:micro_batch]
        with torch.no_grad():
            out["eval_loss"] = res.forward_loss({"input_ids": x, "labels": x}).item()
    return out


def _layouts(model) -> dict:
    """Placements of every parameter (by name) and which tied names still share one object."""
    inner = getattr(model, "module", model)
    params = dict(inner.named_parameters(remove_duplicate=False))
    ids: dict[int, list[str]] = {}
    for n, p in params.items():
        ids.setdefault(id(p), []).append(n)
    return {
        "placements": {n: (tuple(str(x) for x in p.placements) if isinstance(p, DTensor) else None)
                       for n, p in params.items()},
        "local_shapes": {n: tuple((p.to_local() if isinstance(p, DTensor) else p).shape) for n, p in params.items()},
        "tied": sorted(sorted(v) for v in ids.values() if len(v) > 1),
    }


# ------------------------------------------------------------------ C13 (tensor-parallel part)
def c13_tp(strategies: dict[str, list]) -> dict:
    """C13 under tensor parallelism: ``clip_grad_norm_`` on fixed gradients (2-norm and inf-norm) and
    ``max_grad_norm`` training, per strategy; the parent compares with ``tests.cases._workers.c13_reference``.
    Plain (norm) and DTensor gradients mix here, unlike the FSDP cases."""
    from torch.distributed.tensor import distribute_tensor

    from tests.cases._workers import C13_GBS, C13_MAX_NORM, C13_STEPS, c13_fixed_grads, canon, full_grads, sgd
    from torchloom.parallel.grad_norm import clip_grad_norm_

    out, fixed = {}, c13_fixed_grads()
    for tag, strategy in strategies.items():
        res = torchloom.auto_accelerate(
            tiny_llama(), sgd, None, lm_loss, strategy=strategy, model_input_format="unpack_dict",
            dataloader_args={"batch_size": C13_GBS}, max_grad_norm=C13_MAX_NORM,
        )
        m, r = res.model, {}
        for norm_type in (2.0, float("inf")):
            for n, p in m.named_parameters():
                g = fixed[canon(n)].clone()
                p.grad = distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            total = clip_grad_norm_(list(m.parameters()), C13_MAX_NORM, norm_type=norm_type)
            r[norm_type] = (total.clone(), full_grads(m))
        res.optimizer.zero_grad(set_to_none=True)
        dp, rank = res.mesh.dp_size, res.mesh.dp_rank
        norms = []
        for x in token_batches(C13_STEPS * C13_GBS, seed=41).split(C13_GBS):
            xr = x[rank * (C13_GBS // dp):(rank + 1) * (C13_GBS // dp)]
            res.train_step({"input_ids": xr, "labels": xr})
            norms.append(res.train_step.last_grad_norm.clone())
        r["train"] = (torch.stack(norms), full_params(m))
        out[tag] = r
    return out


# ------------------------------------------------------------------ DCP round trip
def checkpoint_roundtrip(root: str, model: str, strategy: list, other_strategy: list) -> dict:
    """Train 2 steps with ``strategy``, save (model + optimizer + counters), load into a fresh run with
    another seed under ``strategy`` and under ``other_strategy`` (no tensor parallelism: DCP reshards),
    then take one more step everywhere. Full params at each point are returned."""
    from torchloom import checkpoint

    res = accelerate(model, strategy)
    run_steps(res, 2)
    path = checkpoint.save(root, step=2, model=res.model, optimizer=res.optimizer, train_step=res.train_step)
    out = {"saved": full_params(res.model)}
    for tag, strat in (("tp", strategy), ("other", other_strategy)):
        fresh = accelerate(model, strat, seed=7)
        out[f"{tag}_before_load"] = full_params(fresh.model)
        checkpoint.load(path, model=fresh.model, optimizer=fresh.optimizer, train_step=fresh.train_step)
        out[f"{tag}_loaded"] = full_params(fresh.model)
        out[f"{tag}_next_loss"] = run_steps(fresh, 1, first=2)[0]
        out[f"{tag}_after_step"] = full_params(fresh.model)
        out[f"{tag}_steps"] = fresh.train_step.optimizer_steps
    out["next_loss"] = run_steps(res, 1, first=2)[0]
    out["after_step"] = full_params(res.model)
    return out


# ------------------------------------------------------------------ one launch per world size
def suite(configs: list[dict], c13: dict[str, list] | None = None, checkpoint: dict | None = None,
          expect_error: list | None = None) -> dict:
    """Everything one launch checks: training configs, C13, a DCP round trip, and a strategy that must
    fail with a StrategyError (its message is returned)."""
    out = {"train": train_many(configs)}
    if c13:
        out["c13"] = c13_tp(c13)
    if checkpoint:
        out["checkpoint"] = checkpoint_roundtrip(**checkpoint)
    if expect_error:
        try:
            accelerate("llama", expect_error)
            out["error"] = None
        except torchloom.StrategyError as e:
            out["error"] = str(e)
    return out
