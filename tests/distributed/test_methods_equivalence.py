"""Every method and useful combination against a single-process reference (tiny HF Llama, 3 steps,
global batch 8). Tolerances, and how far a wrong run is (each test computes the wrong runs and asserts they
are more than 10x its tolerance away, so it can fail):
- fp32 methods: losses rtol 1e-5; parameters atol 2e-5 with SGD+momentum (differences come only from the
  order of the gradient reduction: sum over ranks, then mean, vs one batch mean; observed <= 1e-8). An
  untrained run (lr=0) is 1.7e-2 away in parameters and 1e-3 relative in loss; a run with a doubled gradient
  1.6e-2 and 1e-3; under clipping an unclipped run is the wrong one.
- DDP compression hooks (fp16, bf16, PowerSGD): parameters atol 2e-7 against a one-process replay of the
  hook's documented arithmetic (``_comm_replay``; observed: bitwise equal). No compression is 7e-6 (fp16),
  6.4e-5 (bf16) and 1.2e-2 (PowerSGD, 4 steps) away; lr=0 and 2x gradient ~1.7e-2.
- low precision (amp, half): tests/distributed/test_precision.py (parameters against one-process replays of
  each precision path at 1e-5, the dtypes that ran, fp16 loss-scale history against torch.amp.GradScaler).
Besides the numbers, the tests assert that the methods were applied: sync_module_states (ranks built from
different seeds start from rank 0's weights), compiled blocks, checkpoint wrappers and recomputation,
CPU offload and ZeRO-2's unsharded parameters after forward.
"""
import math

import pytest
import torch

from tests.distributed._comm_replay import (
    PowerSGDReplay, bf16_gloo_hook, exact_mean, fp16_hook, max_param_diff, replay_ddp,
)
from tests.distributed._train_workers import reference_llama, train_many
from tests.models import tiny_llama
from torchloom.testing import run_ranks

STEPS, GB = 3, 8
PARAM_ATOL, LOSS_RTOL = 2e-5, 1e-5  # fp32 methods
REPLAY_ATOL = 2e-7  # compression hooks against their replay


@pytest.fixture(scope="module")
def ref():
    return reference_llama(STEPS, GB)


@pytest.fixture(scope="module")
def wrong():
    """Runs a broken implementation would produce: never updating the weights, or a doubled gradient."""
    return {"untrained (lr=0)": replay_ddp(STEPS, GB, 1, exact_mean, lr=0.0),
            "2x gradient": replay_ddp(STEPS, GB, 1, exact_mean, grad_scale=2.0)}


def _loss_rel(a, b) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def assert_wrong_runs_are_far(ref, wrong_runs: dict, param_atol: float, loss_rtol: float | None = None):
    """Each wrong run is more than 10x the tolerance away from ``ref``: the test can tell them apart."""
    for name, (losses, params) in wrong_runs.items():
        d = max_param_diff(params, ref[1])
        assert d > 10 * param_atol, f"{name} is only {d:.3g} from the reference (tolerance {param_atol})"
        if loss_rtol is not None:
            rel = _loss_rel(losses, ref[0])
            assert rel > 10 * loss_rtol, f"{name}: losses only {rel:.3g} relative from the reference"


def _assert_close(out, ref, param_atol=PARAM_ATOL, loss_rtol=LOSS_RTOL):
    ref_losses, ref_params = ref
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref_losses), rtol=loss_rtol, atol=0)
    assert set(out["params"]) == set(ref_params), set(out["params"]) ^ set(ref_params)
    for k, v in ref_params.items():
        torch.testing.assert_close(out["params"][k], v.float(), atol=param_atol, rtol=0, msg=lambda m: f"{k}: {m}")


