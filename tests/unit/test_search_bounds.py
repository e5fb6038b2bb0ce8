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
