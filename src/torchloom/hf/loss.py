"""Token-exact causal-LM loss sums from a Hugging Face output, for :meth:`torchloom.SumLoss.from_hf`.

The numerics follow ``transformers.loss.loss_utils.ForCausalLMLoss`` (transformers 5.x): logits upcast to
fp32, labels shifted left by padding one ``ignore_index`` on the right (so ``logits[:, t]`` predicts
``labels[:, t + 1]`` and the last position predicts nothing), one ``cross_entropy(..., reduction="sum")``
over the flattened tokens. HF divides that sum by ``num_items_in_batch`` (or takes the mean); torchloom
keeps the sum and the count apart, and ``train_step`` divides by the count summed over accumulation steps
and data-parallel ranks.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from ..parallel.context.sequence import labels_preshifted

__all__ = ["causal_lm_logits", "causal_lm_sum"]


def causal_lm_logits(output: Any) -> torch.Tensor:
    """The ``[B, T, V]`` logits of a model output: ``output.logits`` (a ``ModelOutput``), ``output["logits"]``
    (a mapping), ``output[0]`` (a tuple/list, as ``return_dict=False`` returns; a leading 0-dim loss is
    skipped) or the tensor itself.

    Raises:
        TypeError: no logits tensor could be found.
    """
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if logits is None and isinstance(output, (tuple, list)):
        # HF's return_dict=False: (loss, logits, ...) when labels were given, else (logits, ...)
        logits = next((t for t in output if isinstance(t, torch.Tensor) and t.dim() >= 2), None)
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"SumLoss.from_hf: found no logits in the model output ({type(output).__name__}); pass "
                        "the output of a causal-LM model (with .logits), a (loss?, logits, ...) tuple or the logits.")
    return logits


def causal_lm_sum(logits: torch.Tensor, labels: torch.Tensor, *, ignore_index: int = -100,
                  shift: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of tokens it sums over.

    Args:
        logits: ``[B, T, V]`` (or ``[N, V]`` with ``shift=False``), any float dtype; computed in fp32.
        labels: ``[B, T]`` int64 token ids, ``ignore_index`` where no loss is wanted (padding, prompt).
        shift: True (HF causal LM): ``logits[:, t]`` is scored against ``labels[:, t + 1]``. False: labels are
            already aligned with the logits (e.g. HF's ``shift_labels``). Labels a sequence split already
            shifted over the whole sequence (context parallel / Ulysses: ``labels_preshifted``) are never
            shifted again.

    Returns:
        ``(total, count)``: fp32 0-dim sum over the valid targets (differentiable), int64 0-dim count of
        targets ``!= ignore_index`` (on the labels' device; no host sync).

    Raises:
        ValueError: the logits and labels shapes do not line up.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"SumLoss.from_hf: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}: "
                         "the logits must be [..., V] over the same leading dimensions as the labels.")
    if shift and not labels_preshifted(labels):
        # ForCausalLMLoss: pad then drop the first label, instead of slicing the logits (no logits copy)
        labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    labels = labels.reshape(-1).to(logits.device)
    total = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels, ignore_index=ignore_index,
                            reduction="sum")
    return total, (labels != ignore_index).sum()