FP32_2RANK = {
    "ddp": dict(strategy=["ddp"], micro_batch=4, probe=True),
    "ddp_accum": dict(strategy=[("ddp", {"bucket_cap_mb": 0.01, "static_graph": True})], micro_batch=1),
    "default_is_ddp": dict(strategy=None, micro_batch=4),
    "ddp_seeded": dict(strategy=["ddp"], micro_batch=4, seed_by_rank=True),
    "zero1": dict(strategy=["zero1"], micro_batch=2),
    "zero3": dict(strategy=["fsdp"], micro_batch=4, probe=True),
    "zero3_seeded": dict(strategy=["fsdp"], micro_batch=4, seed_by_rank=True),
    # negative control: without the broadcast the ranks do not start from rank 0's weights (the check can fail)
    "zero3_seeded_nosync": dict(strategy=[("fsdp", {"sync_module_states": False})], micro_batch=4, seed_by_rank=True),
    "zero2_accum": dict(strategy=["zero2"], micro_batch=2, probe=True),
    "zero3_accum_sharded": dict(strategy=[("fsdp", {"accumulate_sharded": True})], micro_batch=1),
    "zero3_ac": dict(strategy=["fsdp", "checkpoint"], micro_batch=4, probe=True),
    "ddp_ac_every2": dict(strategy=["ddp", ("checkpoint", {"every_k": 2})], micro_batch=4, probe=True),
    "zero3_offload": dict(strategy=[("fsdp", {"cpu_offload": True})], micro_batch=4, probe=True),
    "zero3_compile": dict(strategy=[("compile", {"backend": "aot_eager"}), "fsdp"], micro_batch=4, probe=True),
    "clip": dict(strategy=["fsdp"], micro_batch=4, max_grad_norm=0.5),
}


@pytest.mark.distributed
def test_fp32_methods_match_reference_2ranks(ref, wrong):
    cfgs = [dict(steps=STEPS, global_batch=GB, **c) for c in FP32_2RANK.values()]
    outs = run_ranks(train_many, 2, cfgs)
    ref_clip = reference_llama(STEPS, GB, max_grad_norm=0.5)
    assert_wrong_runs_are_far(ref, wrong, PARAM_ATOL, LOSS_RTOL)
    assert_wrong_runs_are_far(ref_clip, {"unclipped": ref}, PARAM_ATOL, LOSS_RTOL)
    for name, o0, o1 in zip(FP32_2RANK, outs[0], outs[1]):
        if name == "zero3_seeded_nosync":
            continue
        r = ref_clip if name == "clip" else ref
        _assert_close(o0, r)
        # every rank holds the same full parameters
        for k in o0["params"]:
            assert torch.equal(o0["params"][k], o1["params"][k]), f"{name}: {k} differs across ranks"
    accum = {n: o["accum"] for n, o in zip(FP32_2RANK, outs[0])}
    assert accum["ddp_accum"] == 4 and accum["zero2_accum"] == 2 and accum["ddp"] == 1
    assert accum["zero3_accum_sharded"] == 4
    # accumulate_sharded reduce-scatters every micro-batch (sharded .grad mid-window); the default waits
    grads_mid = {n: o["grads_mid_window"] for n, o in zip(FP32_2RANK, outs[0])}
    assert grads_mid["zero3_accum_sharded"] is True and grads_mid["zero2_accum"] is False, grads_mid
    assert "ddp" in outs[0][2]["strategy"], "no strategy on 2 ranks must fall back to ddp"
    _assert_synced_from_rank0({n: (o0, o1) for n, o0, o1 in zip(FP32_2RANK, outs[0], outs[1])})
    _assert_methods_applied({n: o for n, o in zip(FP32_2RANK, outs[0])})


def _assert_synced_from_rank0(res: dict):
    """sync_module_states: rank r built its model from seed r, yet every rank starts from rank 0's weights
    (DDP broadcasts at wrap time, fsdp before sharding), bit for bit."""
    seed0 = {k: v.detach() for k, v in tiny_llama(seed=0).state_dict().items()}
    seed1 = {k: v.detach() for k, v in tiny_llama(seed=1).state_dict().items()}
    assert max_param_diff(seed0, seed1) > 0.1  # rank 1's own build is a different model
    for name in ("ddp_seeded", "zero3_seeded"):
        for rank, out in enumerate(res[name]):
            for k, v in seed0.items():
                assert torch.equal(out["init"][k], v), f"{name} rank {rank}: {k} is not rank 0's initial value"
    # without the broadcast each rank shards its own build: the gathered model is a mix of both seeds
    nosync = res["zero3_seeded_nosync"][0]["init"]
    assert max_param_diff(nosync, seed0) > 0.1 and max_param_diff(nosync, seed1) > 0.1


