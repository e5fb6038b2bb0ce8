"""C09 — checkpointed blocks taking keyword and non-tensor arguments [pytorch/pytorch 79887].

T5 (encoder-decoder) with every ``T5Block`` checkpointed under FSDP on 2 ranks. The blocks take the
attention masks, the relative position bias (computed by the first block and passed on), the encoder
states, the decoder cache and flags as keyword arguments.

Found here: the decoder passes a key/value cache (``use_cache`` defaults to True); the block writes the
cross-attention keys into it during the forward, so the recomputation read them back instead of
recomputing them and checkpointing failed ("A different number of tensors was saved during the original
forward and recomputation"). torchloom's ``checkpoint`` now drops a cache the block would write during
checkpointed training (as Hugging Face's own checkpointing does) and binds keyword arguments before
calling ``torch.utils.checkpoint`` (so a block keyword named like a checkpoint option reaches the block).

Checks: training runs; gradients equal the no-checkpoint run with ``use_cache=False`` bit for bit (the same
arithmetic) and the single-process no-checkpoint reference with the default cache (rtol 1e-5 / atol 1e-6:
the cached attention path and the 2-rank reduce-scatter round differently, ~1e-6 relative measured).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.cases import _workers as W
from torchloom.methods.activation_checkpoint import checkpoint_module
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6


class KwBlock(nn.Module):
    """Takes a mask, a non-tensor scale, a flag named like a checkpoint option and a cache by keyword."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, *, mask=None, scale: float = 1.0, debug: bool = False, cache=None, use_cache=False):
        self.seen.append((debug, cache is not None, use_cache))
        if cache is not None:
            cache.append(x.detach())
        y = torch.tanh(self.lin(x)) * scale
        return y * mask if mask is not None else y


def test_block_keywords_reach_the_block_and_cache_is_dropped_only_in_checkpointed_training():
    torch.manual_seed(0)
    x, mask = torch.randn(3, 4, requires_grad=True), (torch.rand(3, 4) > 0.3).float()
    ref = KwBlock()
    block = KwBlock()
    block.load_state_dict(ref.state_dict())
    checkpoint_module(block)
    outs = []
    for m in (ref, block):
        cache = []
        out = m(x, mask=mask, scale=0.5, debug=True, cache=cache, use_cache=True)
        out.sum().backward()
        outs.append((out, {n: p.grad for n, p in m.named_parameters()}, cache))
    (o_ref, g_ref, c_ref), (o, g, c) = outs
    assert torch.equal(o, o_ref) and all(torch.equal(g[n], g_ref[n]) for n in g)
    assert block.seen == [(True, False, False)] * 2  # forward + recomputation; `debug` reached the block
    assert len(c_ref) == 1 and c == []
    block.eval()
    with torch.no_grad():
        cache = []
        block(x, mask=mask, cache=cache, use_cache=True)
    assert len(cache) == 1 and block.seen[-1] == (False, True, True)  # evaluation runs the block as is


@pytest.mark.distributed
def test_t5_every_block_checkpointed_grads_equal_no_checkpoint():
    ref_grads, ref_params = W.c09_reference()
    results = run_ranks(W.c09_t5, 2)
    for r in results:
        assert any("checkpoint: 4/4 blocks" in n for n in r["checkpoint"]["notes"]), r["checkpoint"]["notes"]
        for step, (g, p, rg) in enumerate(zip(r["checkpoint"]["grads"], r["plain_nocache"]["grads"], ref_grads)):
            assert sorted(g) == sorted(p) == sorted(rg)
            for n in g:
                assert torch.equal(g[n], p[n]), f"step {step} {n}: checkpointing changed the gradient"
                torch.testing.assert_close(g[n], rg[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"step {step} {n}: {m}")
        for n, v in ref_params.items():
            torch.testing.assert_close(r["checkpoint"]["params"][n], v, rtol=RTOL, atol=ATOL)
