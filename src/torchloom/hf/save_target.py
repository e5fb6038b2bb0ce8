"""What a :func:`torchloom.hf.save_pretrained` folder already holds, and whether the new save may replace it.

A save replaces only an earlier save of the same model:

* a full model: the folder's ``config.json`` is a Hugging Face config (it has a ``model_type``) of the same
  ``model_type``, lists the new class among its ``architectures``, and agrees with the new config on every field
  that defines the model (:func:`config_differences`): all fields but those that change when the same model is
  saved again (:data:`VOLATILE_CONFIG_KEYS`, private ``_...`` keys, generation settings, dropout rates and
  initialisation ranges). Further training changes weights, never a size.
* a peft adapter: the same ``peft_type``, base class and (where both name one) base model, and the same adapter
  fields (``r``, ``lora_alpha``, ``target_modules``, ``modules_to_save``, ``task_type``, ...:
  :func:`adapter_differences`; all but :data:`VOLATILE_ADAPTER_KEYS`).

Anything else (another ``model_type``, class or architecture, a ``config.json`` no Hugging Face save wrote, a full
model where an adapter goes or the reverse: transformers would load the old adapter on top of a new merged model)
is refused before anything is gathered or written, unless ``overwrite=True``. Weights without a config (a save
interrupted after it removed ``config.json``) are taken as an earlier save of the same model. Files that no
Hugging Face / peft save writes (the user's notes, ``checkpoints/``, a ``README.md``) are never touched.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import enum
import functools
import json
import re
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torchloom.errors import CheckpointError

# the files a save_pretrained of each kind writes into its folder
FULL_FILE = re.compile(r"(config|generation_config)\.json"
                       r"|(model|pytorch_model)(-\d{5}-of-\d{5})?\.(safetensors|bin)(\.index\.json)?")
ADAPTER_FILE = re.compile(r"adapter_config\.json|adapter_model\.(safetensors|bin)")
# a tokenizer's or processor's save_pretrained files: the old model's, replaced with it under overwrite=True
TOKENIZER_FILE = re.compile(r"tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json"
                            r"|vocab\.(json|txt)|merges\.txt|(tokenizer|spiece|sentencepiece\.bpe)\.model"
                            r"|chat_template\.(jinja|json)|(preprocessor|processor)_config\.json")
_SHARD = re.compile(r"-\d{5}-of-\d{5}\.")
#: written into a folder while a save replaces its files (``torchloom.hf.save._publish``): ``{marker file name:
#: its new content}``. Weights without their config file are an interrupted save of the model it names; without
#: it, nobody can tell what model they hold.
PENDING_FILE = ".torchloom-save-pending.json"

#: config.json fields that change when the same model is saved again: bookkeeping, the dtype it is saved in,
#: runtime switches and task metadata (``id2label`` is compared by its length: the number of labels)
VOLATILE_CONFIG_KEYS = frozenset({
    "transformers_version", "dtype", "torch_dtype", "architectures", "name_or_path", "output_hidden_states",
    "output_attentions", "return_dict", "use_return_dict", "torchscript", "attn_implementation",
    "experts_implementation", "use_cache", "gradient_checkpointing", "problem_type", "label2id", "tokenizer_class",
    "prefix", "task_specific_params", "finetuning_task"})
#: adapter_config.json fields that change when the same adapter is saved again (``base_model_name_or_path`` is
#: compared where both saves name one), or that only chose its initial values
VOLATILE_ADAPTER_KEYS = frozenset({
    "base_model_name_or_path", "revision", "inference_mode", "auto_mapping", "peft_version", "runtime_config",
    "init_lora_weights", "init_weights", "init_ia3_weights", "loftq_config", "eva_config", "corda_config",
    "lora_ga_config"})
# training-only hyperparameters (of either kind): they shape no weight
_TRAINING_ONLY = re.compile(r".*(dropout|_pdrop|layerdrop).*|initializer_range|initializer_factor|init_std")
_SHOWN = 6  # differing fields named in a refusal
_VALUE_CHARS = 60  # of each value shown


class _Unset:
    def __repr__(self) -> str:
        return "unset"


_UNSET = _Unset()

#: the advice a refusal ends with (:mod:`torchloom.hf.trainer_errors` rewords it for TorchloomTrainer.save_model)
OVERWRITE_ADVICE = ("Pass overwrite=True to replace that model's files (config, weights, adapter and tokenizer "
                    "files; other files in the folder stay), or save into another directory.")


def is_model_file(name: str) -> bool:
    """Whether ``name`` is a file a full-model or adapter ``save_pretrained`` writes (config, weights, index)."""
    return bool(FULL_FILE.fullmatch(name) or ADAPTER_FILE.fullmatch(name))


@dataclass(frozen=True)
class Saved:
    """One save's identity: ``kind`` ("full" or "adapter") and what tells two models of that kind apart (None:
    not known, e.g. weights whose config an interrupted save already removed). ``config``: for the new save the
    live config object (``PretrainedConfig`` / peft config), for one found in a folder its JSON dict."""

    kind: str
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None
    peft_type: str | None = None
    base_model: str | None = None
    base_class: str | None = None
    unreadable: str | None = None  # a config file that is not JSON: its model cannot be known
    foreign: str | None = None  # a config file no Hugging Face / peft save wrote (no model_type / peft_type)
    config: Any = field(default=None, compare=False, repr=False)

    def describe(self) -> str:
        if self.foreign:
            return self.foreign
        if self.kind == "full":
            parts = [f"model_type {self.model_type!r}" if self.model_type else "",
                     ", ".join(self.architectures or ())]
            what = "a full model"
        else:
            parts = [self.peft_type or "", f"base model {self.base_model!r}" if self.base_model else "",
                     self.base_class or ""]
            what = "a peft adapter"
        if self.unreadable:
            parts.append(self.unreadable)
        parts = [p for p in parts if p]
        return f"{what} ({', '.join(parts)})" if parts else what

    def differences(self, old: Saved) -> list[str]:
        """Why ``old`` (found in the folder) is another model than this save's, one reason per item; [] when it
        is an earlier save of the same model (same-kind weights without a config, an interrupted save,
        included)."""
        if old.foreign:
            return ["no Hugging Face or peft save wrote that config"]
        if old.unreadable:
            return ["what that model is cannot be known"]
        if old.kind != self.kind:
            return [f"a {_KIND[old.kind]} there, a {_KIND[self.kind]} in this save"]
        if self.kind == "full":
            return self._full_differences(old)
        return self._adapter_differences(old)

    def _full_differences(self, old: Saved) -> list[str]:
        if self.model_type and old.model_type and self.model_type != old.model_type:
            return [f"model_type {old.model_type!r} there, {self.model_type!r} in this save"]
        out = []
        if old.architectures and self.architectures and not set(self.architectures) & set(old.architectures):
            out.append(f"architectures {list(old.architectures)} there, {', '.join(self.architectures)} in this save")
        if isinstance(old.config, dict) and self.config is not None:
            out += config_differences(self.config, old.config)
        return out

    def _adapter_differences(self, old: Saved) -> list[str]:
        if self.peft_type and old.peft_type and self.peft_type != old.peft_type:
            return [f"peft_type {old.peft_type!r} there, {self.peft_type!r} in this save"]
        out = []
        if self.base_model and old.base_model and self.base_model != old.base_model:
            out.append(f"base model {old.base_model!r} there, {self.base_model!r} in this save")
        if self.base_class and old.base_class and self.base_class != old.base_class:
            out.append(f"base class {old.base_class} there, {self.base_class} in this save")
        if isinstance(old.config, dict) and self.config is not None:
            out += adapter_differences(self.config, old.config)
        return out


_KIND = {"full": "full model", "adapter": "peft adapter"}


def config_differences(config: Any, saved: dict) -> list[str]:
    """The model-defining fields on which the live ``config`` (a ``transformers.PretrainedConfig``) and ``saved``
    (a ``config.json`` dict of the same ``model_type``) differ, as ``"<field> <saved value> there, <new value>
    in this save"`` (nested configs as ``text_config.hidden_size``); [] for the same model.

    Both sides go through ``config``'s class (``from_dict`` of what its ``save_pretrained`` writes), so a field a
    file leaves out (transformers writes only the non-default ones) is compared at its default. Not compared:
    :data:`VOLATILE_CONFIG_KEYS`, private ``_...`` keys, generation settings (``GenerationConfig``'s fields:
    sampling, special token ids), dropout rates and initialisation ranges.
    """
    cls = type(config)
    with _quiet():
        try:
            old = cls.from_dict(copy.deepcopy(saved)).to_dict()
        except Exception as e:  # noqa: BLE001  (transformers' config validation: any error means "not this model")
            return [f"config.json does not load as {cls.__name__}: {type(e).__name__}: {e}"]
        try:  # exactly what the new save writes, read back as from_pretrained reads it
            new = cls.from_dict(config.to_diff_dict()).to_dict()
        except Exception:  # noqa: BLE001  (a config that does not round-trip: compare the live one as it is)
            new = config.to_dict()
    volatile = VOLATILE_CONFIG_KEYS | _generation_keys()
    return _field_differences(_fields(old, volatile), _fields(new, volatile))


def adapter_differences(config: Any, saved: dict) -> list[str]:
    """The adapter-defining fields on which the live peft ``config`` (a ``PeftConfig`` dataclass) and ``saved`` (an
    ``adapter_config.json`` dict) differ, as :func:`config_differences` names them; [] for the same adapter.

    The fields are ``config``'s dataclass fields (one the file lacks, from another peft version, is compared at
    its default); lists and sets of names (``target_modules``, ``modules_to_save``) are compared in any order.
    Not compared: :data:`VOLATILE_ADAPTER_KEYS`, private keys and dropout rates.
    """
    if not dataclasses.is_dataclass(config):
        return []
    new, old = {}, {}
    for f in dataclasses.fields(config):
        new[f.name] = _plain(getattr(config, f.name, None))
        if f.name in saved:
            old[f.name] = _plain(saved[f.name])
        elif f.default is not dataclasses.MISSING:
            old[f.name] = _plain(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            old[f.name] = _plain(f.default_factory())
    return _field_differences(_fields(old, VOLATILE_ADAPTER_KEYS), _fields(new, VOLATILE_ADAPTER_KEYS))


@contextlib.contextmanager
def _quiet():
    """transformers' log lines and Python warnings off (restored after): reading a config back for the comparison
    (legacy keys of a downloaded config.json, say) is not something the user did."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


