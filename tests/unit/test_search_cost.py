"""The cost model's arithmetic on hand-computed cases (a toy ModelInfo and hand-built Hardware, so every
number below can be checked with pen and paper): state sharding, collective bytes and ring times, tensor
parallel's FLOP split and all-reduces, recomputation, pipeline bubbles and activations in flight, the
overlap rule, breakdown sums, MFU, node spans, and a user method composing by the same rules."""
import math

import pytest

from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate
from torchloom.cost.model import spans_nodes
from torchloom.search.pricing import compose, predict
from torchloom.cost.effects import Collective, Effects
from torchloom.cost.hardware import CollectiveFit, Hardware
from torchloom.cost.model_info import Matmul, ModelInfo, PartInfo, PassCost
from torchloom.strategy.registry import Method, register_method, unregister_method

H, L, V, S = 64, 4, 128, 16  # hidden, blocks, vocab, tokens per sample
RATE = 1e10  # FLOP/s, the same for every GEMM size
BLOCK_MM = [Matmul(S, 3 * H, H), Matmul(S, H, H), Matmul(S, 4 * H, H), Matmul(S, H, 4 * H)]
BLOCK_FWD_FLOPS = sum(m.flops for m in BLOCK_MM)  # 2*S*H*H*(3+1+4+4) = 1,572,864
HEAD_FLOPS = 2 * S * V * H
BLOCK_ACT = 100_000.0
REST_ACT = 30_000.0


def toy_info() -> ModelInfo:
    def doubled(mms):
        return [Matmul(m.m, m.n, m.k, 2 * m.count) for m in mms]

    block = PartInfo("Block", L, 12 * H * H, 12 * H * H, 48 * H * H, PassCost(BLOCK_FWD_FLOPS, BLOCK_MM),
                     PassCost(2 * BLOCK_FWD_FLOPS, doubled(BLOCK_MM)), {"float32": BLOCK_ACT, "bfloat16": BLOCK_ACT / 2},
                     input_bytes=S * H * 4)
    head = [Matmul(S, V, H)]
    rest = PartInfo("rest", 1, 2 * V * H, 2 * V * H, 8 * V * H, PassCost(HEAD_FLOPS, head),
                    PassCost(2 * HEAD_FLOPS, doubled(head)), {"float32": REST_ACT, "bfloat16": REST_ACT / 2}, 0)
    n = 12 * H * H * L + 2 * V * H
    return ModelInfo("toy", S, [block, rest], ["Block"], L, n, n,
                     dims={"hidden_size": H, "num_heads": 4, "vocab_size": V})


def linear_fit(latency: float, bw: float) -> CollectiveFit:
    return CollectiveFit([(1.0, latency + 1.0 / bw), (1e9, latency + 1e9 / bw)])


def toy_hw(ranks: int = 4, nodes: int = 1, device: str = "cuda", inter_bw: float = 0.0) -> Hardware:
    """Constant matmul rate, no memory-bound or per-op cost, collectives at 1 GB/s + 10 us inside a node."""
    fits = {k: {g: linear_fit(1e-5, 1e9) for g in (2, 4, 8)}
            for k in ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "broadcast", "all_to_all")}
    return Hardware("toy", device, 80e9, ranks, nodes, {"float32": [(1.0, RATE)], "bfloat16": [(1.0, 2 * RATE)]},
                    {"float32": 2 * RATE, "bfloat16": 4 * RATE}, mem_bw=1e30, op_overhead_s=0.0, intra=fits,
                    inter_bw=inter_bw, inter_latency_s=0.0)


def cand(methods, mb=2, accum=1, **dims) -> Candidate:
    return Candidate(ParallelDims(**dims), tuple((n, dict(c)) for n, c in methods), mb, accum, S)


