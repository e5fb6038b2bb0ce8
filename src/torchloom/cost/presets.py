"""Models ``loom plan`` can plan for without downloading anything: built-in presets (the published Hugging Face
``config.json`` numbers), a path to a ``config.json``, or a Python factory ``pkg.module:fn``.

:func:`resolve_model` turns any of those into a :class:`ModelSpec`; :meth:`ModelSpec.analyze` gives the
planner's :class:`~torchloom.cost.model_info.ModelInfo` with the model built on the meta device only (a 70B
model costs no memory).
"""
from __future__ import annotations

import difflib
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import TorchloomError


class ModelSpecError(TorchloomError, ValueError):
    """A model given to ``loom plan`` cannot be resolved: unknown preset, unreadable config, bad factory."""


_LLAMA3_ROPE_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}

# The architecture fields of each model's published config.json (token ids, dtype and transformers version
# left out: they do not change the plan). Sources are the Hugging Face model repositories named in SOURCES.
PRESETS: dict[str, dict[str, Any]] = {
    "llama3-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    },
    "llama3.1-8b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_SCALING, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu",
    },
    "llama3-70b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192, "intermediate_size": 28672,
        "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
    },
    "llama3.1-405b": {
        "model_type": "llama", "vocab_size": 128256, "hidden_size": 16384, "intermediate_size": 53248,
        "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": _LLAMA3_ROPE_SCALING, "tie_word_embeddings": False, "attention_bias": False,
        "mlp_bias": False, "hidden_act": "silu",
    },
    "mixtral-8x7b": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "num_local_experts": 8, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02,
        "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu",
    },
}

SOURCES: dict[str, str] = {
    "llama3-8b": "https://huggingface.co/meta-llama/Meta-Llama-3-8B/blob/main/config.json",
    "llama3.1-8b": "https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json",
    "llama3-70b": "https://huggingface.co/meta-llama/Meta-Llama-3-70B/blob/main/config.json",
    "llama3.1-405b": "https://huggingface.co/meta-llama/Llama-3.1-405B/blob/main/config.json",
    "mixtral-8x7b": "https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json",
    "default": "torchloom/train/configs/default.yaml (the `loom train` job's model, train.job.build_model)",
}

#: the sequence length each preset is planned at unless ``--seq-len`` says otherwise: the pre-training context
#: of Llama 3 (8,192; Meta's Llama 3 paper, sec. 3.4) for the Llama/Mixtral presets, the job's seq_len for default
PRESET_SEQ_LEN = {"llama3-8b": 8192, "llama3.1-8b": 8192, "llama3-70b": 8192, "llama3.1-405b": 8192,
                  "mixtral-8x7b": 8192}

_FACTORY_PATH = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")

#: cap on the guessed sequence length of a config.json / factory model without ``--seq-len``
DEFAULT_SEQ_LEN_CAP = 8192


def known_models() -> list[str]:
    """Names :func:`resolve_model` accepts as presets."""
    return sorted([*PRESETS, "default"])


@dataclass
class ModelSpec:
    """A model to plan for, not yet built.

    Attributes:
        name: the preset name, the config file's stem, or the factory path.
        source: where the numbers come from (URL, file path, import path).
        hf_config: the Hugging Face config (presets and config.json files), else None.
        factory: a zero-argument callable returning an ``nn.Module`` (import paths), else None.
        seq_len: the sequence length to plan at when the user gives none (None: no natural default).
        notes: what was assumed while resolving.
    """

    name: str
    source: str
    hf_config: Any = None
    factory: Callable[[], Any] | None = None
    seq_len: int | None = None
    notes: list[str] = field(default_factory=list)
    sample: Callable[[], Any] | None = None
    input_format: str | None = None

    def default_seq_len(self) -> int:
        """``seq_len``, else the config's ``max_position_embeddings`` capped at :data:`DEFAULT_SEQ_LEN_CAP`
        (a guess, recorded in ``notes``).

        Raises:
            ModelSpecError: a factory model with neither (``--seq-len`` is needed).
        """
        if self.seq_len:
            return self.seq_len
        n = getattr(self.hf_config, "max_position_embeddings", None) if self.hf_config is not None else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ModelSpecError(f"model {self.name!r} does not say its sequence length; pass --seq-len N.")
        guess = min(int(n), DEFAULT_SEQ_LEN_CAP)
        self.notes.append(f"sequence length {guess} assumed (max_position_embeddings={n}, capped at "
                          f"{DEFAULT_SEQ_LEN_CAP}); pass --seq-len to choose")
        return guess

    def meta_model(self):
        """The model built under ``torch.device("meta")``: shapes only, no parameter memory."""
        import torch

        with torch.device("meta"):
            if self.hf_config is not None:
                return _hf_model(self.hf_config)
            model = self.factory()
        if not isinstance(model, torch.nn.Module):
            raise ModelSpecError(f"factory {self.source} returned {type(model).__name__}, not a torch.nn.Module.")
        return model

    def analyze(self, seq_len: int, attention: str = "native"):
        """:class:`~torchloom.cost.model_info.ModelInfo` of the model at ``seq_len`` tokens per sample
        (built on meta; never allocated); ``attention`` as in :func:`~torchloom.cost.analysis.analyze_model`."""
        from . import analysis

        if self.hf_config is not None:
            try:
                info = analysis.analyze_config(self.hf_config, seq_len=seq_len, where=self.source,
                                                attention=attention)
            except ModelSpecError:
                raise
            except ValueError as e:  # a config transformers builds but the model cannot run (named by the trace)
                raise ModelSpecError(f"{self.source}: {e}") from e
        else:
            model = self.meta_model()
            batch = self.sample_batch()
            try:
                info = analysis.analyze_model(model, seq_len=seq_len, name=self.name, sample_input=batch,
                                              input_format=self.input_format, attention=attention)
            except ModelSpecError:
                raise
            except ValueError as e:  # no sample for a non-HF model, a forward that fails on the sample
                raise ModelSpecError(f"{e} {SAMPLE_HINT}") from e
        info.name = self.name
        return info

    def sample_batch(self):
        """The ``sample`` function's batch (built under ``torch.device("meta")``: only shapes are read), or
        None without one.

        Raises:
            ModelSpecError: the function fails.
        """
        if self.sample is None:
            return None
        import torch

        try:
            with torch.device("meta"):
                return self.sample()
        except Exception as e:  # user code: any failure is named, not a traceback
            raise ModelSpecError(f"the sample function of {self.name} failed: {type(e).__name__}: {e}") from e


