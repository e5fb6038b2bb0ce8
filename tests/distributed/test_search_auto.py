"""``strategy="auto"`` end to end on 2 and 4 gloo ranks (one launch each): the machine is calibrated in the
job, the space searched, the top 3 confirmed with real runs, and the chosen plan — one of the measured trials,
the same on every rank — trains a tiny Llama like a single-process reference.

Tolerances (10 SGD steps, momentum 0.9, lr 0.1, global batch 8, cycling over 2 fixed batches): per-step losses rtol 1e-4 for an fp32 plan
(only the order of gradient sums differs: data-parallel reduction, tensor-parallel partial sums, pipeline
micro-batches), 5e-3 for a bf16-amp plan (bf16 matmul rounding, against a bf16-autocast reference; one process
with and without autocast differ by ~1e-4 here). A wrong run is much further: the reference loss falls from 4.83
to 3.65 over the 10 steps, so an untrained run misses it by 25% and a gradient scaled by 2 or 1/2 by several
percent within a few steps.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _search_auto_workers as W
from torchloom.testing import run_ranks

STEPS, GB = 10, 8
FP32_RTOL, AMP_RTOL = 1e-4, 5e-3
# zero-bubble schedules are left out: a zero_bubble trial's memory-tracking step fails on one rank inside the
# schedule's backward and leaves its peer blocked in a recv (a runner/measure limitation, reported)
SEARCH = {"top_k": 3, "time_limit_s": 300, "trial_steps": 2, "cache": False,
          "pipeline_schedules": ["1f1b", "interleaved_1f1b"]}


def _check(ranks):
    r0 = ranks[0]
    for r in ranks[1:]:  # every rank ranked, measured and chose the same
        assert (r["chosen"], r["trials"], r["ranked"]) == (r0["chosen"], r0["trials"], r0["ranked"])
        assert r["losses"] == r0["losses"]
    assert r0["chosen_by"] == "measured", r0["table"]
    measured = {k: status for k, status, _ in r0["trials"]}
    assert len(measured) == 3 and measured.get(r0["chosen"]) == "ok", r0["table"]
    ok_times = [t for _, status, t in r0["trials"] if status == "ok"]
    assert dict((k, t) for k, _, t in r0["trials"])[r0["chosen"]] == min(ok_times)  # the fastest measured
    ref = W.reference(STEPS, GB, r0["amp"])
    rtol = AMP_RTOL if r0["amp"] else FP32_RTOL
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref), rtol=rtol, atol=0,
                               msg=lambda m: f"{r0['label']} vs reference: {m}\n{r0['table']}")
    assert r0["losses"][0] - r0["losses"][-1] > 0.5, r0["losses"]  # it trains (memorises the 2 batches)


@pytest.mark.distributed
def test_auto_searches_confirms_and_trains_2ranks(tmp_path):
    ranks = run_ranks(W.auto_train, 2, str(tmp_path), STEPS, GB, SEARCH, timeout=900.0)
    _check(ranks)


@pytest.mark.distributed
def test_auto_searches_confirms_and_trains_4ranks(tmp_path):
    ranks = run_ranks(W.auto_train, 4, str(tmp_path), STEPS, GB, SEARCH, timeout=900.0)
    _check(ranks)