def test_zero3_state_is_one_nth_of_replicated_and_zero1_shards_the_optimizer():
    info, hw = toy_info(), toy_hw()
    ddp = compose(cand([("ddp", {})], dp_replicate=4), info, hw).memory
    zero3 = compose(cand([("fsdp", {})], dp_shard=4), info, hw).memory
    zero1 = compose(cand([("ddp", {}), ("zero1", {})], dp_replicate=4), info, hw).memory
    assert ddp["params"] == info.n_params * 4 and ddp["optimizer"] == 2 * info.n_params * 4
    for k in ("params", "grads", "optimizer"):
        assert zero3[k] == pytest.approx(ddp[k] / 4)
    assert zero1["optimizer"] == pytest.approx(ddp["optimizer"] / 4)
    assert zero1["params"] == ddp["params"] and zero1["grads"] == ddp["grads"]


def test_ddp_all_reduces_the_gradient_bytes_in_ring_time():
    """Across 4 nodes (one rank each) the ring all-reduce of G bytes takes 2(N-1)/N x G / bw."""
    info, bw = toy_info(), 5e9
    hw = toy_hw(ranks=1, nodes=4, inter_bw=bw)
    p = predict(cand([("ddp", {})], dp_replicate=4), info, hw)
    (rec,) = [r for r in p.collectives if r["label"] == "ddp.all_reduce"]
    grad_bytes = info.n_trainable * 4
    assert rec["bytes"] * rec["calls"] == pytest.approx(grad_bytes) and rec["spans_nodes"]
    assert rec["seconds"] == pytest.approx(2 * 3 / 4 * grad_bytes / bw)
    # one bucket (the model is < 25 MiB): nothing to overlap it with, so all of it is exposed
    assert p.time["comm_exposed:ddp.all_reduce"] == pytest.approx(rec["seconds"])


def test_ddp_buckets_overlap_the_backward_except_the_last():
    """Small buckets on an accelerator (full overlap): only the last bucket shows."""
    info, hw = toy_info(), toy_hw(ranks=4)
    bucket_mb = 0.05
    p = predict(cand([("ddp", {"bucket_cap_mb": bucket_mb})], dp_replicate=4), info, hw)
    (rec,) = [r for r in p.collectives if r["label"] == "ddp.all_reduce"]
    n = math.ceil(info.n_trainable * 4 / (bucket_mb * 2**20))
    assert rec["calls"] == n > 2
    assert p.time["backward"] > rec["seconds"]  # room to hide the rest
    assert rec["exposed_s"] == pytest.approx(rec["seconds"] / n)
    # on a CPU/gloo machine the model hides nothing (OVERLAP_EFFICIENCY["cpu"] = 0)
    cpu = predict(cand([("ddp", {"bucket_cap_mb": bucket_mb})], dp_replicate=4), info, toy_hw(device="cpu"))
    assert cpu.time["comm_exposed:ddp.all_reduce"] == pytest.approx(rec["seconds"])


def test_tensor_parallel_halves_the_matmuls_and_adds_four_all_reduces_per_block():
    info = toy_info()
    one = predict(cand([], mb=2), info, toy_hw(ranks=1))
    two = predict(cand([("tensor_parallel", {})], mb=2, tp=2), info, toy_hw(ranks=2))
    assert one.time["forward"] == pytest.approx(2 * (L * BLOCK_FWD_FLOPS + HEAD_FLOPS) / RATE)  # mb=2
    assert two.time["forward"] == pytest.approx(one.time["forward"] / 2)
    assert two.time["backward"] == pytest.approx(one.time["backward"] / 2)
    fwd, bwd = ([r for r in two.collectives if r["label"] == label] for label in ("tp.all_reduce", "tp.all_reduce_bwd"))
    for (ar,) in (fwd, bwd):  # Megatron: 2 in forward + 2 in backward per block
        assert ar["calls"] == 2 * L and ar["bytes"] == 2 * S * H * 4 and ar["group"] == 2
        assert ar["exposed_s"] == ar["seconds"]  # on the critical path
        assert ar["seconds"] == pytest.approx(2 * L * (1e-5 + 2 * S * H * 4 / 1e9))


