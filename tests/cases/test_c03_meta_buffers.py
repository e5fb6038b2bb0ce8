"""C03 — non-persistent buffers after meta-device init [huggingface/transformers 34234].

A Llama built on the meta device, materialised by torchloom and then loaded from a state dict. The rotary
``inv_freq``/``original_inv_freq`` buffers are non-persistent: no state dict holds them, so loading cannot
repair them; if materialisation leaves them uninitialised they are garbage, different on every rank.

Checks (fsdp, ddp and no strategy, 2 ranks, each rank seeded differently so nothing lines up by chance):
every rank's buffers equal a fresh CPU build bit for bit, and after loading the reference weights the
logits equal the CPU model's (rtol 1e-6: the same fp32 arithmetic, only FSDP's all-gathered copies).
The whole kind of fault: a plain module whose non-persistent buffers nothing initialises is an error
naming the buffers, and an ``_init_buffers()`` hook fixes it.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases import _workers as W
from torchloom.parallel.materialize import materialize_meta_model
from torchloom.testing import run_ranks


@pytest.mark.distributed
def test_meta_llama_buffers_equal_cpu_build_on_every_rank():
    ref_buffers, ref_state, ref_logits = W.c03_reference()
    assert set(ref_buffers) == {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}
    results = run_ranks(W.c03_meta_buffers, 2, ref_state)
    for rank, r in enumerate(results):
        for tag in W.C03_STRATEGIES:
            got = r[tag]
            assert got["non_persistent"] == sorted(ref_buffers)
            assert set(got["buffers"]) == set(ref_buffers), (tag, rank)
            for n, b in ref_buffers.items():
                assert torch.equal(got["buffers"][n], b), f"{tag} rank {rank}: {n} differs from a CPU build"
            torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-6, atol=1e-6)


def test_uninitialised_non_persistent_buffers_raise():
    with torch.device("meta"):
        model = W.TinyRotary()
    with pytest.raises(RuntimeError, match=r"non-persistent buffer\(s\) \['freqs', 'pos'\].*_init_buffers"):
        materialize_meta_model(model, torch.device("cpu"))


def test_init_buffers_hook_restores_non_persistent_buffers():
    ref = W.TinyRotaryWithInit()
    with torch.device("meta"):
        model = W.TinyRotaryWithInit()
    materialize_meta_model(model, torch.device("cpu"))
    for (n, b), (_, r) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(b, r), n
