"""Which tokens of each sample a sequence-split rank holds."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import StrategyError


@dataclass(frozen=True)
class SequenceLayout:
    """The split of a length-``S`` sequence over ``cp`` ranks.

    ``load_balance=True`` (ring attention's causal load balancing; Megatron-Core's and torchtitan's layout): the
    sequence is cut into ``2 cp`` equal chunks and rank ``r`` holds chunk ``r`` and its mirror ``2 cp - 1 - r``,
    so every rank does the same causal attention work. ``False``: rank ``r`` holds the ``r``-th of ``cp``
    contiguous chunks (Ulysses: after its all-to-all the chunks concatenate in sequence order).

    ``ulysses > 1`` (the ring x Ulysses hybrid, Fang & Zhao 2024 "USP"): the cp ranks form ``cp / ulysses`` ring
    ranks of ``ulysses`` adjacent ranks each; the sequence is split over the ring ranks as above, and each ring
    rank's tokens are cut into ``ulysses`` contiguous parts, one per member (Ulysses' all-to-all concatenates
    them back into the ring rank's tokens).

    Attributes:
        cp: ranks the sequence is split over (the ``cp`` mesh degree).
        rank: this rank's index in the cp group, ``0 <= rank < cp``.
        load_balance: zigzag chunks (True) or contiguous (False).
        ulysses: Ulysses degree inside the cp group (1: ring only; ``cp``: Ulysses only).
    """

    cp: int
    rank: int
    load_balance: bool = True
    ulysses: int = 1

    @property
    def ring(self) -> "SequenceLayout":
        """The split over the ring ranks (this rank's ring rank; every member of a Ulysses group shares it)."""
        return SequenceLayout(self.cp // self.ulysses, self.rank // self.ulysses, self.load_balance)

    @property
    def chunks(self) -> int:
        """Equal chunks the sequence is cut into (``2 cp`` load-balanced, else ``cp``)."""
        return 2 * self.cp if self.load_balance else self.cp

    def check(self, seq_len: int) -> None:
        """Raises StrategyError when ``seq_len`` is not a multiple of :attr:`chunks` (the fix named)."""
        if seq_len % self.chunks:
            how = f"2 x cp={self.cp}" if self.load_balance else f"cp={self.cp}"
            raise StrategyError(
                f"sequence split over cp={self.cp}: the sequence length {seq_len} is not a multiple of {self.chunks} "
                f"({how} equal chunks); pad every batch to a multiple of {self.chunks} tokens (loom train: model.seq_len; "
                f"a collator: pad_to_multiple_of={self.chunks}) or choose another cp.")

    def indices(self, seq_len: int, rank: int | None = None, device=None) -> torch.Tensor:
        """Global token indices (int64 ``[seq_len / cp]``, increasing) that ``rank`` (default: this one) holds."""
        self.check(seq_len)
        r = self.rank if rank is None else rank
        if self.ulysses > 1:
            ring = self.ring.indices(seq_len, r // self.ulysses, device=device)
            part = seq_len // self.cp
            return ring[(r % self.ulysses) * part:(r % self.ulysses + 1) * part]
        c = seq_len // self.chunks
        if not self.load_balance:
            return torch.arange(r * c, (r + 1) * c, device=device)
        back = 2 * self.cp - 1 - r
        return torch.cat([torch.arange(r * c, (r + 1) * c, device=device),
                          torch.arange(back * c, (back + 1) * c, device=device)])

    def shard(self, t: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of ``t`` along ``dim`` (a copy, contiguous)."""
        return t.index_select(dim, self.indices(t.shape[dim], device=t.device))

    def unshard(self, shards: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """Reassemble the full sequence from every rank's shard (``shards[r]`` from rank ``r``), e.g. after an
        all-gather; the inverse of :meth:`shard`."""
        local = shards[0].shape[dim]
        seq = local * self.cp
        order = torch.cat([self.indices(seq, r) for r in range(self.cp)]).to(shards[0].device)
        cat = torch.cat(shards, dim=dim)
        out = torch.empty_like(cat)
        return out.index_copy_(dim, order, cat)
