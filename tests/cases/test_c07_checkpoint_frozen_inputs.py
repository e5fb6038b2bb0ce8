"""C07 — activation checkpointing with frozen inputs [huggingface/transformers 21381].

C06's LoRA Llama (every weight frozen, embedding included, adapters on q/v) with every decoder layer
checkpointed, under FSDP on 2 ranks. With reentrant checkpointing the checkpointed block's input (the
frozen embedding's output) does not require grad, so autograd never enters the block and the adapters
silently get no gradient. torchloom's ``checkpoint`` is non-reentrant.

Checks: adapter gradients with checkpointing (``"checkpoint"`` and the ATorch tuple form) equal the
no-checkpoint run of the same strategy bit for bit (recomputation replays the same fp32 arithmetic) and a
single-process reference without checkpointing (rtol 1e-5 / atol 1e-6: the batch mean is split over 2
ranks and a reduce-scatter). A reentrant-checkpoint control in one process shows the fault is real.
"""
from __future__ import annotations

import functools

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.cases import _workers as W
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


def test_reentrant_checkpoint_loses_adapter_grads_control():
    """The fault itself: reentrant checkpointing + frozen embedding -> the adapters are cut off from the loss."""
    model = W.lora_llama()
    for layer in model.model.layers:
        inner = layer.forward
        layer.forward = lambda *a, _f=inner, **k: checkpoint(functools.partial(_f, **k), *a, use_reentrant=True)
    loss = W.llama_loss(model, W.lora_batches()[0])
    assert not loss.requires_grad  # autograd never reaches the adapters: there is nothing to backpropagate


@pytest.mark.distributed
def test_checkpointed_lora_adapter_grads_equal_no_checkpoint():
    _, ref_grads, ref_params = W.lora_reference()
    trainable = sorted(n for n, p in W.lora_llama().named_parameters() if p.requires_grad)
    results = run_ranks(W.c07_lora_checkpoint, 2)
    for r in results:
        plain = r["plain"]
        for tag in ("checkpoint", "atorch_style"):
            got = r[tag]
            assert any("checkpoint: 2/2 blocks" in n for n in got["notes"]), got["notes"]
            assert got["frozen_with_grad"] == []
            assert len(got["grads"]) == W.LORA_STEPS
            for step, (g, pg, rg) in enumerate(zip(got["grads"], plain["grads"], ref_grads)):
                assert sorted(g) == trainable
                for n in trainable:
                    assert torch.equal(g[n], pg[n]), f"{tag} step {step} {n}: differs from the no-checkpoint run"
                    torch.testing.assert_close(g[n], rg[n], rtol=RTOL, atol=ATOL,
                                               msg=lambda m: f"{tag} {step} {n}: {m}")
            for n in trainable:
                torch.testing.assert_close(got["params"][n], ref_params[n], rtol=RTOL, atol=ATOL)