def test_full_checkpointing_repeats_the_forward_tensor_parallel_collectives():
    """The recomputed forward issues its all-reduces again (every_k=2: for half of the blocks); sequence
    parallel's all-gathers and reduce-scatters likewise; the backward's are not repeated."""
    info = toy_info()
    for methods, kinds in (([("tensor_parallel", {})], ["all_reduce"]),
                           ([("tensor_parallel", {}), ("sequence_parallel", {})], ["all_gather", "reduce_scatter"])):
        for every_k, share in ((1, 1.0), (2, 0.5)):
            p = predict(cand([*methods, ("checkpoint", {"every_k": every_k})], mb=2, tp=2), info, toy_hw(ranks=2))
            recs = {r["label"]: r for r in p.collectives}
            for kind in kinds:
                again = recs[f"tp.{kind}.recompute"]
                assert again["calls"] == pytest.approx(share * recs[f"tp.{kind}"]["calls"])
                assert again["seconds"] == pytest.approx(share * recs[f"tp.{kind}"]["seconds"])
                assert f"tp.{kind}_bwd.recompute" not in recs
        plain = predict(cand(methods, mb=2, tp=2), info, toy_hw(ranks=2))
        assert not any(r["label"].endswith(".recompute") for r in plain.collectives)


def test_checkpointing_adds_one_forward_of_the_checkpointed_blocks():
    info, hw = toy_info(), toy_hw(ranks=1)
    block_fwd = 2 * L * BLOCK_FWD_FLOPS / RATE  # mb=2
    every = predict(cand([("checkpoint", {})], mb=2), info, hw)
    half = predict(cand([("checkpoint", {"every_k": 2})], mb=2), info, hw)
    assert every.time["recompute"] == pytest.approx(block_fwd)
    assert half.time["recompute"] == pytest.approx(block_fwd / 2)
    # activations: checkpointed blocks keep their fp32 input only
    full = compose(cand([], mb=2), info, hw).memory["activations"]
    kept = compose(cand([("checkpoint", {})], mb=2), info, hw).memory["activations"]
    assert full == pytest.approx(2 * (L * BLOCK_ACT + REST_ACT))
    assert kept == pytest.approx(2 * (L * S * H * 4 + REST_ACT))


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)])
def test_pipeline_bubble_fraction(schedule, v):
    """Bubble = (p-1)/(v m + p - 1) of the pipeline's compute time."""
    info, hw = toy_info(), toy_hw(ranks=2)
    p, m = 2, 4
    pred = predict(cand([("pipeline_parallel", {"schedule": schedule})], mb=1, accum=m, pp=p), info, hw)
    compute = pred.time["forward"] + pred.time["backward"]
    assert pred.time["bubble"] / (compute + pred.time["bubble"]) == pytest.approx((p - 1) / (v * m + p - 1))


def test_pipeline_activations_in_flight():
    """1F1B: the first rank holds min(m, p) micro-batches; GPipe: all m."""
    info, hw = toy_info(), toy_hw(ranks=2)
    c1 = compose(cand([("pipeline_parallel", {})], mb=1, accum=4, pp=2), info, hw)
    cg = compose(cand([("pipeline_parallel", {"schedule": "gpipe"})], mb=1, accum=4, pp=2), info, hw)
    assert c1.pipeline.in_flight == 2 and cg.pipeline.in_flight == 4
    first = c1.pipeline.ranks[0]
    assert first.first and not first.last and first.blocks + c1.pipeline.ranks[1].blocks == L
    last = c1.pipeline.ranks[1]
    assert first.blocks == last.blocks == 2  # balanced by parameters: embedding + 2 blocks | 2 blocks + head
    # GPipe: the last rank (same blocks, plus the head's parameters and activations) is the most loaded
    assert cg.memory["activations"] == pytest.approx(4 * (BLOCK_ACT * last.blocks + REST_ACT))
    # 1F1B: the first rank's 2 micro-batches outweigh the last rank's one (with the head's activations)
    assert c1.memory["activations"] == pytest.approx(2 * BLOCK_ACT * first.blocks)


