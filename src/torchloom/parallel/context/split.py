"""`SequenceSplitter`: one micro-batch in, this cp rank's tokens of every sample out (docs/methods/
context_parallel.md, "What the split does to a batch")."""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from .layout import SequenceLayout
from .sequence import SequenceInfo, activate

IGNORE_INDEX = -100


class SequenceBatch(dict):
    """A split micro-batch: a plain mapping for ``model(**batch)`` with its :class:`SequenceInfo` attached
    (``.sequence``); ``train_step`` makes it active around forward, loss and backward (:meth:`activate`)."""

    sequence: SequenceInfo

    @contextlib.contextmanager
    def activate(self, check: bool = True):
        """Make this batch's :class:`SequenceInfo` active; on a clean exit (with ``check``), raise if the model
        made no attention call through the split (it computes attention in a way the split cannot see: every
        rank would attend within its own tokens only). Pipeline stages without attention layers exist, so the
        pipelined path does not check."""
        info = self.sequence
        start = info.calls
        with activate(info):
            yield info
        if check and info.calls == start:
            raise RuntimeError(
                f"sequence split ({info.kind}, cp={info.layout.cp}): the model made no attention call through "
                "torch.nn.functional.scaled_dot_product_attention, so each rank attended only within its own tokens "
                "(a silent wrong result). Use an SDPA attention (Hugging Face: attn_implementation='sdpa'), or call "
                "torch.nn.functional.scaled_dot_product_attention at run time rather than a reference bound at import.")


_WARNED: set[str] = set()


def _warn_documents(batch) -> None:
    """Once: packed documents are always masked under the split, unlike HF's SDPA path with a KV cache."""
    if "documents" in _WARNED or batch.get("use_cache") is False:
        return
    _WARNED.add("documents")
    import warnings

    warnings.warn("sequence split: position_ids restart inside samples (packed documents), so attention is masked per "
                  "document. Hugging Face's SDPA path does that only with use_cache=False (with a cache it attends "
                  "across documents): compare with use_cache=False, or pass it in the batch.", stacklevel=3)


