"""Checkpoints keep all optimizer state, under every strategy (issue [5] item 3).

Frozen parameters with state, parameters that never received a gradient (no state), a parameter group
with no state yet: a checkpoint round-trips them exactly, loads with ``strict=True`` into a fresh build
(whether the user re-freezes before loading or after), and the resumed run trains to the same bits as the
uninterrupted one. Scenario and tolerance (bitwise; a dropped or invented AdamW state moves coordinates by
~lr = 1e-2) in ``tests/distributed/_optim_state_workers.py``. Two launches: 2 and 4 ranks.
"""
from __future__ import annotations

import pytest

from tests.distributed import _optim_state_workers as w
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed

UNUSED_OK = ("ddp", {"find_unused_parameters": True})  # frozen parameters under DDP
TWO_RANKS = [
    ("ddp", [UNUSED_OK], True, True),
    ("zero1", ["zero1", UNUSED_OK], False, False),  # one group: zero1 supports one
    ("fsdp", ["fsdp"], True, True),
    ("tp", [("parallel_mode", {"tp": 2}), "tensor_parallel"], True, False),
    ("pp", [("pipeline_parallel", {"size": 2})], True, False),
]
FOUR_RANKS = [
    ("hsdp", [("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"], True, False, 1),
    ("fsdp_tp", [("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"], True, False),
]


def _check(results):
    for name in results[0]:  # the frozen weight lives on one stage (pp) or one partition (zero1)
        assert any(out[name]["frozen_has_state"] for out in results), f"{name}: the frozen weight has no state"
    for rank, out in enumerate(results):
        for name, r in out.items():
            assert not r["errors"], f"{name} rank {rank}: {r['errors']}"
            assert r["norms_without_state"], f"{name}: the scenario needs norm weights without state"
            for key in [k for k in r if k.startswith(("disk_", "memory_"))]:
                assert r[key] == [], f"{name} rank {rank} {key}: {r[key][:6]}"


def test_optimizer_state_roundtrip_2ranks(tmp_path):
    _check(run_ranks(w.cases, 2, str(tmp_path), TWO_RANKS, timeout=900))


def test_optimizer_state_roundtrip_4ranks(tmp_path):
    _check(run_ranks(w.cases, 4, str(tmp_path), FOUR_RANKS, timeout=900))
