"""C08 — dropout RNG across recomputation [allenai/OLMo-core PR 828].

GPT-2 with dropout 0.1 (embedding, attention, residual) under FSDP on 2 ranks, every block checkpointed,
each rank seeding its forward. If the recomputation in backward does not replay the forward's RNG state,
it draws new dropout masks and the gradient belongs to a different forward than the loss.

Checks: gradients with checkpointing equal the run without, bit for bit (same masks, same fp32 arithmetic),
and a single-process reference that replays each rank's seeded forward (rtol 1e-5 / atol 1e-6: the
2-rank mean goes through a reduce-scatter). Controls: ``preserve_rng_state=False`` really changes the
gradients, and torchloom refuses that setting when a checkpointed block contains dropout.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from tests.models import tiny_gpt2, token_batches
from torchloom.methods.activation_checkpoint import checkpoint_module
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


def _grads(model, x, seed=3):
    torch.manual_seed(seed)
    model(input_ids=x, labels=x).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_recompute_without_rng_state_changes_grads_control():
    x = token_batches(4, seed=5)
    ref = _grads(tiny_gpt2(dropout=0.1), x)
    kept, fresh = tiny_gpt2(dropout=0.1), tiny_gpt2(dropout=0.1)
    for block in kept.transformer.h:
        checkpoint_module(block, preserve_rng_state=True)
    for block in fresh.transformer.h:
        checkpoint_module(block, preserve_rng_state=False)
    assert all(torch.equal(g, ref[n]) for n, g in _grads(kept, x).items())
    assert not all(torch.equal(g, ref[n]) for n, g in _grads(fresh, x).items())


@pytest.mark.distributed
def test_dropout_grads_identical_with_and_without_checkpointing():
    ref_grads, ref_params = W.c08_reference()
    results = run_ranks(W.c08_dropout, 2)
    for r in results:
        assert r["refused"] and "preserve_rng_state=False" in r["refused"] and "dropout" in r["refused"]
        assert any("checkpoint: 2/2 blocks" in n for n in r["checkpoint"]["notes"])
        for step, (g, p, rg) in enumerate(zip(r["checkpoint"]["grads"], r["plain"]["grads"], ref_grads)):
            assert sorted(g) == sorted(rg)
            for n in g:
                assert torch.equal(g[n], p[n]), f"step {step} {n}: checkpointing changed the gradient"
                torch.testing.assert_close(g[n], rg[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {n}: {m}")
        for n, v in ref_params.items():
            torch.testing.assert_close(r["checkpoint"]["params"][n], v, rtol=RTOL, atol=ATOL)
