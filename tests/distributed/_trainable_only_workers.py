"""Rank functions for tests/distributed/test_checkpoint_trainable_only.py (imported by name in spawned ranks)."""
from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist

N_STEPS, SAVE_AT, GBS, MICRO, SEQ = 4, 2, 8, 2, 16


def lora_llama(seed: int = 0, targets: tuple[str, ...] = ("q_proj", "v_proj")):
    """A peft LoRA model on a tiny Llama; the base comes from ``seed`` (as a user rebuilds or reloads it)."""
    from peft import LoraConfig, get_peft_model

    from tests.models import tiny_llama

    base = tiny_llama(seed=seed)
    torch.manual_seed(seed + 1000)  # the adapters' init (overwritten by a load)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0))


def dataset() -> list[dict[str, torch.Tensor]]:
    from tests.models import token_batches

    xs = token_batches(N_STEPS * GBS, seq=SEQ, seed=7)
    return [{"input_ids": x, "labels": x} for x in xs]


def build(strategy, seed: int = 0, targets=("q_proj", "v_proj")):
    import torchloom

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # peft: is_gradient_checkpointing is deprecated
        return torchloom.auto_accelerate(
            lora_llama(seed, targets), torch.optim.AdamW, dataset(), None, strategy=strategy,
            optim_args={"lr": 1e-2}, dataloader_args={"batch_size": GBS, "micro_batch_size": MICRO},
            lr_scheduler_cls=torch.optim.lr_scheduler.StepLR, lr_scheduler_args={"step_size": 1, "gamma": 0.9},
            model_input_format="unpack_dict")


def run(res, first: int, last: int, save=None) -> list[float]:
    """Optimizer steps ``first..last`` over the (restored) dataloader; this rank's micro-batch losses.
    ``save(step)`` runs after the optimizer step ``step``."""
    losses, it = [], iter(res.dataloader)
    for step in range(first, last + 1):
        for _ in range(res.grad_accum_steps):
            losses.append(float(res.train_step(next(it))))
        if save is not None:
            save(step)
    return losses


def _kw(res) -> dict:
    return dict(model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler, dataloader=res.dataloader,
                train_step=res.train_step)


def _equal(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a if k not in b or not torch.equal(a[k], b[k]))


def _error(fn) -> str | None:
    from torchloom.errors import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return None


def trainable_only_rank(tmp: str) -> dict:
    """FSDP and DDP LoRA runs: uninterrupted with a trainable-only save (disk, and flash for FSDP) at
    ``SAVE_AT``, then fresh models (base rebuilt from the same seed) load it and continue; plus the errors."""
    from tests.models import full_params
    from torchloom import checkpoint
    from torchloom.checkpoint.flash import FlashCheckpointer

    tmp = Path(tmp)
    out: dict = {"rank": dist.get_rank()}
    for name, strategy in (("fsdp", ["fsdp"]), ("ddp", ["ddp"])):
        root, flash_root = tmp / name / "ckpt", tmp / name / "flash"
        res = build(strategy)
        fc = FlashCheckpointer(flash_root, **_kw(res), trainable_only=True, shm_dir=tmp / name / "shm") \
            if name == "fsdp" else None
        at_save: dict = {}

        def save(step, res=res, fc=fc, root=root, at_save=at_save):
            if step != SAVE_AT:
                return
            checkpoint.save(root, step=step, trainable_only=True, **_kw(res))
            if fc is not None:
                fc.save(step)
                fc.finalize(unlink=False)
            at_save.update(full_params(res.model))

        losses = run(res, 1, N_STEPS, save)
        final = full_params(res.model)
        tail = losses[SAVE_AT * res.grad_accum_steps:]
        case = {"losses": losses}
        resumed = build(strategy)
        info = checkpoint.load(root, **_kw(resumed))
        case["disk_step"] = info["step"]
        case["disk_losses"] = run(resumed, SAVE_AT + 1, N_STEPS)
        case["disk_diff"] = _equal(final, full_params(resumed.model))
        case["disk_tail_equal"] = case["disk_losses"] == tail
        if fc is not None:
            resumed = build(strategy)
            info = FlashCheckpointer(flash_root, **_kw(resumed), trainable_only=True, shm_dir=tmp / name / "shm").load()
            case["flash_source"], case["flash_step"] = info["source"], info["step"]
            case["flash_tail_equal"] = run(resumed, SAVE_AT + 1, N_STEPS) == tail
            case["flash_diff"] = _equal(final, full_params(resumed.model))
            case["flash_persisted"] = str(checkpoint.latest_complete(flash_root))
        out[name] = case
        out[f"{name}_at_save"] = at_save
        if name == "fsdp":
            # errors and the cross-wrapping load, on the FSDP checkpoint (every rank must raise)
            other = build(["ddp"])  # another wrapping and sharding: the fingerprint sums still agree
            checkpoint.load(root, **_kw(other))
            out["ddp_from_fsdp_diff"] = _equal(at_save, full_params(other.model))
            fewer = build(strategy, targets=("q_proj",))
            out["err_trainable"] = _error(lambda: checkpoint.load(root, **_kw(fewer)))
            more = build(strategy, targets=("q_proj", "v_proj", "k_proj"))
            out["err_untrained_adapter"] = _error(lambda: checkpoint.load(root, **_kw(more)))
            wrong = build(strategy, seed=1)
            out["err_base"] = _error(lambda: checkpoint.load(root, **_kw(wrong)))
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                checkpoint.load(root, **_kw(wrong), strict=False)
            out["lenient_warnings"] = [str(w.message) for w in caught if "trainable-only" in str(w.message)]
            loaded = full_params(wrong.model)
            out["lenient_adapters_loaded"] = not _equal({k: v for k, v in at_save.items() if "lora_" in k}, loaded)
    out["pipeline"] = pipeline_case(str(tmp))
    return out