def test_fsdp_gathers_each_block_in_forward_and_again_in_backward_for_zero3():
    info, hw = toy_info(), toy_hw(ranks=4)
    z3 = predict(cand([("fsdp", {})], accum=2, dp_shard=4), info, hw)
    z2 = predict(cand([("fsdp", {"reshard_after_forward": False})], accum=2, dp_shard=4), info, hw)
    calls = {r["label"]: r["calls"] for r in z3.collectives}
    assert calls["fsdp.all_gather"] == 2 * (L + 1) and calls["fsdp.all_gather_bwd"] == 2 * L
    assert calls["fsdp.reduce_scatter"] == L + 1  # once per optimizer step (no sync while accumulating)
    assert "fsdp.all_gather_bwd" not in {r["label"] for r in z2.collectives}
    ag = next(r for r in z3.collectives if r["label"] == "fsdp.all_gather_bwd")
    assert ag["bytes"] == pytest.approx(12 * H * H * 4)  # one gathered block, fp32


def test_breakdowns_sum_and_mfu_arithmetic():
    info, hw = toy_info(), toy_hw(ranks=4)
    cases = [cand([("ddp", {})], dp_replicate=4), cand([("fsdp", {}), ("amp", {"dtype": "bfloat16"})], dp_shard=4),
             cand([("tensor_parallel", {}), ("sequence_parallel", {}), ("fsdp", {})], dp_shard=2, tp=2),
             cand([("pipeline_parallel", {}), ("checkpoint", {})], accum=4, pp=2, dp_replicate=2),
             cand([("ddp", {}), ("zero1", {})], accum=3, dp_replicate=4)]
    for c in cases:
        p = predict(c, info, hw)
        assert sum(p.time.values()) == pytest.approx(p.step_time_s, rel=1e-12)
        assert sum(p.memory.values()) == pytest.approx(p.peak_memory_bytes, rel=1e-12)
        assert p.memory["headroom"] == pytest.approx(0.05 / 1.05 * p.peak_memory_bytes)
        peak = hw.peak_flops["bfloat16" if "amp" in c.names else "float32"]
        assert p.peak_flops == peak
        assert p.mfu == pytest.approx(info.flops_per_sample() * c.global_batch / p.step_time_s / 4 / peak)
        assert p.tokens_per_s == pytest.approx(c.global_batch * S / p.step_time_s)
        assert p.fits


def test_amp_runs_the_matmuls_at_the_low_precision_rate():
    info = toy_info()
    fp32 = predict(cand([]), info, toy_hw(ranks=1))
    bf16 = predict(cand([("amp", {})]), info, toy_hw(ranks=1))
    assert bf16.time["forward"] == pytest.approx(fp32.time["forward"] / 2)  # the table's bf16 rate is 2x


def test_groups_spanning_nodes():
    d = ParallelDims
    assert not spans_nodes(d(tp=8), "tp", 8) and spans_nodes(d(tp=16), "tp", 8)
    assert not spans_nodes(d(dp_shard=4, tp=2), "tp", 8) and not spans_nodes(d(dp_shard=4, tp=2), "dp_shard", 8)
    assert spans_nodes(d(dp_replicate=2, dp_shard=8), "dp_replicate", 8)
    assert not spans_nodes(d(dp_replicate=2, dp_shard=8), "dp_shard", 8)
    assert spans_nodes(d(dp_replicate=2, dp_shard=8), "dp", 8)
    assert spans_nodes(d(tp=3), "tp", 8)  # 3 does not divide 8: some groups straddle a node boundary
    assert not spans_nodes(d(pp=4, dp_shard=2), "pp", 8) and spans_nodes(d(pp=4, dp_shard=4), "pp", 8)


