"""Rank functions for the pipeline-parallel tests, and the single-process references they are compared with.

A run is described by a dict (see :func:`pp_train`). Its data is a list of optimizer steps, each a list of
``dp x grad_accum`` micro-batch dicts (``input_ids``, ``labels``, optional ``attention_mask`` /
``position_ids``) in data-parallel-major order: rank ``r`` feeds micro-batches ``r*accum .. (r+1)*accum-1`` to
``train_step``. The pipeline cuts each micro-batch into ``num_microbatches`` equal row chunks ("atoms") and
averages their mean losses, so the reference averages the same atoms' losses (identical to the full-batch mean
when every atom has the same number of valid tokens).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import torchloom
from tests.models import lm_loss, tiny_gpt2, tiny_llama, token_batches

SGD = (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})


def _token_sums(batch, output):
    """Summed next-token cross-entropy of a micro-batch and its number of valid labels."""
    logits = output.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                              ignore_index=-100, reduction="sum")
    return total, int((labels != -100).sum())


def sum_loss(batch, output):
    """``SumLoss``: the step's gradient is normalised by the global number of valid tokens."""
    from torchloom import SumLoss

    return SumLoss(*_token_sums(batch, output))


def build_model(name: str):
    """``llama``: 4-layer tiny Llama; ``llama_tied``: the same with tied embeddings; ``gpt2``: 4-layer GPT-2
    (tied wte/lm_head)."""
    if name == "llama":
        return tiny_llama(layers=4)
    if name == "llama_tied":
        return tiny_llama(layers=4, tie=True)
    if name == "gpt2":
        return tiny_gpt2(layers=4)
    raise ValueError(name)


def token_data(steps: int, global_batch: int, micro_batch: int, seq: int = 16) -> list[list[dict]]:
    """``steps`` global batches of fixed random tokens, each cut into micro-batches of ``micro_batch`` rows."""
    x = token_batches(steps * global_batch, seq=seq)
    out = []
    for s in range(steps):
        g = x[s * global_batch:(s + 1) * global_batch]
        out.append([{"input_ids": g[i:i + micro_batch], "labels": g[i:i + micro_batch]}
                    for i in range(0, global_batch, micro_batch)])
    return out


def _atoms(mb: dict, n: int) -> list[dict]:
    rows = mb["input_ids"].shape[0]
    k = rows // n
    return [{key: (v[i * k:(i + 1) * k] if v.shape[0] == rows else v) for key, v in mb.items()} for i in range(n)]


