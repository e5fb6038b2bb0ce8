"""``strategy="auto"`` with expert parallelism in the space, on 2 gloo ranks (one launch): the search ranks
``ep=2`` candidates of a tiny Mixtral (4 experts, top-2), the confirming trials run the real
``expert_parallel``, and the chosen ``ep=2`` plan trains like a single-process reference.

Tolerances (4 SGD steps, momentum 0.9, lr 0.1, global batch 4 cycling over 2 fixed batches, fp32; only the
order of the gradient sums differs: the data-parallel reduction, the all-to-all's return of each expert's
gradient): per-step mean loss rtol 1e-4, every parameter after the 4 steps rtol 1e-4 / atol 1e-6 (~3e-6 at
these magnitudes). A wrong run is far outside: the reference loss falls by 0.19 (an untrained run misses by
that); expert gradients scaled by 2 or 1/2 (summed over ep instead of averaged, or the reverse) move the
loss by only 6e-5 but the expert parameters by 5e-4 to 1e-3 (measured with a single-process run), ~200x the
parameter tolerance.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _search_moe_workers as W
from torchloom.testing import run_ranks

STEPS, GB = 4, 4
RTOL = 1e-4
SEARCH = {"include": ["expert_parallel"], "exclude": ["pipeline_parallel", "tensor_parallel", "amp", "checkpoint"],
          "top_k": 2, "time_limit_s": 300, "trial_steps": 1, "cache": False, "fixed": {"micro_batch": 2}}


@pytest.mark.distributed
def test_auto_picks_and_trains_expert_parallel_2ranks(tmp_path):
    ranks = run_ranks(W.auto_train, 2, str(tmp_path), STEPS, GB, SEARCH, timeout=900.0)
    r0 = ranks[0]
    assert all(r["chosen"] == r0["chosen"] and r["losses"] == r0["losses"] for r in ranks[1:])
    assert r0["ep"] == 2 and "expert_parallel" in r0["label"], r0["table"]
    assert r0["chosen_by"] == "measured", r0["table"]
    assert any(status == "ok" for _, status, _ in r0["trials"]), r0["trials"]
    ref, ref_params = W.reference(STEPS, GB, r0["dp"])
    torch.testing.assert_close(torch.tensor(r0["losses"]), torch.tensor(ref), rtol=RTOL, atol=0,
                               msg=lambda m: f"{r0['label']} vs reference: {m}\n{r0['table']}")
    assert ref[0] - ref[-1] > 0.1, ref  # it trains
    got = r0["params"]
    assert set(got) == set(ref_params)
    for name, want in ref_params.items():
        torch.testing.assert_close(got[name], want, rtol=RTOL, atol=1e-6, msg=lambda m: f"{name}: {m}")
