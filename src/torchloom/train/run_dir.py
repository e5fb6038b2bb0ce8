"""Which runs an output directory may hold: a re-run of ``loom train`` resumes the run in its output dir only when
this config builds the same model (:func:`check_output_dir`).

The saved run's ``config.yaml`` is compared with this config's model-defining fields (:data:`MODEL_KEYS`): the
``model`` section (sizes, vocabulary, the Mixture-of-Experts variant) and ``data.eval_plays`` (the tokenizer is
trained on the other plays, so other held-out plays give other token ids). Everything else (steps, learning
rate, logging, checkpoint interval, strategy, parallel layout, number of processes: checkpoints reshard on
resume) may change between runs of one output dir, except the resume-defining fields (:data:`RESUME_KEYS`: the
seed) while the output dir holds a checkpoint.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import yaml

from .config import ConfigError, TrainConfig

#: ``model`` fields that shape the training objective, not the parameters or the data: they may change between
#: runs of one output dir. Every other field of the ``model`` section defines the model (a field added to
#: ``ModelConfig`` later counts too unless it is named here).
OBJECTIVE_KEYS = ("model.moe.aux_loss_weight", "model.moe.router_jitter_noise")


def _flat(data: Mapping[str, Any], prefix: str) -> list[str]:
    return [k for key, v in data.items()
            for k in (_flat(v, f"{prefix}{key}.") if isinstance(v, Mapping) else [f"{prefix}{key}"])]


#: the fields that define the model a run's checkpoints hold (dotted keys of :class:`TrainConfig`): the ``model``
#: section but :data:`OBJECTIVE_KEYS`, and ``data.eval_plays`` (the tokenizer is trained on the other plays). The
#: ``model.moe.*`` keys count only for a Mixture-of-Experts model (``num_experts > 0``).
MODEL_KEYS = tuple(k for k in _flat(TrainConfig().to_dict()["model"], "model.") if k not in OBJECTIVE_KEYS) + (
    "data.eval_plays",)

#: fields a resume cannot change (dotted key -> why), checked while the output dir holds a complete checkpoint.
#: Read off how the data position is restored (``ElasticDistributedSampler.check_state_dict``): the saved
#: position is a count of samples of an order fixed by the seed and the dataset (the dataset's fields are
#: model-defining: :data:`MODEL_KEYS`), so those must match; the batch sizes and ``--nproc`` need only the
#: alignment rule (docs/data.md), which the job checks.
RESUME_KEYS = {
    "train.seed": "it fixes the data order (epoch e is a permutation seeded by seed + e) and the checkpoint's data "
                  "position counts samples of that order: another seed would skip some samples and repeat others",
}

#: files of a run that trained (or started to): an output dir without any keeps nothing a new run could lose
RUN_FILES = ("metrics.jsonl", "summary.json", "model.safetensors", "model.safetensors.index.json")


class OutputDirInUse(ConfigError):
    """The output directory holds a run of another model (:func:`check_output_dir`)."""


def _get(data: Mapping[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, Mapping) or part not in data:
            raise KeyError(dotted)
        data = data[part]
    return data


def _same(key: str, a: Any, b: Any) -> bool:
    if key == "data.eval_plays":  # the corpus is keyed by the set of plays (corpus_key sorts them)
        return sorted(map(str, a or [])) == sorted(map(str, b or []))
    return a == b


class ResumeSettingChanged(ConfigError):
    """A resume-defining field (:data:`RESUME_KEYS`) differs from the checkpointed run's (:func:`check_output_dir`)."""


def _saved_value(saved: Mapping[str, Any], key: str) -> Any:
    """``key`` of a saved config dict; a key it lacks (an older torchloom) counts as its default."""
    try:
        return _get(saved, key)
    except KeyError:
        return _get(TrainConfig().to_dict(), key)


def resume_differences(saved: Mapping[str, Any], cfg: TrainConfig, *, only_saved: bool = False) -> list[str]:
    """The resume-defining fields (:data:`RESUME_KEYS`) on which ``saved`` (a run's ``config.yaml``) and ``cfg``
    differ, as ``"key: saved -> this"`` strings. A key ``saved`` lacks counts as its default, or with
    ``only_saved`` is skipped."""
    now = cfg.to_dict()
    keys = [k for k in RESUME_KEYS if not only_saved or _has(saved, k)]
    return [f"{k}: {_saved_value(saved, k)!r} -> {_get(now, k)!r}" for k in keys
            if _saved_value(saved, k) != _get(now, k)]