def pipeline_case(tmp: str) -> dict:
    """2 pipeline stages, attention projections trainable (the rest frozen): trainable-only save at step
    ``SAVE_AT``, a fresh job (same base seed) loads and continues; the job's trainable set and fingerprint
    are the union over the stages."""
    import torchloom
    from tests.models import tiny_llama, token_batches
    from torchloom import checkpoint

    def job(extra: tuple[str, ...] = ()):
        model = tiny_llama(seed=0, layers=4)
        for n, p in model.named_parameters():
            p.requires_grad_(n.endswith(("q_proj.weight", "v_proj.weight", *extra)))
        return torchloom.auto_accelerate(
            model, torch.optim.AdamW, None, None, strategy=[("pipeline_parallel", {"size": 2})],
            optim_args={"lr": 1e-2}, dataloader_args={"batch_size": 4, "micro_batch_size": 2},
            model_input_format="unpack_dict", seed=0)

    xs = token_batches(N_STEPS * 4, seq=SEQ, seed=11)
    steps = [[{"input_ids": x, "labels": x} for x in xs[i * 4:(i + 1) * 4].split(2)] for i in range(N_STEPS)]

    def train(res, part):
        return [float(res.train_step(mb)) for step in part for mb in step]

    root = Path(tmp) / "pp"
    a = job()
    train(a, steps[:SAVE_AT])
    checkpoint.save(root, step=SAVE_AT, model=a.model, optimizer=a.optimizer, train_step=a.train_step,
                    trainable_only=True)
    tail_a = train(a, steps[SAVE_AT:])
    b = job()
    checkpoint.load(root, model=b.model, optimizer=b.optimizer, train_step=b.train_step)
    tail_b = train(b, steps[SAVE_AT:])
    final = lambda res: {n: p.detach().clone() for n, p in res.model.named_parameters()}  # noqa: E731
    more = job(extra=("layers.3.self_attn.k_proj.weight",))  # trainable on the last stage only
    err = _error(lambda: checkpoint.load(root, model=more.model, optimizer=more.optimizer))
    return {"tail_equal": tail_a == tail_b, "diff": _equal(final(a), final(b)), "error": err,
            "saved_trainable": len(_doc(root)["params"])}


def _doc(root: Path) -> dict:
    import json

    return json.loads((root / f"step_{SAVE_AT:08d}" / "trainer_state.json").read_text())["trainable_only"]
