"""C06 — frozen parameters mixed with trainable ones (LoRA) [pytorch/pytorch 100945].

A Llama whose weights are all frozen except rank-4 adapters on every ``q_proj``/``v_proj`` (a tiny LoRA
module written here, no peft), sharded with FSDP per decoder layer: each decoder-layer unit mixes frozen and
trainable parameters, and the root unit (embedding, final norm, head) is entirely frozen.

Checks (2 ranks, 3 SGD-momentum steps): wrapping works; frozen parameters never get a gradient and have no
optimizer state (the optimizer holds exactly the adapters); the gradient memory on each rank is its shard
of the adapters (summed over ranks: the adapter count, far below the frozen count); gradients, losses and
parameters equal a single-process reference, and frozen weights are unchanged bit for bit.

Tolerance: rtol 1e-5 / atol 1e-6: the 8-sequence mean is split over 2 ranks and an FSDP reduce-scatter.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


def _adapter(name: str) -> bool:
    return ".lora_A" in name or ".lora_B" in name


@pytest.mark.distributed
def test_lora_under_fsdp_frozen_params_get_no_grad_or_state():
    model = W.lora_llama()
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert trainable and all(_adapter(n) for n in trainable) and len(trainable) == 8
    ref_losses, ref_grads, ref_params = W.lora_reference()
    initial = dict(W.lora_llama().named_parameters())

    results = run_ranks(W.c06_lora, 2)
    for got in results:
        assert sorted(map(sorted, got["units"])) == [[""], ["model.layers.0"], ["model.layers.1"]]
        assert got["frozen_with_grad"] == []
        assert got["optimizer_params"] == trainable
        assert got["optimizer_state"] == trainable  # momentum buffers exist for the adapters only
        for step, (g, rg) in enumerate(zip(got["grads"], ref_grads)):
            assert sorted(g) == trainable, f"step {step}: gradients for {sorted(set(g) - set(trainable))}"
            for n in trainable:
                torch.testing.assert_close(g[n], rg[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {n}: {m}")
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
        for n, p in ref_params.items():
            if n in trainable:
                torch.testing.assert_close(got["params"][n], p, rtol=RTOL, atol=ATOL, msg=lambda m: f"{n}: {m}")
            else:
                assert torch.equal(got["params"][n], initial[n].detach()), f"frozen {n} changed"
    # gradient memory: each rank holds its shard of the adapters' gradients and nothing for frozen weights
    per_rank = [r["local_grad_numel"] for r in results]
    assert all(len(set(steps)) == 1 for steps in per_rank)
    assert [s[0] for s in per_rank] == [r["local_trainable_numel"] for r in results]
    assert sum(s[0] for s in per_rank) == n_trainable < n_frozen // 20
    assert sum(r["local_frozen_numel"] for r in results) == n_frozen