@functools.cache
def _generation_keys() -> frozenset[str]:
    from transformers import GenerationConfig

    return frozenset(GenerationConfig().to_dict())


def _fields(d: dict, volatile: frozenset[str], prefix: str = "") -> dict[str, Any]:
    """``d``'s compared fields, nested dicts flattened to dotted names."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        k = str(k)
        if k.startswith("_") or k in volatile or _TRAINING_ONLY.fullmatch(k):
            continue
        if k == "id2label":  # the labels' names may be set later; their number shapes the head
            out[prefix + "num_labels"] = len(v) if isinstance(v, dict) else v
        elif isinstance(v, dict) and v:
            out.update(_fields(v, volatile, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _plain(v: Any) -> Any:
    """``v`` as JSON holds it: enums as their value, tuples and sets as lists, lists of names sorted."""
    if isinstance(v, enum.Enum):
        return _plain(v.value)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _plain(dataclasses.asdict(v))
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, set, frozenset)):
        items = [_plain(x) for x in v]
        if isinstance(v, (set, frozenset)) or (items and all(isinstance(x, str) for x in items)):
            items = sorted(items, key=str)
        return items
    return v


def _field_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    diffs = [f"{k} {_show(old.get(k, _UNSET))} there, {_show(new.get(k, _UNSET))} in this save"
             for k in sorted(set(old) | set(new)) if old.get(k, _UNSET) != new.get(k, _UNSET)]
    if len(diffs) > _SHOWN:
        diffs = [*diffs[:_SHOWN], f"and {len(diffs) - _SHOWN} more fields"]
    return diffs


def _show(v: Any) -> str:
    text = repr(v) if v is _UNSET else json.dumps(v, default=str)
    return text if len(text) <= _VALUE_CHARS else text[:_VALUE_CHARS - 3] + "..."


def planned(src: Any, merge: bool) -> dict[Path, Saved]:
    """What the save of ``src`` (:class:`torchloom.hf.save._Source`) writes, by folder relative to the
    destination: a full model into ``.``; a peft adapter named ``default`` into ``.``, any other into
    ``<name>/`` (as peft does)."""
    if src.peft is None or merge:
        return {Path("."): Saved("full", getattr(src.config, "model_type", None) or None, (src.cls.__name__,),
                                 config=src.config)}
    out = {}
    for name, cfg in src.peft.peft_config.items():
        peft_type = getattr(cfg, "peft_type", None)
        out[Path(".") if name == "default" else Path(name)] = Saved(
            "adapter", peft_type=str(getattr(peft_type, "value", peft_type)) if peft_type else None,
            base_model=getattr(cfg, "base_model_name_or_path", None) or None, base_class=src.cls.__name__,
            config=cfg)
    return out


def found(folder: Path) -> tuple[list[Saved], list[str]]:
    """The saves in ``folder`` (none, one, or both kinds) and the names of its model and tokenizer files."""
    if not folder.is_dir():
        return [], []
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    saves = []
    pending, _ = _read_json(folder / PENDING_FILE)
    if any(FULL_FILE.fullmatch(n) for n in names):
        cfg, bad = _config(folder, "config.json", pending)
        arch = cfg.get("architectures")
        foreign = _foreign(folder / "config.json", cfg, bad, "model_type", "a Hugging Face model config")
        saves.append(Saved("full", cfg.get("model_type") or None,
                           tuple(arch) if isinstance(arch, list) and arch else None, unreadable=bad,
                           foreign=foreign, config=cfg if cfg and not foreign else None))
    if any(ADAPTER_FILE.fullmatch(n) for n in names):
        cfg, bad = _config(folder, "adapter_config.json", pending)
        mapping = cfg.get("auto_mapping") if isinstance(cfg.get("auto_mapping"), dict) else {}
        foreign = _foreign(folder / "adapter_config.json", cfg, bad, "peft_type", "a peft adapter config")
        saves.append(Saved("adapter", peft_type=cfg.get("peft_type") or None,
                           base_model=cfg.get("base_model_name_or_path") or None,
                           base_class=mapping.get("base_model_class") or None, unreadable=bad, foreign=foreign,
                           config=cfg if cfg and not foreign else None))
    return saves, [n for n in names if is_model_file(n) or TOKENIZER_FILE.fullmatch(n)]


def _config(folder: Path, name: str, pending: dict) -> tuple[dict, str | None]:
    """The config file ``name`` of the model in ``folder`` (read as :func:`_read_json`). Absent (weights alone):
    the one an interrupted save was putting there (``pending``, :data:`PENDING_FILE`), else why the weights'
    model cannot be known."""
    if (folder / name).exists():
        return _read_json(folder / name)
    text = pending.get(name)
    if isinstance(text, str):
        try:
            cfg = json.loads(text)
        except ValueError:
            cfg = None
        if isinstance(cfg, dict):
            return cfg, None
    return {}, (f"no {name} beside the weights, and no interrupted save of one (no {PENDING_FILE}): what model "
                "they hold cannot be known")


def _foreign(path: Path, cfg: dict, bad: str | None, key: str, what: str) -> str | None:
    """Why ``path`` (read as ``cfg``) is not a file a Hugging Face / peft save wrote: every such file names its
    ``key``. None when it may be one (or is absent, or unreadable: said elsewhere)."""
    if bad or not path.exists() or key in cfg:
        return None
    keys = sorted(cfg)
    shown = ", ".join(keys[:8]) + (f", ... ({len(keys)} keys)" if len(keys) > 8 else "")
    article = "an" if path.name[0] in "aeiou" else "a"
    return f"{article} {path.name} that is not {what} (no {key}; its keys: {shown or 'none'})"


def check(dest: Path, plan: dict[Path, Saved], overwrite: bool, tokenizer: bool = False) -> set[Path]:
    """Refuse a save into a folder holding another model; returns the folders (relative to ``dest``) whose other
    model ``overwrite=True`` lets this save replace. ``tokenizer``: the save writes tokenizer files into ``dest``.

    Raises:
        CheckpointError: ``dest`` is not a directory; a folder of ``plan`` holds a config file no Hugging Face /
            peft save wrote (never replaced); or, without ``overwrite``, a folder of ``plan`` holds another model
            (naming it, its files, how it differs from the new one, and the switch), or ``dest`` holds tokenizer
            files but no model (no earlier save wrote them) and ``tokenizer`` is set.
    """
    if dest.exists() and not dest.is_dir():
        raise CheckpointError(f"save_pretrained: {dest} exists and is not a directory")
    replacing = set()
    for rel, new in plan.items():
        saves, files = found(dest / rel)
        other = [(s, why) for s in saves if (why := new.differences(s))]
        if not other:
            continue
        where = dest / rel if rel != Path(".") else dest
        foreign = [s for s, _ in other if s.foreign]
        if foreign:  # a user's file: overwrite=True replaces only what a Hugging Face / peft save wrote
            raise CheckpointError(
                f"save_pretrained: {where} holds {foreign[0].describe()}: {_listing(files)}; this save writes "
                f"{new.describe()}, whose "
                f"{'config.json' if new.kind == 'full' else 'adapter_config.json'} would replace it. No Hugging Face "
                f"or peft save wrote that file, so it is never replaced (overwrite=True neither): nothing was "
                f"written. Move that file out of {where}, or save into another directory.")
        if not overwrite:
            held = " and ".join(s.describe() for s, _ in other)
            why = "; ".join(w for _, ws in other for w in ws)
            raise CheckpointError(
                f"save_pretrained: {where} holds {held}: {_listing(files)}; this save writes {new.describe()}, "
                f"another model ({why}). A save replaces only an earlier save of the same model, so nothing was "
                f"written. {OVERWRITE_ADVICE}")
        replacing.add(rel)
    if tokenizer and not overwrite:
        saves, files = found(dest)
        tok = [n for n in files if TOKENIZER_FILE.fullmatch(n)]
        if tok and not saves:  # no model there: the tokenizer files are not an earlier save's
            raise CheckpointError(
                f"save_pretrained: {dest} holds tokenizer files but no model: {_listing(tok)}; this save writes "
                f"{next(iter(plan.values())).describe()} with its tokenizer, which would replace them. Only an "
                f"earlier save's tokenizer is replaced without asking, so nothing was written. Pass overwrite=True "
                f"to replace them, save without tokenizer=, or save into another directory.")
    return replacing


def _read_json(path: Path) -> tuple[dict, str | None]:
    """``path``'s JSON object ({} if absent), and why it could not be read (None if it could)."""
    if not path.exists():
        return {}, None
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        return {}, f"{path.name} cannot be read: {e}"
    return (data, None) if isinstance(data, dict) else ({}, f"{path.name} is not a JSON object")


def _listing(names: list[str]) -> str:
    """``names``, a run of shards shortened to its first and last."""
    shards = [n for n in names if _SHARD.search(n)]
    if len(shards) > 2:
        names = [n for n in names if n not in shards[1:-1]]
        names[names.index(shards[0])] = f"{shards[0]} ... {shards[-1]}"
        names.remove(shards[-1])
    return ", ".join(names)
