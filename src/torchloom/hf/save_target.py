"""What a :func:`torchloom.hf.save_pretrained` folder already holds, and whether the new save may replace it.

A save replaces only an earlier save of the same model: a full model of the same ``model_type`` and class, or
a peft adapter of the same type and base model. Anything else (another ``model_type``, a full model where an
adapter goes or the reverse: transformers would load the old adapter on top of a new merged model) is refused
before anything is gathered or written, unless ``overwrite=True``. Files that no Hugging Face / peft save
writes (the user's notes, ``checkpoints/``, a ``README.md``) are never touched.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
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


def is_model_file(name: str) -> bool:
    """Whether ``name`` is a file a full-model or adapter ``save_pretrained`` writes (config, weights, index)."""
    return bool(FULL_FILE.fullmatch(name) or ADAPTER_FILE.fullmatch(name))


@dataclass(frozen=True)
class Saved:
    """One save's identity: ``kind`` ("full" or "adapter") and what tells two models of that kind apart (None:
    not known, e.g. weights whose config an interrupted save already removed)."""

    kind: str
    model_type: str | None = None
    architectures: tuple[str, ...] | None = None
    peft_type: str | None = None
    base_model: str | None = None
    base_class: str | None = None
    unreadable: str | None = None  # a config file that is not JSON: its model cannot be known

    def describe(self) -> str:
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

    def differs(self, old: Saved) -> bool:
        """Whether ``old`` (found in the folder) is another model than this save's: another kind, or a field
        both know that differs. Same-kind weights without a config (an interrupted save) are not."""
        if old.kind != self.kind or old.unreadable:
            return True
        pairs = [(self.model_type, old.model_type), (self.architectures, old.architectures),
                 (self.peft_type, old.peft_type), (self.base_model, old.base_model),
                 (self.base_class, old.base_class)]
        return any(a and b and a != b for a, b in pairs)


def planned(src: Any, merge: bool) -> dict[Path, Saved]:
    """What the save of ``src`` (:class:`torchloom.hf.save._Source`) writes, by folder relative to the
    destination: a full model into ``.``; a peft adapter named ``default`` into ``.``, any other into
    ``<name>/`` (as peft does)."""
    if src.peft is None or merge:
        return {Path("."): Saved("full", getattr(src.config, "model_type", None) or None, (src.cls.__name__,))}
    out = {}
    for name, cfg in src.peft.peft_config.items():
        peft_type = getattr(cfg, "peft_type", None)
        out[Path(".") if name == "default" else Path(name)] = Saved(
            "adapter", peft_type=str(getattr(peft_type, "value", peft_type)) if peft_type else None,
            base_model=getattr(cfg, "base_model_name_or_path", None) or None, base_class=src.cls.__name__)
    return out


def found(folder: Path) -> tuple[list[Saved], list[str]]:
    """The saves in ``folder`` (none, one, or both kinds) and the names of its model and tokenizer files."""
    if not folder.is_dir():
        return [], []
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    saves = []
    if any(FULL_FILE.fullmatch(n) for n in names):
        cfg, bad = _read_json(folder / "config.json")
        arch = cfg.get("architectures")
        saves.append(Saved("full", cfg.get("model_type") or None,
                           tuple(arch) if isinstance(arch, list) and arch else None, unreadable=bad))
    if any(ADAPTER_FILE.fullmatch(n) for n in names):
        cfg, bad = _read_json(folder / "adapter_config.json")
        mapping = cfg.get("auto_mapping") if isinstance(cfg.get("auto_mapping"), dict) else {}
        saves.append(Saved("adapter", peft_type=cfg.get("peft_type") or None,
                           base_model=cfg.get("base_model_name_or_path") or None,
                           base_class=mapping.get("base_model_class") or None, unreadable=bad))
    return saves, [n for n in names if is_model_file(n) or TOKENIZER_FILE.fullmatch(n)]


def check(dest: Path, plan: dict[Path, Saved], overwrite: bool) -> set[Path]:
    """Refuse a save into a folder holding another model; returns the folders (relative to ``dest``) whose other
    model ``overwrite=True`` lets this save replace.

    Raises:
        CheckpointError: ``dest`` is not a directory; or, without ``overwrite``, a folder of ``plan`` holds
            another model (naming it, its files, the new model and the switch).
    """
    if dest.exists() and not dest.is_dir():
        raise CheckpointError(f"save_pretrained: {dest} exists and is not a directory")
    replacing = set()
    for rel, new in plan.items():
        saves, files = found(dest / rel)
        other = [s for s in saves if new.differs(s)]
        if not other:
            continue
        if not overwrite:
            where = dest / rel if rel != Path(".") else dest
            raise CheckpointError(
                f"save_pretrained: {where} holds {' and '.join(s.describe() for s in other)}: {_listing(files)}; "
                f"this save writes {new.describe()}. A save replaces only an earlier save of the same model, so "
                f"nothing was written. Pass overwrite=True to replace that model's files (config, weights, "
                f"adapter and tokenizer files; other files in the folder stay), or save into another directory.")
        replacing.add(rel)
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
