"""The search's throughput bound (``search(keep=k)``, ``loom plan``'s ``--top``): skipping candidates that
provably rank below the best ``k`` leaves those ``k`` rows exactly as pricing everything gives them, the bound
never exceeds a priced candidate's throughput, and a cost model that breaks the bound turns skipping off."""
import functools

import pytest

from torchloom.search.bounds import StepBound
from torchloom.search.pricing import predict as price
from torchloom.search.search import search

from tests.unit.test_search_space import toy_hw, toy_info

CASES = [  # (info kwargs, world, global batch, hardware kwargs, options)
    (dict(), 8, 16, dict(ranks=8), {}),
    (dict(blocks=8, block_params=4_000_000), 16, 64, dict(memory=2e8, ranks=8, nodes=2), {}),
    (dict(blocks=8, heads=8, block_params=2_000_000), 64, 128, dict(ranks=8, nodes=8), {"exclude": ["zero1"]}),
]


@functools.lru_cache(maxsize=None)
def _full(case):
    kw, world, gb, hw_kw, opts = CASES[case]
    info, hw = toy_info(**kw), toy_hw(**hw_kw)
    return info, hw, search(info=info, world_size=world, global_batch=gb, hw=hw, options={"top_k": 0, **opts})


def _rows(result, k):
    return [(e.candidate.key(), e.prediction.step_time_s, e.prediction.peak_memory_bytes, e.fits, e.validated)
            for e in result.ranked[:k]]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("k", [1, 5, 25])
def test_keep_leaves_the_best_rows_as_pricing_everything(case, k):
    _, world, gb, _, opts = CASES[case]
    info, hw, full = _full(case)
    kept = search(info=info, world_size=world, global_batch=gb, hw=hw, options={"top_k": 0, **opts}, keep=k)
    assert _rows(kept, k) == _rows(full, k)
    assert kept.chosen.key() == full.chosen.key()
    assert full.skipped == 0


def test_keep_skips_candidates_on_a_large_space():
    info, hw, full = _full(2)
    kept = search(info=info, world_size=64, global_batch=128, hw=hw, options={"top_k": 0, "exclude": ["zero1"]},
                  keep=10)
    assert kept.skipped > 0 and len(kept.evaluated) < len(full.evaluated)
    assert _rows(kept, 10) == _rows(full, 10)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_bound_holds_on_every_priced_candidate(case):
    info, hw, full = _full(case)
    bound = StepBound(info, hw)
    assert full.evaluated
    for e in full.evaluated:
        assert bound.holds(e.candidate, e.prediction.step_time_s), e.candidate.label()
        assert bound.tokens_per_s(e.candidate) >= e.prediction.tokens_per_s * (1 - 1e-9)


def test_a_cost_model_that_breaks_the_bound_turns_skipping_off():
    """A predictor far faster than the bound for some candidates (a changed cost model): the search notices
    on the first one it prices, prices what it skipped, and the best rows stay exact."""

    def fast_fp32(cand, info, hw):
        p = price(cand, info, hw)
        if cand.config("amp") is None and cand.dims.tp == 1:
            p.step_time_s /= 1000.0
            p.tokens_per_s *= 1000.0
        return p

    info, hw = toy_info(blocks=8, heads=8, block_params=2_000_000), toy_hw(ranks=8, nodes=8)
    full = search(info=info, world_size=64, global_batch=128, hw=hw, options={"top_k": 0}, predict=fast_fp32)
    kept = search(info=info, world_size=64, global_batch=128, hw=hw, options={"top_k": 0}, predict=fast_fp32,
                  keep=10)
    assert _rows(kept, 10) == _rows(full, 10)
    assert {e.candidate.key() for e in kept.ranked} == {e.candidate.key() for e in full.ranked}


def _base_key(cand):
    return repr((cand.dims, [m for m in cand.methods if m[0] != "checkpoint"], cand.micro_batch, cand.grad_accum))


@pytest.mark.parametrize("case", range(len(CASES)))
def test_checkpointing_never_predicts_faster_than_none(case):
    """What skipping a base's checkpointing levels rests on: every checkpointed candidate is predicted no
    faster than the same base without checkpointing (recomputation adds time; the larger backward window
    hides at most that much more communication)."""
    _, _, full = _full(case)
    plain = {_base_key(e.candidate): e.prediction.step_time_s for e in full.evaluated
             if "checkpoint" not in e.candidate.names}
    checked = 0
    for e in full.evaluated:
        if "checkpoint" in e.candidate.names and _base_key(e.candidate) in plain:
            assert e.prediction.step_time_s >= plain[_base_key(e.candidate)] * (1 - 1e-9), e.candidate.label()
            checked += 1
    if case == 1:
        assert checked > 0  # the memory-bound case bisects checkpointing levels


def test_keep_skips_checkpointing_levels_below_the_best():
    """A base that does not fit without checkpointing and is already slower than the best ``keep`` gets no
    checkpointing bisection (fewer checkpointed candidates priced), the best rows unchanged."""
    _, world, gb, _, opts = CASES[1]
    info, hw, full = _full(1)
    kept = search(info=info, world_size=world, global_batch=gb, hw=hw, options={"top_k": 0, **opts}, keep=1)
    n_ac = lambda r: sum("checkpoint" in e.candidate.names for e in r.evaluated)  # noqa: E731
    assert n_ac(kept) < n_ac(full)
    assert _rows(kept, 1) == _rows(full, 1)


def test_a_cost_model_where_checkpointing_is_faster_turns_skipping_off():
    """A predictor that makes checkpointed plans faster (breaking the monotonicity the skip assumes; still
    above the FLOP bound, so only this guard can notice): the search notices on the first bisection it prices,
    prices what it skipped, and the best rows stay exact."""
    # tight memory: the best plans all need checkpointing (checked: without the guard the rows differ)
    info, hw = toy_info(blocks=8, block_params=4_000_000), toy_hw(memory=8e7, ranks=8, nodes=2)
    world, gb, opts = 16, 64, {}
    bound = StepBound(info, hw)

    def fast_checkpointing(cand, info, hw):
        p = price(cand, info, hw)
        if "checkpoint" in cand.names:
            t = max(bound.seconds(cand) * 1.001, p.step_time_s / 20.0)
            p.tokens_per_s *= p.step_time_s / t
            p.step_time_s = t
        return p

    full = search(info=info, world_size=world, global_batch=gb, hw=hw, options={"top_k": 0, **opts},
                  predict=fast_checkpointing)
    kept = search(info=info, world_size=world, global_batch=gb, hw=hw, options={"top_k": 0, **opts},
                  predict=fast_checkpointing, keep=5)
    assert all("checkpoint" in e.candidate.names for e in full.ranked[:5])
    assert _rows(kept, 5) == _rows(full, 5)