def attention_window(model) -> tuple[int | None, bool]:
    """``(window, every_layer)`` of a Hugging Face model's sliding-window attention (a query sees the keys less
    than ``window`` tokens back, HF's ``sliding_window_overlay``), or ``(None, True)`` without one.
    ``every_layer`` is False when only some layers slide (``config.layer_types`` mixed)."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None) if config is not None else None
    if not window or not getattr(config, "use_sliding_window", True):
        return None, True
    types = getattr(config, "layer_types", None)
    if not types:
        return int(window), True
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None, True
    return int(window), all(sliding)


def forward_parameters(model: torch.nn.Module) -> tuple[set[str], bool]:
    """The keyword names ``model.forward`` accepts and whether it takes ``**kwargs``."""
    params = inspect.signature(model.forward).parameters.values()
    return ({p.name for p in params}, any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params))


class SequenceSplitter:
    """Split mapping batches (``model(**batch)``, Hugging Face style) over the cp ranks.

    For a batch with ``input_ids`` (or ``inputs_embeds``) ``[B, S]``:

    * every tensor whose first two dims are ``[B, S]`` is cut to this rank's tokens (:class:`SequenceLayout`);
    * ``labels`` are shifted left over the whole sequence first (``labels[t + 1]``; the last token gets
      ``-100``), because the target of a rank's last token lives on another rank; the shifted shard is passed
      as ``labels`` and, when the forward takes it, as ``shift_labels`` (HF's ``ForCausalLMLoss`` then does
      not shift again), with ``num_items_in_batch`` = the sample batch's target count / cp, so a model's own
      loss (a sum over the rank's tokens divided by it) averages over cp to the exact global per-token mean.
      Loss functions that shift themselves must not shift these labels: ``SumLoss.from_hf`` and
      ``torchloom.hf.loss.causal_lm_sum`` detect them (``labels_preshifted``);
    * ``position_ids`` are kept global (added when missing: RoPE sees true positions); a position restart
      (``position_ids[t] != position_ids[t - 1] + 1``, HF's packed-sequence convention) starts a new
      document, and attention never crosses documents;
    * a 2-D ``attention_mask`` (1 = token, 0 = padding) is removed from the batch and becomes key padding in
      the :class:`SequenceInfo` (a model would build its mask from its local tokens only).

    Args:
        group: the cp process group (reductions of the loss's sums).
        kind: ``"ring"`` or ``"ulysses"`` (Ulysses over all cp ranks: contiguous parts).
        load_balance: zigzag chunks (ring's causal load balancing).
        ulysses: with ``kind="ring"``, the Ulysses degree inside cp (the ring x Ulysses hybrid); 1: ring only.
        ring_group / ulysses_group: the process groups of the ring and of the all-to-all (default: ``group``).
        causal: the mask for attention calls that pass one (see :class:`SequenceInfo`).
        model: its ``forward`` signature decides which of ``position_ids``, ``shift_labels`` and
            ``num_items_in_batch`` are passed.
        window: sliding-window attention (a query sees keys less than ``window`` tokens back), None, or
            ``"model"`` (default): the model config's (``attention_window``).
        window_every_layer: False when only some layers slide: then a sequence longer than the window is
            refused (an attention call does not say which layer it is).
        pipelined: the model runs as pipeline stages: ``shift_labels`` / ``num_items_in_batch`` are not added
            (the pipeline's last stage computes the loss from the pre-shifted ``labels``).

    Raises (when called):
        TypeError: the batch is not a mapping with ``input_ids``/``inputs_embeds``.
        ValueError: a padding mask that is not ``[B, S]``, or a model without ``position_ids``.
        StrategyError: a sequence length the chunks do not divide (the fix named).
    """

    def __init__(self, *, group, cp: int, rank: int, kind: str = "ring", load_balance: bool = True,
                 ulysses: int = 1, ring_group=None, ulysses_group=None,
                 causal: bool = True, model: torch.nn.Module | None = None, window: int | None | str = "model",
                 window_every_layer: bool = True, pipelined: bool = False):
        if kind == "ulysses":
            ulysses, load_balance = cp, False  # Ulysses alone: contiguous parts, all ranks in the all-to-all
        self.layout = SequenceLayout(cp, rank, load_balance, ulysses)
        self.group, self.kind, self.causal = group, kind, causal
        self.ring_group, self.ulysses_group = ring_group, ulysses_group
        if window == "model":
            window, window_every_layer = attention_window(model)
        self.window, self.window_every_layer = window, window_every_layer
        self.pipelined = pipelined
        self._names, self._any = forward_parameters(model) if model is not None else (set(), True)
        config = getattr(model, "config", None)
        heads = getattr(config, "num_attention_heads", None)
        kv = getattr(config, "num_key_value_heads", None) or heads
        self.kv_groups = heads // kv if heads and kv and heads % kv == 0 else 1

    def accepts(self, name: str) -> bool:
        return self._any or name in self._names

    def __call__(self, batch: Any) -> SequenceBatch:
        if isinstance(batch, SequenceBatch):
            return batch  # already split (a replayed window)
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"sequence split (cp={self.layout.cp}) needs mapping batches passed as model(**batch) with input_ids "
                f"(model_input_format='unpack_dict'), got {type(batch).__name__}.")
        ids = batch.get("input_ids", batch.get("inputs_embeds"))
        if not isinstance(ids, torch.Tensor) or ids.dim() < 2:
            raise TypeError("sequence split: the batch has no input_ids/inputs_embeds [batch, seq] tensor; name the "
                            f"token ids 'input_ids' (got keys {sorted(batch)}).")
        b, s = ids.shape[:2]
        self.layout.check(s)
        if self.window and not self.window_every_layer and s > self.window:
            raise ValueError(f"sequence split: {s} tokens exceed the sliding window ({self.window}) that only some of "
                             "the model's layers use; the split applies one mask to every layer. Use sequences of at "
                             "most the window, or one attention type for every layer.")
        lay, dev = self.layout, ids.device
        pos = batch.get("position_ids")
        document = None
        if pos is not None:
            pos = pos.expand(b, s) if pos.dim() == 1 or pos.shape[0] == 1 else pos
            docs = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
            if bool((docs[:, -1] != 0).any()):
                document = docs
                _warn_documents(batch)
        else:
            if not self.accepts("position_ids"):
                raise ValueError("sequence split: the model's forward takes no position_ids, so each rank would number "
                                 "its tokens from 0; under cp every token needs its global position.")
            pos = torch.arange(s, device=dev).expand(b, s)
        valid = None
        am = batch.get("attention_mask")
        if am is not None:
            if not isinstance(am, torch.Tensor) or tuple(am.shape) != (b, s):
                raise ValueError(f"sequence split: attention_mask must be the [batch, seq] = [{b}, {s}] padding mask "
                                 f"(1 = token, 0 = padding), got {getattr(am, 'shape', type(am))}; 4-D masks cannot "
                                 "be split (pass position_ids restarts for packed documents instead).")
            if not bool(am.bool().all()):
                valid = am.bool()
        out: dict[str, Any] = {}
        shifted = None
        for k, t in batch.items():
            if k == "attention_mask":
                continue
            if k == "labels" and isinstance(t, torch.Tensor):
                if tuple(t.shape[:2]) != (b, s) or t.dim() != 2:
                    raise ValueError(
                        f"sequence split: labels {tuple(t.shape)} are not [batch, seq] = [{b}, {s}] next-token targets; "
                        "the split serves causal language models (labels shifted over the whole sequence). "
                        "Sequence-level labels (classification) cannot be split.")
                shifted = lay.shard(F.pad(t[:, 1:], (0, 1), value=IGNORE_INDEX))
                out[k] = shifted
            elif k == "position_ids":
                out[k] = lay.shard(pos)
            elif isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (b, s):
                out[k] = lay.shard(t)
            else:
                out[k] = t
        if "position_ids" not in out:
            out["position_ids"] = lay.shard(pos)
        if shifted is not None and not self.pipelined:
            if self.accepts("shift_labels"):
                out["shift_labels"] = shifted
            if self.accepts("num_items_in_batch"):
                count = (F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX) != IGNORE_INDEX).sum()
                out["num_items_in_batch"] = count.clamp(min=1).float() / lay.cp
        sb = SequenceBatch(out)
        sb.sequence = SequenceInfo(lay, s, b, document=document, valid=valid, kind=self.kind, group=self.group,
                                   ring_group=self.ring_group, ulysses_group=self.ulysses_group,
                                   causal=self.causal, shifted_labels=shifted,
                                   window=self.window if self.window_every_layer else None,
                                   kv_groups=self.kv_groups)
        return sb