def reference(model_name: str, data: list[list[dict]], atoms: int, max_grad_norm=None, eval_batch=None,
              loss: str = "mean") -> dict:
    """Single-process SGD training on the same atoms: per step the mean of the atoms' losses is
    backpropagated (``loss="sum"``: the step's summed token loss over its total valid-token count); records
    losses, total grad norms (before clipping), the final step's gradients, the final parameters and the eval
    loss of ``eval_batch`` (mean over its atoms)."""
    model = build_model(model_name)
    cls, kw = SGD
    opt = cls(model.parameters(), **kw)
    losses, norms, grads = [], [], {}
    for step in data:
        pieces = [a for mb in step for a in _atoms(mb, atoms)]
        if loss == "sum":
            sums = [_token_sums(a, model(**a)) for a in pieces]
            value = sum(t for t, _ in sums) / sum(c for _, c in sums)
        else:
            value = sum(model(**a).loss for a in pieces) / len(pieces)
        value.backward()
        norms.append(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        clipped = {n: p.grad.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
        opt.step()
        opt.zero_grad()
        losses.append(value.item())
    ev = None
    if eval_batch is not None:
        with torch.no_grad():
            ev = (sum(model(**a).loss for a in _atoms(eval_batch, atoms)) / atoms).item()
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "grads": grads, "clipped": clipped, "params": params, "eval": ev}


# ---------------------------------------------------------------------------------------------- rank functions
def pp_train_many(configs: list[dict]) -> list[dict]:
    """Several runs in one launch (a launch costs seconds): :func:`pp_train`, or :func:`pp_checkpoint` for a
    config with ``kind="checkpoint"`` (its ``tag`` is only for error messages)."""
    out = []
    for cfg in configs:
        try:
            if cfg.get("kind") == "checkpoint":
                out.append(pp_checkpoint(**{k: v for k, v in cfg.items() if k not in ("kind", "tag")}))
            else:
                out.append(pp_train(**cfg))
        except Exception as e:
            raise RuntimeError(f"config {cfg.get('tag')} failed: {type(e).__name__}: {e}") from e
    return out


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu().clone()


def pp_train(strategy, data: list[list[dict]], model: str = "llama", max_grad_norm=None, tag: str = "",
             eval_batch: dict | None = None, drop_kwarg_after_first: str | None = None, meta: bool = False,
             loss: str = "mean", skip_tie_sum: bool = False) -> dict:
    """Train with ``auto_accelerate`` on this rank's share of ``data``; return losses (identical on every rank:
    the dp-mean of the step's reports), grad norms, final-step gradients and parameters of this rank's stages
    (full tensors, by name), notes and the keyword routing the driver used.

    Faults injected on purpose (the tests show they are detected): ``drop_kwarg_after_first``: stages after
    the first do not receive that input; ``skip_tie_sum``: tied copies are not given the summed gradient.
    """
    if meta:
        with torch.device("meta"):
            m = build_model(model)
    else:
        m = build_model(model)
    per_step = len(data[0])
    cls, kw = SGD
    res = torchloom.auto_accelerate(m, cls, None, sum_loss if loss == "sum" else lm_loss, strategy=strategy,
                                    optim_args=kw, dataloader_args={"batch_size": per_step, "micro_batch_size": 1},
                                    model_input_format="unpack_dict", max_grad_norm=max_grad_norm)
    dp, r, accum = res.mesh.dp_size, res.mesh.dp_rank, res.grad_accum_steps
    assert accum * dp == per_step, (accum, dp, per_step)
    driver = res.model.pipeline
    if drop_kwarg_after_first:
        original = driver.family.inputs_for
        driver.family.inputs_for = lambda spec: tuple(
            k for k in original(spec) if spec.is_first or k != drop_kwarg_after_first)
    if skip_tie_sum:
        res.train_step.pre_step_hooks.remove(driver.ties.sum_gradients)
    names = {id(p): n for n, p in res.model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}

    def snapshot(opt, args, kwargs):  # the gradients the optimizer applies (after tie sum and clipping)
        grads.clear()
        for g in opt.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    grads[names[id(p)]] = _full(p.grad)

    res.optimizer.register_step_pre_hook(snapshot)
    losses, norms = [], []
    for step in data:
        acc = torch.zeros(())
        for k in range(accum):
            acc += res.train_step(step[r * accum + k])
        acc /= accum
        if dp > 1:
            dist.all_reduce(acc, group=res.mesh.group("dp"))
        losses.append((acc / dp).item())
        n = res.train_step.last_grad_norm
        norms.append(None if n is None else float(n))
    ev = None
    if eval_batch is not None:
        with torch.no_grad():
            ev = float(res.forward_loss(eval_batch))
    params = {n: _full(p) for n, p in res.model.named_parameters()}
    return {"tag": tag, "losses": losses, "norms": norms, "grads": grads, "params": params, "notes": res.notes,
            "routed": {k: list(v) for k, v in driver.routed.items()}, "loss_inputs": driver.loss_inputs_seen,
            "stages": [s.index for s in res.model.stages], "eval": ev, "repr": repr(res.model)[:2000],
            "schedules": len(driver._schedules),
            "mesh": res.mesh.dims.as_dict(), "rank": dist.get_rank()}


def merge_params(rank_results: list[dict]) -> dict[str, torch.Tensor]:
    """Union of every rank's stage parameters; a name held by several ranks (dp replicas) must agree exactly."""
    out: dict[str, torch.Tensor] = {}
    for r in rank_results:
        for k, v in r["params"].items():
            if k in out:
                assert torch.equal(out[k], v), f"{k} differs between ranks holding it"
            out[k] = v
    return out


def merge_grads(rank_results: list[dict]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for r in rank_results:
        out.update(r["grads"])
    return out


def describe(res: dict) -> dict[str, Any]:
    return {k: res[k] for k in ("tag", "losses", "norms", "stages", "routed")}


# ------------------------------------------------------------------------------------------------ checkpoints
def _opt_state(res) -> dict[str, torch.Tensor]:
    names = {id(p): n for n, p in res.model.named_parameters()}
    return {names[id(p)]: _full(s["momentum_buffer"]) for p, s in res.optimizer.state.items()}


def pp_checkpoint(root: str, strategy, model: str = "llama", steps_before: int = 2, steps_after: int = 2,
                  plain_root: str | None = None) -> dict:
    """Train ``steps_before`` steps, save, train ``steps_after`` more (run A); then a fresh job from a model
    with another initialisation loads the checkpoint and trains the same ``steps_after`` steps (run B).
    Returns both runs' losses, the saved parameters and momentum buffers, and run B's values right after
    loading. ``plain_root``: also load that (unpipelined) checkpoint's model into a fresh pipelined job and
    return its parameters as ``from_plain``."""
    from torchloom import checkpoint as ckpt

    data = token_data(steps_before + steps_after, 8, 4)

    def job(seed: int):
        torch.manual_seed(seed)
        m = build_model(model)
        if seed:  # another initialisation, so a load that did nothing cannot pass
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn_like(p))
        cls, kw = SGD
        return torchloom.auto_accelerate(m, cls, None, lm_loss, strategy=strategy, optim_args=kw,
                                         dataloader_args={"batch_size": 2, "micro_batch_size": 1},
                                         model_input_format="unpack_dict", seed=0)

    def train(res, steps):
        out = []
        for step in steps:
            out.append(sum(float(res.train_step(mb)) for mb in step) / len(step))
        return out

    from_plain = plain_error = None
    if plain_root is not None:
        c = job(1)
        try:
            ckpt.load(plain_root, model=c.model, optimizer=c.optimizer)
        except ckpt.CheckpointError as e:
            plain_error = str(e)
        ckpt.load(plain_root, model=c.model)
        from_plain = {n: _full(p) for n, p in c.model.named_parameters()}
    a = job(0)
    before = train(a, data[:steps_before])
    saved_at = ckpt.save(root, step=steps_before, model=a.model, optimizer=a.optimizer, train_step=a.train_step)
    saved = {"params": {n: _full(p) for n, p in a.model.named_parameters()}, "momentum": _opt_state(a)}
    after_a = train(a, data[steps_before:])
    b = job(1)
    info = ckpt.load(root, model=b.model, optimizer=b.optimizer, train_step=b.train_step)
    loaded = {"params": {n: _full(p) for n, p in b.model.named_parameters()}, "momentum": _opt_state(b)}
    after_b = train(b, data[steps_before:])
    return {"before": before, "after_a": after_a, "after_b": after_b, "saved": saved, "loaded": loaded,
            "step": info["step"], "path": str(saved_at),
            "final_a": {n: _full(p) for n, p in a.model.named_parameters()},
            "final_b": {n: _full(p) for n, p in b.model.named_parameters()}, "from_plain": from_plain,
            "plain_error": plain_error}