#: what a factory model needs when the analysis cannot build its input (docs/plan.md, "The model")
SAMPLE_HINT = ("For loom plan: pass --sample pkg.module:fn, a zero-argument function returning one batch at "
               "micro-batch 1 (called under torch.device('meta')), and --input-format unpack_sequence or "
               "unpack_dict when the batch is passed as forward(*batch) or forward(**batch).")


def resolve_model(spec: str, *, sample: str | None = None, input_format: str | None = None) -> ModelSpec:
    """A preset name (:func:`known_models`), a path to a Hugging Face ``config.json`` (or a directory holding
    one), or an import path ``pkg.module:factory`` (a zero-argument callable returning an ``nn.Module``; it is
    called under ``torch.device("meta")``). Import paths are resolved with the current directory on
    ``sys.path``, as ``python -m`` does.

    Args:
        sample: for a factory: ``pkg.module:fn``, a zero-argument function returning one batch at micro-batch 1
            (what the model's forward takes; needed unless the model is a Hugging Face LM taking
            ``input_ids``/``labels``).
        input_format: how that batch is passed: None -> ``model(batch)``, ``"unpack_sequence"`` ->
            ``model(*batch)``, ``"unpack_dict"`` -> ``model(**batch)`` (as ``auto_accelerate``'s).

    Raises:
        ModelSpecError: an unknown name (the known ones listed, with the closest match), an unreadable or
            invalid config file, a factory or sample function that cannot be imported, a sample or input
            format given for a model that is not a factory, or an unknown input format.
    """
    spec_ = _resolve_model(spec)
    if sample is None and input_format is None:
        return spec_
    if spec_.factory is None:
        raise ModelSpecError(f"--sample/--input-format are for a factory model (pkg.module:fn); {spec_.name} "
                             f"builds its own input (input_ids and labels).")
    if input_format not in (None, "unpack_sequence", "unpack_dict"):
        raise ModelSpecError(f"--input-format {input_format!r}: use unpack_sequence or unpack_dict (or leave it out "
                             f"for model(batch)).")
    if sample is None:
        raise ModelSpecError("--input-format says how a batch is passed; give the batch with --sample pkg.module:fn.")
    if not _FACTORY_PATH.match(sample.strip()):
        raise ModelSpecError(f"--sample {sample!r}: write pkg.module:function (a zero-argument function returning "
                             f"one batch at micro-batch 1).")
    spec_.sample = _import_callable(sample.strip(), "sample function")
    spec_.input_format = input_format
    return spec_


def _resolve_model(spec: str) -> ModelSpec:
    s = str(spec).strip()
    key = s.lower()
    if key in PRESETS:
        return ModelSpec(key, SOURCES[key], hf_config=hf_config_from_dict(PRESETS[key], key),
                         seq_len=PRESET_SEQ_LEN.get(key))
    if key == "default":
        return _default_job_model()
    p = Path(s)
    if p.is_dir() and (p / "config.json").is_file():
        p = p / "config.json"
    if p.is_file():
        return _from_config_file(p)
    if _FACTORY_PATH.match(s):
        return _from_factory(s)
    close = difflib.get_close_matches(key, known_models(), n=1, cutoff=0.5)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    looks_like_path = s.endswith(".json") or "/" in s
    what = f"no file {s}" if looks_like_path else f"unknown model {s!r}"
    raise ModelSpecError(f"{what}.{hint} Give a built-in model ({', '.join(known_models())}), a path to a Hugging "
                         f"Face config.json, or a factory as pkg.module:function.")


