"""C01 — tied embedding and output head under sharding [pytorch/pytorch PR 176257; huggingface/accelerate PR 4171].

A Llama with ``tie_word_embeddings=True`` sharded with FSDP2. Recent torch refuses to put the embedding and
the head in separate FSDP units that share a parameter ("Parameter 'lm_head.weight' is shared with a
parameter already managed by another FSDP group"). torchloom detects the shared parameter and keeps its
owners in one unit: the root with per-block units, one multi-module unit when the user asks to wrap
``Embedding``/``Linear`` explicitly.

Checks: training runs; the tie holds after 3 steps (same Parameter object, same local shard); losses and
parameters equal a single-process reference (SGD with momentum); the consolidated ``safetensors`` export
holds one copy and loads strictly into a fresh model whose tie holds.

Tolerance: rtol 1e-5 / atol 1e-6. Each rank averages its 4 sequences and FSDP averages the 2 ranks'
gradients in a reduce-scatter, so the batch sum is formed in a different order than the reference's
8-sequence mean (a few fp32 ulps per step, kept small by 3 SGD steps).
"""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.cases import _workers as W
from tests.models import tiny_llama
from torchloom.methods.fsdp import _plan_units
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-6
EMB, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def test_plan_units_groups_owners_of_shared_parameters():
    blocks = ["model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    # owners in two different units -> one multi-module unit
    assert _plan_units(blocks, [["lm_head", "model.embed_tokens"]]) == [
        ["model.embed_tokens", "lm_head"], ["model.layers.0"], ["model.layers.1"]]
    # an owner outside every block: the block joins the root (no unit of its own)
    assert _plan_units(["model.layers.0", "model.layers.1"], [["lm_head", "model.layers.1.mlp"]]) == [
        ["model.layers.0"]]
    # owners inside one block need nothing; transitive sharing merges all three
    assert _plan_units(["a", "b", "c"], [["a.x", "a.y"]]) == [["a"], ["b"], ["c"]]
    assert _plan_units(["a", "b", "c"], [["a.x", "b.x"], ["b.y", "c.y"]]) == [["a", "b", "c"]]


@pytest.mark.distributed
def test_tied_llama_fsdp_trains_keeps_tie_and_exports_one_copy(tmp_path):
    ref_losses, ref_params = W.c01_reference()
    results = run_ranks(W.c01_tied, 2, str(tmp_path))
    for tag, expected_units in [
        ("blocks", [[""], ["model.layers.0"], ["model.layers.1"]]),
        ("explicit", [[""], ["model.embed_tokens", "lm_head"], ["model.layers.0"], ["model.layers.1"]]),
    ]:
        for rank, r in enumerate(results):
            got = r[tag]
            assert got["tied_before"] and got["tied_after"] and got["tied_local_equal"], (tag, rank)
            assert sorted(map(sorted, got["units"])) == sorted(map(sorted, expected_units)), (tag, got["units"])
            assert any("tied groups" in n for n in got["notes"]), got["notes"]
            torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=RTOL, atol=ATOL)
            for k, v in ref_params.items():
                torch.testing.assert_close(got["params"][k], v, rtol=RTOL, atol=ATOL, msg=lambda m: f"{tag} {k}: {m}")
            torch.testing.assert_close(got["params"][EMB], got["params"][HEAD], rtol=0, atol=0)

        # consolidated export: one copy of the tied weight, strict load into a fresh model, tie intact
        path = results[0][tag]["export"]
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
        assert (EMB in keys) != (HEAD in keys), f"tied weight stored {'twice' if EMB in keys else 'never'}"
        assert keys | {EMB, HEAD} == set(tiny_llama(tie=True).state_dict())
        from torchloom.checkpoint import load_safetensors

        fresh = tiny_llama(seed=123, tie=True)
        load_safetensors(fresh, path, strict=True)
        assert fresh.model.embed_tokens.weight is fresh.lm_head.weight
        for k, v in fresh.state_dict().items():
            if k in ref_params:
                torch.testing.assert_close(v, results[0][tag]["params"][k], rtol=0, atol=0)