def _has(data: Mapping[str, Any], key: str) -> bool:
    try:
        _get(data, key)
    except KeyError:
        return False
    return True


def model_differences(saved: Mapping[str, Any], cfg: TrainConfig) -> list[str]:
    """The model-defining fields (:data:`MODEL_KEYS`) on which the saved config dict ``saved`` (a run's
    ``config.yaml``) and ``cfg`` differ, as ``"key: saved -> this"`` strings. A key the saved config lacks (an
    older torchloom) counts as its default; the ``model.moe`` keys other than ``num_experts`` only when either
    model has experts."""
    defaults, now = TrainConfig().to_dict(), cfg.to_dict()

    def value(data: Mapping[str, Any], key: str) -> Any:
        try:
            return _get(data, key)
        except KeyError:
            return _get(defaults, key)

    moe = bool(value(saved, "model.moe.num_experts")) or cfg.model.is_moe
    out = []
    for key in MODEL_KEYS:
        if key.startswith("model.moe.") and key != "model.moe.num_experts" and not moe:
            continue
        a, b = value(saved, key), _get(now, key)
        if not _same(key, a, b):
            out.append(f"{key}: {a!r} -> {b!r}")
    return out


def describe_model(data: Mapping[str, Any]) -> str:
    """``"LlamaForCausalLM (hidden 256, 4 layers, ...)"``: the model a config dict builds, in one line."""
    defaults = TrainConfig().to_dict()["model"]
    m = {**defaults, **(data.get("model") or {})}
    moe = {**defaults["moe"], **(m.get("moe") or {})}
    sizes = (f"hidden {m['hidden_size']}, {m['num_layers']} layers, {m['num_heads']}/{m['num_kv_heads']} heads, "
             f"MLP {m['intermediate_size']}, vocab {m['vocab_size']}, seq {m['seq_len']}")
    if moe["num_experts"]:
        return f"MixtralForCausalLM ({moe['num_experts']} experts, top-{moe['top_k']}; {sizes})"
    return f"LlamaForCausalLM ({sizes})"


def _another_dir(out: Path, cfg: TrainConfig, saved: Mapping[str, Any]) -> Path:
    """A sibling of ``out`` that does not exist yet, named after the change (``runs/moe`` for the MoE model)."""
    saved_moe = bool((saved.get("model") or {}).get("moe", {}).get("num_experts"))
    base = "moe" if cfg.model.is_moe and not saved_moe else f"{out.name}-2"
    candidate, n = out.parent / base, 2
    while candidate.exists():
        n += 1
        candidate = out.parent / f"{base}-{n}"
    return candidate


