"""Which runs an output directory may hold: a re-run of ``loom train`` resumes the run in its output dir only when
this config builds the same model (:func:`check_output_dir`).

The saved run's ``config.yaml`` is compared with this config's model-defining fields (:data:`MODEL_KEYS`): the
``model`` section (sizes, vocabulary, the Mixture-of-Experts variant) and ``data.eval_plays`` (the tokenizer is
trained on the other plays, so other held-out plays give other token ids). Everything else (steps, learning
rate, logging, checkpoint interval, strategy, parallel layout, number of processes: checkpoints reshard on
resume) may change between runs of one output dir.
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


def holds_run(out: Path) -> bool:
    """Whether ``out`` holds files of a run that started training (metrics, a summary, weights or checkpoints)."""
    ckpts = out / "checkpoints"
    return any((out / f).exists() for f in RUN_FILES) or (ckpts.is_dir() and any(ckpts.iterdir()))


def check_output_dir(cfg: TrainConfig) -> None:
    """Refuse an output dir that holds a run of another model, before anything is written to it.

    ``cfg.output_dir/config.yaml`` (written by every run) is compared with ``cfg`` (:func:`model_differences`).
    A run of another model there would otherwise get its ``config.yaml`` overwritten and its checkpoints fail to
    load into this model. An output dir whose ``config.yaml`` is all it holds (a run that stopped before
    training) is not refused: there is nothing to lose. No ``config.yaml``: nothing to compare (the resume
    itself then names a checkpoint that does not fit).

    Raises:
        OutputDirInUse: (a :class:`ConfigError`) naming the saved model and this one, the differing keys,
            ``--output-dir`` with a free directory, and how to start over in this one.
        ConfigError: the saved ``config.yaml`` cannot be read (the output dir may not be a run's).
    """
    out = Path(cfg.output_dir)
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
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
        return
    raise OutputDirInUse(
        f"output dir {out} holds a run of another model: {describe_model(saved)} ({saved_path}); this config "
        f"builds {describe_model(cfg.to_dict())} ({'; '.join(diffs)}). Its checkpoints cannot be resumed by this "
        f"model, and nothing in {out} was changed. Pass another --output-dir for this model (e.g. --output-dir "
        f"{_another_dir(out, cfg, saved)}); to start over in {out}, delete it first. Changes that keep the model "
        "(steps, lr, logging, checkpoint interval, strategy, parallel layout, --nproc) resume the run instead.")