def test_a_user_method_composes_by_the_same_rules():
    @register_method
    class HalveOptimizer(Method):
        name = "toy_halve_optimizer"

        def estimate(self, info, dims, hw, step):
            return Effects(memory_scale={"optimizer": 0.5}, memory_add={"temporary": 1e6},
                           collectives=[Collective("all_reduce", 1e6, "dp", calls=2, label="toy.sync")],
                           time_add={"work": 0.25})

    try:
        info, hw = toy_info(), toy_hw(ranks=4)
        base = cand([("ddp", {})], dp_replicate=4)
        mine = cand([("ddp", {}), ("toy_halve_optimizer", {})], dp_replicate=4)
        b, m = compose(base, info, hw).memory, compose(mine, info, hw).memory
        assert m["optimizer"] == pytest.approx(b["optimizer"] / 2)
        assert m["temporary"] == pytest.approx(b["temporary"] + 1e6)
        p = predict(mine, info, hw)
        assert p.time["toy_halve_optimizer.work"] == 0.25
        assert p.time["comm_exposed:toy.sync"] == pytest.approx(2 * (1e-5 + 1e6 / 1e9))
    finally:
        unregister_method("toy_halve_optimizer")


def test_bad_effects_are_refused():
    with pytest.raises(ValueError, match="unknown memory categories"):
        Effects(memory_scale={"weights": 0.5})
    with pytest.raises(ValueError, match="overlap"):
        Collective("all_reduce", 1.0, "dp", overlap="sometimes")


def test_co_located_cpu_ranks_are_priced_at_the_rates_calibrated_for_them():
    """4 single-threaded ranks on 2 cores: the calibration measures every rate with all 4 ranks busy, in chunks
    spanning scheduler slices (``Timer.min_chunk_s``), so its figures are already each rank's share: the
    memory-bound bytes, the per-op dispatch and the optimizer step are priced at them, with no further factor
    (an oversubscription factor on top counted the sharing twice once the calibration measured it)."""
    import dataclasses

    info = toy_info()
    for part in info.parts:  # 1 MB of memory-bound traffic and 50 ops per pass
        for pc in (part.fwd, part.bwd):
            pc.other_bytes, pc.ops = 1e6, 50

    def hw(ranks, cores):
        return dataclasses.replace(toy_hw(ranks=ranks, device="cpu"), mem_bw=1e9, op_overhead_s=1e-5,
                                   threads_per_rank=1, fingerprint={"cores": cores})

    c = cand([("ddp", {})], dp_replicate=4)
    alone, shared = predict(c, info, hw(4, 4)), predict(c, info, hw(4, 2))
    assert shared.time["forward"] == pytest.approx(alone.time["forward"], rel=1e-12)
    assert shared.time["optimizer"] == pytest.approx(alone.time["optimizer"], rel=1e-12)


def test_predictions_match_the_recorded_grid():
    """The cost model's speed-ups (hoisted per-part pass times, memoised collective pricing) must not change a
    single prediction: 198 candidates (data-parallel, FSDP, TP, pipeline schedules; micro-batch 1-2, 1-8
    accumulation) on three machines (the H100 table over 2 nodes, a one-node toy, oversubscribed CPU ranks)
    against values recorded before the change (tests/unit/cost_grid.py). Tolerance 1e-12 relative: pure
    float arithmetic in the same order; any changed term (a wrong cached key: another micro-batch's pass
    time, another group's collective) moves a value by > 1e-3. Evaluated twice on the same analysis, so a
    memo left on ``info``/``hw`` by the first pass cannot leak into the second. Re-recorded (``python
    tests/unit/cost_grid.py``) only for a deliberate change of the model, which must name the machines it moves:
    2026-12-05, the oversubscription factor removed (the calibration measures the sharing): the oversubscribed CPU
    machine's 66 of 69 candidates moved, the H100 and toy machines' not one."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import cost_grid

    want = json.loads(cost_grid.DATA.read_text())
    for _ in range(2):
        got = json.loads(json.dumps(cost_grid.grid(), sort_keys=True, default=str))
        assert got.keys() == want.keys()
        for k, w in want.items():
            _assert_close(got[k], w, k)


def _assert_close(got, want, where):
    if isinstance(want, dict):
        assert got.keys() == want.keys(), where
        for k in want:
            _assert_close(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, list):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert got == pytest.approx(want, rel=1e-12, abs=1e-300), where
    else:
        assert got == want, where