def hf_config_from_dict(d: dict[str, Any], where: str, notes: list[str] | None = None):
    """A transformers config of ``d["model_type"]`` from a config.json-style dict, its architecture fields
    checked (:mod:`torchloom.cost.config_checks`) before and after transformers builds it: every size that
    defines the model's parameters and FLOPs is set (:func:`~torchloom.cost.config_checks.check_required_fields`;
    transformers would fill a missing one with another model's number).

    Args:
        notes: receives what was assumed (a derived default kept, an unknown key ignored).

    Raises:
        ModelSpecError: no or an unknown ``model_type``, a bad field (named with its value and the rule), or a
            missing size (named, with close matches among the unknown keys).
    """
    from transformers import CONFIG_MAPPING

    from .config_checks import check_config, check_config_dict, check_required_fields

    mt = d.get("model_type")
    if not mt:
        raise ModelSpecError(f"{where}: no 'model_type' in the config (e.g. \"llama\"); it names the architecture.")
    if mt not in CONFIG_MAPPING:
        from torchloom.utils import did_you_mean

        raise ModelSpecError(f"{where}: model_type {mt!r} is not known to transformers."
                             f"{did_you_mean(str(mt), CONFIG_MAPPING.keys())}")
    check_config_dict(d, where)
    assumed = check_required_fields(d, where)
    if notes is not None:
        notes.extend(assumed)
    try:
        cfg = CONFIG_MAPPING[mt](**{k: v for k, v in d.items() if k != "model_type"})
    except Exception as e:  # noqa: BLE001  (transformers' own field checks: TypeError, ValueError, StrictDataclass*)
        raise ModelSpecError(f"{where}: invalid {mt} config: {transformers_reason(e)}") from e
    check_config(cfg, where)
    return cfg


def transformers_reason(e: BaseException) -> str:
    """The line of a transformers config/model error that says what is wrong (its validation errors wrap the
    reason in a header line: ``Class validation error for validator ...``)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[-1] if lines else type(e).__name__


def _hf_model(config):
    """A causal-LM head model of ``config`` (the class transformers maps its model_type to)."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ModelSpecError(f"model_type {config.model_type!r} has no causal-LM class in transformers ({e}); "
                             f"give a factory pkg.module:function instead.") from e


def _from_config_file(p: Path) -> ModelSpec:
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelSpecError(f"cannot read the model config {p}: {e}") from e
    if not isinstance(d, dict):
        raise ModelSpecError(f"{p}: a config.json holds one JSON object, got {type(d).__name__}.")
    name = p.parent.name if p.name == "config.json" and p.parent.name else p.stem
    notes: list[str] = []
    cfg = hf_config_from_dict(d, str(p), notes)
    return ModelSpec(name, str(p), hf_config=cfg, notes=notes)


def _from_factory(s: str) -> ModelSpec:
    return ModelSpec(s, s, factory=_import_callable(s, "model factory"))


def _import_callable(s: str, what: str) -> Callable[[], Any]:
    """``pkg.module:attr.path`` imported with the current directory on ``sys.path`` (``python -m``'s rule:
    a module of the project the user runs ``loom`` from is found without PYTHONPATH).

    Raises:
        ModelSpecError: the module cannot be imported, has no such attribute, or it is not callable.
    """
    import os
    import sys

    mod_name, _, attr = s.partition(":")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelSpecError(f"cannot import {mod_name!r} for the {what} {s!r}: {e} (searched the current "
                             f"directory {cwd} and PYTHONPATH)") from e
    fn = mod
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ModelSpecError(f"{mod_name} has no {attr!r} ({what} {s!r}).")
    if not callable(fn):
        raise ModelSpecError(f"{s} is not callable; the {what} must be a zero-argument function.")
    return fn


def _default_job_model() -> ModelSpec:
    """The ``loom train`` default job's model: its config exactly as ``train.job.build_model`` makes it."""
    from ..train.config import TrainConfig, _meta_model

    mc = TrainConfig.load("default").model
    config = _meta_model(mc, 0).config
    return ModelSpec("default", SOURCES["default"], hf_config=config, seq_len=mc.seq_len,
                     notes=[f"vocabulary {mc.vocab_size} (model.vocab_size; the job uses the trained tokenizer's "
                            f"actual size, which can be a little smaller)"])
