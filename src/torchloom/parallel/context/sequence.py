"""`SequenceInfo`: what attention needs to know about a split batch's tokens, and the active one."""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from .layout import SequenceLayout


@dataclass
class SequenceInfo:
    """Global facts about one split micro-batch, from which every attention mask is computed.

    Masks are never taken from the model (it built them from its rank-local tokens); they follow from the
    global token index (causal), the document ids (packed sequences: a token attends only inside its document)
    and the key padding. Every cp rank holds the whole micro-batch before the split, so the ``[B, S]`` tensors
    here are global and no communication is needed to know another rank's keys.

    Attributes:
        layout: the split (:class:`SequenceLayout`).
        seq_len: ``S``, tokens per sample before the split.
        batch: ``B``, samples in the micro-batch.
        document: int64 ``[B, S]`` document id per token (packed sequences), or None (one document per sample).
        valid: bool ``[B, S]`` (False: padding, never attended to), or None (no padding).
        kind: ``"ring"`` (context parallel, with ``layout.ulysses > 1`` the ring x Ulysses hybrid) or
            ``"ulysses"``.
        group: the cp process group (the loss's sums are reduced over it).
        ring_group: the ranks the ring passes keys/values around (the cp group without Ulysses).
        ulysses_group: the ranks of this rank's Ulysses all-to-all (None without Ulysses).
        causal: the default for attention calls that pass a mask instead of ``is_causal`` (the model built a
            rank-local mask; it is replaced by the global one: causal when True).
        shifted_labels: the rank's labels, already shifted left globally (``labels[t + 1]``), or None.
        window: sliding-window attention: a query sees only keys less than ``window`` tokens back; or None.
        kv_groups: query heads per key/value head (grouped-query attention; the model config's
            ``num_attention_heads / num_key_value_heads``), 1 when unknown.
    """

    layout: SequenceLayout
    seq_len: int
    batch: int
    document: torch.Tensor | None = None
    valid: torch.Tensor | None = None
    kind: str = "ring"
    group: Any = None
    ring_group: Any = None
    ulysses_group: Any = None
    causal: bool = True
    shifted_labels: torch.Tensor | None = None
    window: int | None = None
    kv_groups: int = 1
    calls: int = field(default=0, compare=False)  # attention calls routed through the split (checked after forward)
    _pos: dict = field(default_factory=dict, repr=False, compare=False)

    def rows(self, start: int, stop: int) -> "SequenceInfo":
        """The facts of samples ``start:stop`` (a pipeline micro-batch of this split micro-batch); attention
        calls made under it count towards this one."""
        sub = dataclasses.replace(self, batch=stop - start,
                                  document=None if self.document is None else self.document[start:stop],
                                  valid=None if self.valid is None else self.valid[start:stop], calls=0)
        sub._parent = self
        return sub

    @property
    def local_len(self) -> int:
        return self.seq_len // self.layout.cp

    def positions(self, rank: int, device) -> torch.Tensor:
        """Global token indices held by cp rank ``rank`` (int64 ``[S / cp]``; cached per device)."""
        key = (rank, str(device))
        if key not in self._pos:
            self._pos[key] = self.layout.indices(self.seq_len, rank, device=device)
        return self._pos[key]

    def mask(self, q_idx: torch.Tensor, k_idx: torch.Tensor, causal: bool, batch: int) -> torch.Tensor | None:
        """Bool ``[B or 1, 1, len(q_idx), len(k_idx)]`` (True: attend) between the queries at global token
        indices ``q_idx`` and the keys at ``k_idx``, or None when every pair may attend. ``batch`` is the
        attention call's batch size: per-sample masks need it to equal :attr:`batch` (a pipeline schedule
        that splits the micro-batch further cannot use them: ValueError)."""
        m = None
        if causal:
            m = (q_idx[:, None] >= k_idx[None, :])[None, None]
        if self.window:
            near = ((q_idx[:, None] - k_idx[None, :]) < self.window)[None, None]
            m = near if m is None else m & near
        per_sample = None
        if self.document is not None:
            d = self.document.to(q_idx.device)
            per_sample = d[:, q_idx][:, :, None] == d[:, k_idx][:, None, :]
        if self.valid is not None:
            v = self.valid.to(q_idx.device)[:, k_idx][:, None, :]
            per_sample = v if per_sample is None else per_sample & v
        if per_sample is not None:
            if batch != self.batch:
                raise ValueError(
                    f"sequence split: the attention call has {batch} samples but the split micro-batch has "
                    f"{self.batch}; per-sample masks (padding, packed documents) cannot follow a further split of "
                    "the micro-batch (pipeline parallel micro-batches): pack without padding or drop pp.")
            per_sample = per_sample[:, None]
            m = per_sample if m is None else m & per_sample
        return m


_ACTIVE: list[SequenceInfo] = []


@contextlib.contextmanager
def activate_rows(start: int, stop: int):
    """Within the active split batch, make rows ``start:stop`` active (a pipeline stage computing one
    micro-batch); nothing when no split batch is active."""
    info = active_sequence()
    if info is None:
        yield None
        return
    sub = info.rows(start, stop)
    with activate(sub):
        yield sub
    info.calls += sub.calls


def active_sequence() -> SequenceInfo | None:
    """The :class:`SequenceInfo` of the split micro-batch being computed, or None outside one."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def activate(info: SequenceInfo):
    """Make ``info`` the active sequence (attention calls and ``labels_preshifted`` read it)."""
    _ACTIVE.append(info)
    try:
        yield info
    finally:
        _ACTIVE.pop()


def labels_preshifted(labels: torch.Tensor) -> bool:
    """True when ``labels`` is the active split batch's labels tensor (or rows of it: a pipeline micro-batch),
    which the split already shifted left over the whole sequence (a rank's last token's target lives on
    another rank, so the loss must not shift again: ``SumLoss.from_hf`` and ``causal_lm_sum`` read this)."""
    info = active_sequence()
    shifted = None if info is None else info.shifted_labels
    if shifted is None or not isinstance(labels, torch.Tensor):
        return False
    if labels is shifted:
        return True
    # a row slice shares the storage and the row stride
    return (labels.untyped_storage().data_ptr() == shifted.untyped_storage().data_ptr()
            and labels.dim() == shifted.dim() and labels.shape[1:] == shifted.shape[1:]
            and labels.stride() == shifted.stride())