def _has_checkpoints(out: Path) -> bool:
    ckpts = out / "checkpoints"
    return ckpts.is_dir() and any(ckpts.iterdir())


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds files of a run that started training (metrics, a summary, weights or checkpoints)."""
    return any((out / f).exists() for f in RUN_FILES) or _has_checkpoints(out)


def check_output_dir(cfg: TrainConfig) -> None:
    """Refuse an output dir that holds a run of another model, or a checkpoint this config cannot resume, before
    anything is written to it.

    ``cfg.output_dir/config.yaml`` (written by every run that trained) is compared with ``cfg``
    (:func:`model_differences`). A run of another model there would otherwise get its ``config.yaml`` overwritten
    and its checkpoints fail to load into this model. An output dir whose ``config.yaml`` is all it holds (a run
    that stopped before training) is not refused: there is nothing to lose. No ``config.yaml``: nothing to compare
    (the resume itself then names a checkpoint that does not fit). Then, while the dir holds a complete
    checkpoint, the resume-defining fields (:data:`RESUME_KEYS`; the seed as the checkpoint's data position
    records it).

    Raises:
        OutputDirInUse: (a :class:`ConfigError`) naming the saved model and this one, the differing keys,
            ``--output-dir`` with a free directory, and how to start over in this one.
        ResumeSettingChanged: (a :class:`ConfigError`) a resume-defining field differs, naming it, why, the
            checkpoint, and the ways on.
        ConfigError: the saved ``config.yaml`` cannot be read (the output dir may not be a run's).
    """
    out = Path(cfg.output_dir)
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        _check_no_foreign_files(out, cfg)
        _check_resume_settings(out, cfg, None)
        return
    try:
        saved = yaml.safe_load(saved_path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"cannot read {saved_path} (the config of the run in output dir {out}): {e}. Pass "
                          "another --output-dir, or repair or delete that file.") from e
    if not isinstance(saved, Mapping):
        raise ConfigError(f"{saved_path} is not a run's config (a mapping of sections expected). Pass another "
                          "--output-dir, or delete that file.")
    diffs = model_differences(saved, cfg)
    if not diffs or not holds_run(out):
        _check_resume_settings(out, cfg, saved)
        return
    raise OutputDirInUse(
        f"output dir {out} holds a run of another model: {describe_model(saved)} ({saved_path}); this config "
        f"builds {describe_model(cfg.to_dict())} ({'; '.join(diffs)}). "
        f"{'Its checkpoints cannot be resumed by this model, and n' if _has_checkpoints(out) else 'N'}othing in "
        f"{out} was changed. Pass another --output-dir for this model (e.g. --output-dir "
        f"{_another_dir(out, cfg, saved)}); to start over in {out}, delete it first. Changes that keep the model "
        "(steps, lr, logging, checkpoint interval, strategy, parallel layout, --nproc) resume the run instead.")


def _check_no_foreign_files(out: Path, cfg: TrainConfig) -> None:
    """Refuse an output dir with neither a run's ``config.yaml`` nor a complete checkpoint (so nothing to resume)
    that holds files the run would write over or could not write: a Hugging Face model or adapter (the final
    export, :func:`torchloom.hf.save_pretrained`, refuses another model's folder, after every step trained) or a
    run's outputs (:data:`RUN_FILES`) whose model nobody can tell. A run that trained always left its
    ``config.yaml``; with a complete checkpoint the resume decides (its seed here, its model when it loads).

    Raises:
        OutputDirInUse: naming the files found and the ways on (another ``--output-dir``, or move them).
    """
    from torchloom.checkpoint.commit import latest_complete
    from torchloom.hf.save_target import found

    saves, files = found(out)
    run_files = [f for f in RUN_FILES if (out / f).exists() and f not in files]
    if not (saves or run_files) or latest_complete(out / "checkpoints") is not None:
        return
    what = [f"{' and '.join(s.describe() for s in saves)} ({', '.join(files)})"] if saves else []
    what += [f"files of a run ({', '.join(run_files)})"] if run_files else []
    raise OutputDirInUse(
        f"output dir {out} holds {' and '.join(what)} but no config.yaml of a loom train run nor a checkpoint to "
        f"resume, so which model that is cannot be told: the run would write its metrics and summary over what is "
        f"there and end by exporting its model there (model.safetensors, config.json, tokenizer files). Nothing in "
        f"{out} was changed. Pass another --output-dir (e.g. --output-dir {_another_dir(out, cfg, {})}), or move "
        f"those files out of {out}.")


def _check_resume_settings(out: Path, cfg: TrainConfig, saved: Mapping[str, Any] | None) -> None:
    """Refuse a change of a resume-defining field while ``out`` holds a complete checkpoint (a resume would load
    it and fail in the workers, after start-up; or, had it loaded, train on a mixed data order). ``saved``: the
    run's ``config.yaml`` (None: there is none; then only what the checkpoint records is compared). The seed is
    read from the checkpoint's data position when it records one (a ``config.yaml`` an older torchloom rewrote
    before failing to resume may name another)."""
    from torchloom.checkpoint.commit import latest_complete

    latest = latest_complete(out / "checkpoints")
    if latest is None:
        return  # nothing to resume: the run starts over with this config
    seed = _checkpoint_seed(latest)
    if saved is None and seed is None:
        return
    known = dict(saved or {})
    if seed is not None:
        train = known.get("train")
        known["train"] = {**(train if isinstance(train, Mapping) else {}), "seed": seed}
    diffs = resume_differences(known, cfg, only_saved=saved is None)
    if not diffs:
        return
    keys = [d.split(":", 1)[0] for d in diffs]
    why = "; ".join(f"{k}: {RESUME_KEYS[k]}" for k in keys)
    keep = " ".join(f"--set {k}={_saved_value(known, k)}" for k in keys)
    raise ResumeSettingChanged(
        f"output dir {out} holds a checkpoint ({latest}) of a run with another {', '.join(keys)} "
        f"({'; '.join(diffs)}), which a resume cannot change: {why}. Nothing in {out} was changed. Keep "
        f"{keep} to resume that run, pass another --output-dir (e.g. --output-dir {_another_dir(out, cfg, known)}) "
        f"for this one, or delete {out / 'checkpoints'} to start over here.")


def _checkpoint_seed(ckpt: Path) -> int | None:
    """The sampler seed in checkpoint ``ckpt``'s data position (``trainer_state.json``), or None."""
    state = _checkpoint_data_state(ckpt)
    seed = state.get("seed") if state is not None else None
    return seed if isinstance(seed, int) and not isinstance(seed, bool) else None


def check_resume_layout(cfg: TrainConfig, world_size: int) -> None:
    """Refuse, before launch, a batch layout that the newest complete checkpoint's data position does not fall on
    (the workers' check, ``ElasticDistributedSampler.check_state_dict``, made early): ``world_size`` processes
    with ``cfg``'s strategy, global batch and micro batch. Skipped for ``strategy: auto`` (the search picks the
    micro batch) and flash checkpoints (a newer in-memory snapshot may be resumed instead); an unreadable data
    state is left to the workers.

    Raises:
        ResumeSettingChanged: (a :class:`ConfigError`) the samples consumed in the saved epoch are not a multiple
            of data-parallel ranks x micro batch; the message names the numbers and a micro batch that fits.
    """
    from torchloom.checkpoint.commit import latest_complete

    from ..api import plan_dims
    from ..data import DataError, ElasticDistributedSampler, plan_batches

    if cfg.is_auto or not cfg.checkpoint.blocking:
        return
    latest = latest_complete(Path(cfg.output_dir) / "checkpoints")
    state = _checkpoint_data_state(latest) if latest is not None else None
    if not state or state.get("kind", "map") != "map":
        return
    dims = plan_dims(cfg.full_strategy(), world_size)
    plan = plan_batches(cfg.train.global_batch, cfg.train.micro_batch, dims.dp)
    try:
        sampler = ElasticDistributedSampler(
            int(state["num_samples"]), dp_rank=0, dp_size=dims.dp, micro_batch_size=plan.micro_batch_size,
            global_batch_size=plan.global_batch_size, seed=int(state["seed"]))
    except (KeyError, TypeError, ValueError):
        return  # a state this check cannot read, or a batch the workers refuse with their own message
    try:
        sampler.check_state_dict(state)
    except DataError as e:
        raise ResumeSettingChanged(
            f"cannot resume the data position of {latest} with this batch layout ({world_size} processes: "
            f"data-parallel {dims.dp} x micro batch {plan.micro_batch_size}, global batch {plan.global_batch_size}): "
            f"{e} In loom train the micro batch is train.micro_batch (--set train.micro_batch=N), or keep the "
            f"train.global_batch ({state.get('global_batch_size')}) and --nproc of the run that saved it. Nothing in "
            f"{cfg.output_dir} was changed.") from e


def _checkpoint_data_state(ckpt: Path) -> Mapping[str, Any] | None:
    """The data position (the loader's ``state_dict()``) in checkpoint ``ckpt``'s ``trainer_state.json``, or None
    (none recorded, or a document the resume itself will name as corrupt)."""
    from torchloom.checkpoint.trainer_state import read_document
    from torchloom.errors import CheckpointError

    try:
        doc = read_document(ckpt)
    except CheckpointError:
        return None
    state = doc.get("dataloader") or (doc.get("dataloader_per_rank") or [None])[0]
    return state if isinstance(state, Mapping) else None