def _assert_methods_applied(res: dict):
    """The methods changed how the model runs (not only the numbers): see ``_train_workers.applied``."""
    ev = {n: o["applied"] for n, o in res.items() if "applied" in o}
    n_blocks = 2
    plain = ev["ddp"]
    assert plain["compiled"] == 0 and plain["wrapped"] == 0 and plain["attn_calls"] == [1, 1], plain
    assert res["ddp"]["graphs_in_training"] == 0
    # compile: every block compiled in place, and Dynamo built graphs while training
    assert ev["zero3_compile"]["compiled"] == n_blocks, ev["zero3_compile"]
    assert res["zero3_compile"]["graphs_in_training"] > 0, res["zero3_compile"]
    # activation checkpointing: ceil(n / k) blocks wrapped; a wrapped block's attention runs again in backward
    assert ev["zero3_ac"]["wrapped"] == n_blocks and ev["zero3_ac"]["attn_calls"] == [2, 2], ev["zero3_ac"]
    every2 = ev["ddp_ac_every2"]
    assert every2["wrapped"] == math.ceil(n_blocks / 2) and every2["attn_calls"] == [2, 1], every2
    # ZeRO-3 reshards each block after its forward (DTensor parameters when the final norm runs); ZeRO-2
    # (zero2 = reshard_after_forward=False) keeps them unsharded until backward
    assert ev["zero3"]["fsdp_blocks"] == n_blocks and ev["zero3"]["unsharded_at_norm"] == 0, ev["zero3"]
    assert ev["zero2_accum"]["unsharded_at_norm"] == n_blocks, ev["zero2_accum"]
    # CPU offload: FSDP's parameter groups run with CPUOffloadPolicy (shards, grads, optimizer state on host)
    assert ev["zero3_offload"]["offload"] == [True] * n_blocks and ev["zero3_offload"]["shard_devices"] == ["cpu"]
    assert ev["zero3"]["offload"] == [False] * n_blocks


