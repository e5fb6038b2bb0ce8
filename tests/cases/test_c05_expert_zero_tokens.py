"""C05 — experts that receive zero tokens [deepspeedai/DeepSpeed 4808].

Mixtral-style MoE (4 experts, top-2, 2 layers), expert parallel over 2 ranks (2 experts each), micro-batches
of one 8-token sequence, and a router biased so that some experts never get a token: in layer 0 experts 2
and 3 (all of ep rank 1's experts: that rank receives no rows at all and computes nothing), in layer 1
expert 1 (one of ep rank 0's). DeepSpeed hung here: an idle rank skipped the all-to-all or left its expert
gradients None while its peers reduced real ones.

Expected and checked, for ddp (experts reduced by ``ExpertGradReducer``) and fsdp (experts sharded over
edp): no hang (the run ends); every expert parameter has a gradient on every rank at the optimizer step,
exactly zero for the idle experts and equal to the reference's (atol 1e-7; the biased reference gives
exactly zero there too); finite losses equal to the one-process reference's (rtol 1e-5) and parameters
after 3 SGD steps (atol 2e-5; an untrained run is > 10x further, asserted).
"""
from __future__ import annotations

import math

import pytest
import torch

from tests.distributed._ep_workers import reference, train_many
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed

STEPS, GB, MICRO = 3, 4, 1
IDLE = {0: [2, 3], 1: [1]}  # layer -> experts the router never picks
PARAM_ATOL, LOSS_RTOL, GRAD_ATOL = 2e-5, 1e-5, 1e-7
STRATEGIES = {"ddp": ["ddp", "expert_parallel", ("parallel_mode", {"ep": 2})],
              "fsdp": ["fsdp", "expert_parallel", ("parallel_mode", {"ep": 2})]}


@pytest.fixture(scope="module")
def runs():
    cfgs = [dict(strategy=s, family="mixtral", steps=STEPS, global_batch=GB, micro=MICRO, bias=IDLE)
            for s in STRATEGIES.values()]
    outs = run_ranks(train_many, 2, cfgs, timeout=1800)
    return {name: [outs[r][i] for r in range(2)] for i, name in enumerate(STRATEGIES)}


@pytest.fixture(scope="module")
def ref():
    return reference("mixtral", STEPS, GB, 2, MICRO, bias=IDLE)


def _idle_rows(name: str):
    layer = int(name.split(".")[2])
    return IDLE.get(layer, [])


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_idle_experts_zero_gradient_no_hang(runs, ref, strategy):
    for name, g in ref["grads"].items():  # the bias really leaves these experts idle, the others busy
        idle = _idle_rows(name)
        assert torch.count_nonzero(g[idle]) == 0, name
        assert all(torch.count_nonzero(g[e]) > 0 for e in range(4) if e not in idle), name
    for out in runs[strategy]:
        assert all(math.isfinite(x) for x in out["losses"])
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        assert set(out["grads"]) == set(ref["grads"])
        for name, g in ref["grads"].items():
            got = out["grads"][name]
            assert got is not None, f"rank {out['rank']}: {name} has no gradient"
            assert torch.count_nonzero(got[_idle_rows(name)]) == 0, name
            torch.testing.assert_close(got, g, atol=GRAD_ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
        for k, v in ref["params"].items():
            torch.testing.assert_close(out["params"][k], v, atol=PARAM_ATOL, rtol=0, msg=lambda m: f"{k}: {m}")
    untrained = reference("mixtral", STEPS, GB, 2, MICRO, bias=IDLE, lr=0.0)
    d = max((untrained["params"][k] - v).abs().max().item() for k, v in ref["params"].items())
    assert d > 10 * PARAM_ATOL, d
