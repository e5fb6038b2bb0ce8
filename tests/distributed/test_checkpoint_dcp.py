"""Distributed checkpoints: FSDP2 resume, resharding to a plain model, safetensors export, ZeRO.

One 2-rank launch (``checkpoint_rank``) does all the distributed work; the checks that need a single
plain process (resharding 2 -> 1, loading the exported file) run here, in the pytest process, on the
files the ranks left in ``tmp_path``.

Why bitwise equality is expected for the resume: the resumed run replays the same float operations in
the same order on the same bits (same sharded params, same AdamW state and step count, same learning
rate from the restored scheduler, same batches from the restored per-rank RNG; CPU kernels and gloo
reductions are deterministic), so ``torch.equal`` is the right check, not a tolerance.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.distributed._ckpt_workers import checkpoint_rank, small_net, tiny_llama
from torchloom.checkpoint import export_from_dcp, latest_complete, load, load_safetensors
from torchloom.checkpoint.state import capture_rng, restore_rng
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_dcp")
    results = run_ranks(checkpoint_rank, 2, str(tmp))
    return tmp, results


@pytest.fixture
def keep_rng():
    """``load`` restores the checkpoint's RNG into this process; put ours back afterwards."""
    st = capture_rng()
    yield
    restore_rng(st)


def test_fsdp_resume_is_bitwise(ranks):
    _tmp, results = ranks
    for r in results:
        assert r["losses_b"] == r["losses_a"], f"rank {r['rank']}: resumed losses differ"
        assert r["info"]["step"] == 2
        assert r["info"]["extra"] == {"note": "two", "pair": (1, 2)}
        assert r["info"]["scaler_state"] == {"scale": 1024.0}
        assert r["cursor_after_load"] == 2  # per-rank dataloader state restored
        assert r["lr_after_load"] == pytest.approx(1e-2 * 0.9**2, rel=0, abs=0)  # scheduler + param_groups
        assert r["tie_after_load"]
    r0 = results[0]
    assert r0["bitwise_equal"], f"final params differ (max abs diff {r0['max_abs_diff']})"


def test_errors_reach_every_rank(ranks):
    tmp, results = ranks
    for r in results:
        torn_dir, torn_root, failed_save = r["errors"]
        assert "rng/rank1.pt is truncated" in torn_dir
        assert "no complete checkpoint under" in torn_root
        assert "rank 1: extra['x'] holds a builtins.object" in failed_save
    assert not (tmp / "failed").exists() or not any((tmp / "failed").iterdir())


def test_layout_and_retention(ranks):
    tmp, results = ranks
    root = tmp / "llama"
    assert sorted(p.name for p in root.iterdir()) == ["step_00000002", "step_00000004"]
    assert latest_complete(root) == root / "step_00000004"
    marker = json.loads((root / "step_00000004" / "COMPLETE").read_text())
    assert marker["world_size"] == 2 and marker["step"] == 4
    assert {"rng/rank0.pt", "rng/rank1.pt", "trainer_state.json", ".metadata"} <= set(marker["files"])
    ts = json.loads((root / "step_00000002" / "trainer_state.json").read_text())
    assert ts["dataloader"] is None and [s["rank"] for s in ts["dataloader_per_rank"]] == [0, 1]
    assert ts["tied_params"] == [["model.embed_tokens.weight", "lm_head.weight"]]


def test_reshard_fsdp2_to_plain_model(ranks, keep_rng):
    tmp, results = ranks
    r0 = results[0]
    model = tiny_llama(seed=99)  # plain, no process group in this process
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    info = load(tmp / "llama" / "step_00000002", model=model, optimizer=opt, lr_scheduler=sched)
    assert info["step"] == 2
    sd = model.state_dict()
    for k, v in r0["full2"].items():
        assert torch.equal(sd[k], v), k
    assert opt.param_groups[0]["lr"] == r0["osd2_lr"]
    names = {p: n for n, p in model.named_parameters()}
    assert len(opt.state) == len(r0["osd2_state"])
    for p, st in opt.state.items():
        ref = r0["osd2_state"][names[p]]
        for field in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(st[field], ref[field]), (names[p], field)


def test_safetensors_export_loads_strictly_into_plain_tied_llama(ranks):
    tmp, results = ranks
    path = tmp / "llama.safetensors"
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys  # one copy of the tie
    assert not any(k.startswith(("module.", "_orig_mod.", "_fsdp")) for k in keys)
    model = tiny_llama(seed=123)
    res = load_safetensors(model, path, strict=True)
    assert not res.missing_keys and not res.unexpected_keys
    assert model.lm_head.weight is model.model.embed_tokens.weight
    for k, v in results[0]["full2"].items():
        assert torch.equal(model.state_dict()[k], v), k

    # ...and into a sharded FSDP2 model on 2 ranks (checked inside the launch).
    assert results[0]["fsdp_safetensors_equal"] and all(r["fsdp_tie_after_safetensors"] for r in results)

    # Offline conversion of the same step's DCP checkpoint gives the same file contents.
    out = export_from_dcp(tmp / "llama" / "step_00000002", tmp / "offline.safetensors")
    with safe_open(str(path), framework="pt") as a, safe_open(str(out), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for k in a.keys():
            assert torch.equal(a.get_tensor(k), b.get_tensor(k)), k


def test_zero_redundancy_optimizer_roundtrip_and_interchange(ranks, keep_rng):
    tmp, results = ranks
    for r in results:
        assert r["zero_losses_b"] == r["zero_losses_a"]
        assert r["zero_params_equal"]
    with safe_open(str(tmp / "ddp.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == ["0.bias", "0.weight", "2.bias", "2.weight"]  # no "module." prefix
    # The ZeRO checkpoint (consolidated, FQN keys) loads into a plain model + AdamW on one process.
    net = small_net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.5)
    load(tmp / "zero", model=net, optimizer=opt)
    for k, v in results[0]["zero_params2"].items():
        assert torch.equal(net.state_dict()[k], v), k
    assert opt.param_groups[0]["lr"] == 1e-2
    assert all(int(st["step"]) == 2 for st in opt.state.values()) and len(opt.state) == 4