@pytest.mark.distributed
def test_hsdp_and_4rank_methods_match_reference(ref, wrong):
    # seed_by_rank: rank r builds from seed r; HSDP (broadcast over replicate x shard), zero1 (its ddp) and
    # ddp must all start from rank 0's weights
    cfgs = [
        dict(strategy=[("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"], micro_batch=2,
             seed_by_rank=True),
        dict(strategy=["fsdp"], micro_batch=1),  # ZeRO-3 over 4 ranks with accumulation 2
        dict(strategy=["zero1"], micro_batch=2, seed_by_rank=True),
        dict(strategy=[("ddp", {"comm_hook": "bf16"})], micro_batch=2, seed_by_rank=True),  # rank-order fp32 sum
    ]
    outs = run_ranks(train_many, 4, [dict(steps=STEPS, global_batch=GB, **c) for c in cfgs], timeout=400)
    assert_wrong_runs_are_far(ref, wrong, PARAM_ATOL, LOSS_RTOL)
    seed0 = {k: v.detach() for k, v in tiny_llama(seed=0).state_dict().items()}
    for i in (0, 2, 3):
        for r in range(4):
            assert max_param_diff(outs[r][i]["init"], seed0) == 0, f"config {i} rank {r} did not start from rank 0"
    for i in range(3):
        _assert_close(outs[0][i], ref)
    for i in range(len(cfgs)):
        for r in range(1, 4):
            for k, v in outs[0][i]["params"].items():
                assert torch.equal(v, outs[r][i]["params"][k])
    assert "HSDP 2x2" in " ".join(outs[0][0]["notes"])
    bf16 = replay_ddp(STEPS, GB, 4, bf16_gloo_hook)
    d = max_param_diff(outs[0][3]["params"], bf16[1])
    assert d <= REPLAY_ATOL, f"bf16 hook on 4 ranks is {d:.3g} from its replay"
    assert max_param_diff(replay_ddp(STEPS, GB, 4, exact_mean)[1], bf16[1]) > 10 * REPLAY_ATOL


@pytest.mark.distributed
def test_comm_hooks_match_replay_2ranks(wrong):
    """Each hook's parameters equal a one-process replay of its arithmetic (``_comm_replay``) within
    REPLAY_ATOL, and the runs a broken hook would give (no compression, lr=0, 2x gradient) are more than 10x
    that away. PowerSGD runs 4 steps with start_iter 2: steps 0-1 exact all-reduce, step 2 draws Q, step 3
    reuses it (warm start) and adds the error feedback; it is replayed with PyTorch's per-tensor algorithm in
    the bucket layout the DDP run reports (the Q seeds follow bucket order), not only compared with another
    DDP run, so a wrong PowerSGD state (rank, start, error feedback, warm start) fails."""
    cfgs = {
        "fp16": (STEPS, dict(strategy=[("ddp", {"comm_hook": "fp16"})], micro_batch=4)),
        "bf16": (STEPS, dict(strategy=[("ddp", {"comm_hook": "bf16"})], micro_batch=4)),
        "powersgd": (4, dict(strategy=[("ddp", {"comm_hook": "powersgd", "powersgd_start_iter": 2})],
                             micro_batch=4)),
    }
    outs = run_ranks(train_many, 2, [dict(steps=n, global_batch=GB, **c) for n, c in cfgs.values()])
    res = {name: (o0, o1) for name, o0, o1 in zip(cfgs, outs[0], outs[1])}
    combiners = {"fp16": lambda _: fp16_hook, "bf16": lambda _: bf16_gloo_hook,
                 "powersgd": lambda buckets: PowerSGDReplay(buckets, rank=1, start_iter=2)}
    for name, (steps, _) in cfgs.items():
        o0, o1 = res[name]
        for k in o0["params"]:
            assert torch.equal(o0["params"][k], o1["params"][k]), f"{name}: {k} differs across ranks"
        replay = replay_ddp(steps, GB, 2, combiners[name](o0["buckets"]))
        d = max_param_diff(o0["params"], replay[1])
        assert d <= REPLAY_ATOL, f"{name} hook is {d:.3g} from its replay (tolerance {REPLAY_ATOL})"
        torch.testing.assert_close(torch.tensor(o0["losses"]), torch.tensor(replay[0]), rtol=1e-6, atol=0)
        exact = replay_ddp(steps, GB, 2, exact_mean)
        wrong_here = {"no compression": exact} | (wrong if steps == STEPS else {
            "untrained (lr=0)": replay_ddp(steps, GB, 1, exact_mean, lr=0.0),
            "2x gradient": replay_ddp(steps, GB, 1, exact_mean, grad_scale=2.0),
            "PowerSGD rank 2": replay_ddp(steps, GB, 2, PowerSGDReplay(o0["buckets"], rank=2, start_iter=2)),
            "PowerSGD from step 3": replay_ddp(steps, GB, 2, PowerSGDReplay(o0["buckets"], rank=1, start_iter=3))})
        assert_wrong_runs_are_far(replay, wrong_here, REPLAY_ATOL)
    # PowerSGD's first start_iter steps are an exact all-reduce
    exact4 = replay_ddp(4, GB, 2, exact_mean)
    assert res["powersgd"][0]["losses"][:3] == pytest.approx(exact4[0][:3], rel=1e-6)


@pytest.mark.distributed
def test_meta_device_init_fsdp_and_ddp(ref, wrong):
    """A meta-built model trains exactly like the plain build (its materialised init equals the CPU build
    bit for bit: tests/distributed/test_meta_init.py), under fsdp and ddp."""
    cfgs = [dict(strategy=["fsdp"], micro_batch=4, meta=True), dict(strategy=["ddp"], micro_batch=4, meta=True)]
    outs = run_ranks(train_many, 2, [dict(steps=STEPS, global_batch=GB, **c) for c in cfgs])
    assert_wrong_runs_are_far(ref, wrong, PARAM_ATOL, LOSS_RTOL)
    for i in range(2):
        _assert_close(outs[0][i], ref)
        for k, v in outs[0][i]["params"].items():
            assert torch.equal(v, outs[1][i]["params"][k])
