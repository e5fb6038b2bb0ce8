"""C21-C25 — sequence splits (context parallel ring attention, Ulysses) [huggingface/transformers PR 36607,
NVIDIA-BioNeMo/bionemo-recipes PR 1449; huggingface/trl PR 6843, huggingface/accelerate PR 4177;
huggingface/transformers PR 41832, allenai/OLMo-core PR 657; ByteDance-Seed/VeOmni issue 1059 / PR 1086;
verl-project/verl issue 1226, PrimeIntellect-ai/prime-rl PR 3042, vllm-project/vllm-omni PR 5716].

One 2-rank and one 4-rank launch (tests/cases/_seq_workers.py); every run has a single-process reference of the
same model and batch computed in the rank. Tolerances (the cases' own): loss rtol 1e-5, gradients rtol 1e-4
(atol 1e-6 for entries near zero), logits atol 1e-5 (fp32; only the order of sums differs).

C21 (c) "CP=2 x SP=2 on 4 processes" runs as the ring x Ulysses hybrid (`("context_parallel", {"ulysses": 2})`
on cp=4: the ring over 2 ranks, Ulysses over 2) and, as well, as context parallel 2 x tensor parallel 2 with
Megatron sequence parallelism.
"""
from __future__ import annotations

import functools

import pytest
import torch

from tests.cases._seq_workers import cases_2, cases_4
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed


@functools.cache
def runs(world: int) -> list[dict]:
    return run_ranks(cases_2 if world == 2 else cases_4, world, timeout=600)


def _close_grads(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), what
    for n, g in got.items():
        torch.testing.assert_close(g, want[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{what} {n}: {m}")


def _matches_reference(r: dict, what: str) -> None:
    assert r["loss"] == pytest.approx(r["ref_loss"], rel=1e-5), what
    _close_grads(r["grads"], r["ref_grads"], what)


def test_c21_labels_are_shifted_before_the_split():
    r0, r1 = runs(2)
    # 8 tokens, head-tail: rank 0 holds [0,1,6,7] -> [1,2,7,-100]; rank 1 holds [2,3,4,5] -> [3,4,5,6]
    assert r0["c21_8_labels"] == [1, 2, 7, -100] and r1["c21_8_labels"] == [3, 4, 5, 6]
    for key in ("c21_cp_labels", "c21_ul_labels"):
        labels = r0[key] + r1[key]
        assert sum(x != -100 for x in labels) == 15, key  # seq - 1 targets
        assert sorted(x for x in labels if x != -100) == list(range(1, 16)), key  # each global next token once
    # no shard's last token loses its target unless it is the sequence's final token (global index 15)
    assert r0["c21_cp_labels"][-1] == -100 and r1["c21_cp_labels"][-1] != -100  # rank 0 holds token 15 (head-tail)
    assert r0["c21_ul_labels"][-1] != -100 and r1["c21_ul_labels"][-1] == -100  # contiguous: rank 1 holds it
    for key in ("c21_cp", "c21_ul"):
        for r in (r0, r1):
            _matches_reference(r[key], key)
    for r in runs(4):
        _matches_reference(r["c21_cp_x_sp"], "ring 2 x ulysses 2")
        _matches_reference(r["c21_cp_tp_sp"], "cp2 x tp2 (sequence parallel)")


def test_c22_masks_are_never_replaced_by_plain_causal():
    changed = 0
    for r in runs(2):
        torch.testing.assert_close(r["c22_packed"]["got"], r["c22_packed"]["want"], rtol=0, atol=1e-5)
        torch.testing.assert_close(r["c22_window"]["got"], r["c22_window"]["want"], rtol=0, atol=1e-5)
        # one token of document 1 changed: only document 1's positions (3..7 of 16) may change, here and in the
        # reference alike; positions of document 2 never see it
        d_got = (r["c22_changed"]["got"] - r["c22_packed"]["got"]).abs().amax(-1)[0] > 1e-6
        d_want = (r["c22_changed"]["want"] - r["c22_packed"]["want"]).abs().amax(-1)[0] > 1e-6
        assert torch.equal(d_got, d_want)
        changed += int(d_got.sum())
    assert changed == 5  # positions 3..7 of document 1; 0% of document 2


def test_c23_loss_is_weighted_by_global_valid_tokens_even_with_an_empty_shard():
    for key in ("c23_ul", "c23_cp"):
        for r in runs(2):
            assert all(torch.isfinite(g).all() for g in r[key]["grads"].values()), key
            _matches_reference(r[key], key)


def test_c24_gradients_are_reduced_over_the_sequence_dimension():
    r0, r1 = runs(2)
    for key in ("c24_ddp", "c24_none", "c24_fsdp"):
        for r in (r0, r1):
            _matches_reference(r[key], key)
    assert any("added ddp" in n for n in r0["c24_none"]["notes"]), r0["c24_none"]["notes"]
    for key in ("c24_ddp", "c24_none"):  # DDP over the cp ranks: bitwise-identical gradients on both
        a, b = r0[key]["local"], r1[key]["local"]
        assert a and sorted(a) == sorted(b)
        assert all(torch.equal(a[n], b[n]) for n in a), key
    for r in runs(4):
        _matches_reference(r["c24_dp_sp"], "dp2 x ulysses2")


def test_c25_ulysses_with_fewer_kv_heads_than_ranks_and_heads_that_do_not_divide():
    for r in runs(4):
        _matches_reference(r["c25_replicated_kv"], "4 heads, 2 kv heads, ulysses 4 (kv replicated)")
        err = r["c25_uneven_error"]
        assert err is not None and "StrategyError" in err and "6 attention heads" in err and "cp=4" in err, err
