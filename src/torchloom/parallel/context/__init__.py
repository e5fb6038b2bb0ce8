"""The sequence axis: every sample's tokens split over the ``cp`` mesh dimension, and attention computed exactly
across the split (docs/methods/context_parallel.md).

* :mod:`.layout` — which tokens of a sample a rank holds (contiguous, or load-balanced "zigzag" chunks).
* :mod:`.sequence` — :class:`SequenceInfo`: the global positions, document ids and key padding of a batch,
  from which every attention mask under the split is computed (one notion of "this rank's tokens").
* :mod:`.split` — :class:`SequenceSplitter`: a batch in, this rank's shard of it out (labels shifted
  globally first, position ids kept global, the 2-D padding mask moved into the :class:`SequenceInfo`).
* :mod:`.ring` — ring attention (keys/values passed around the cp ranks, online-softmax merge, backward
  with the matching ring).
* :mod:`.ulysses` — Ulysses attention (all-to-all from sequence shards to head shards and back).
* :mod:`.dispatch` — ``torch.nn.functional.scaled_dot_product_attention`` routed to them while a split
  batch is active, so unchanged models (HF's SDPA attention, torchloom's default model) run split.
"""
from .dispatch import attention_calls, sequence_attention
from .layout import SequenceLayout
from .sequence import SequenceInfo, active_sequence, labels_preshifted
from .split import SequenceBatch, SequenceSplitter

__all__ = ["SequenceLayout", "SequenceInfo", "SequenceSplitter", "SequenceBatch", "sequence_attention",
           "active_sequence", "labels_preshifted", "attention_calls"]
