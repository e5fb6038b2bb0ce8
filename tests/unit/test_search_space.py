"""The search's planning layer and space: mesh factorisations and views without a process group, candidate
enumeration (every candidate valid for the world size, degree-1 dims included, pins/excludes honoured, user
methods joining), pruning by ``validate`` and by memory, ranking by predicted throughput on hand-built
hardware, choosing the best measured trial, and the time limit. No process group, no allocated model."""
import math
import warnings
from dataclasses import dataclass

import pytest

from torchloom.errors import StrategyError
from torchloom.parallel.dims import describe, divisors, factorisations, spans_nodes, view_size
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate, Prediction
from torchloom.cost.hardware import CollectiveFit, Hardware
from torchloom.cost.model_info import Matmul, ModelInfo, PartInfo, PassCost
from torchloom.search.options import SearchOptions
from torchloom.search.search import search
from torchloom.search.space import check, enumerate_space
from torchloom.strategy.registry import Method, register_method, unregister_method

H, L, V, S = 64, 4, 128, 16  # hidden, blocks, vocab, tokens per sample


def toy_info(blocks: int = L, heads: int = 4, block_params: int = 12 * H * H, act: float = 100_000.0) -> ModelInfo:
    mm = [Matmul(S, 3 * H, H), Matmul(S, H, H), Matmul(S, 4 * H, H), Matmul(S, H, 4 * H)]
    fwd = sum(m.flops for m in mm)
    block = PartInfo("Block", blocks, block_params, block_params, 4 * block_params, PassCost(fwd, mm),
                     PassCost(2 * fwd, [Matmul(m.m, m.n, m.k, 2) for m in mm]),
                     {"float32": act, "bfloat16": act / 2}, input_bytes=S * H * 4)
    head = [Matmul(S, V, H)]
    rest = PartInfo("rest", 1, 2 * V * H, 2 * V * H, 8 * V * H, PassCost(2 * S * V * H, head),
                    PassCost(4 * S * V * H, [Matmul(S, V, H, 2)]), {"float32": 30_000.0, "bfloat16": 15_000.0}, 0)
    n = block_params * blocks + 2 * V * H
    return ModelInfo("toy", S, [block, rest], ["Block"], blocks, n, n, signature=f"toy{blocks}-{heads}-{block_params}",
                     dims={"hidden_size": H, "num_heads": heads, "num_kv_heads": heads, "intermediate_size": 4 * H,
                           "vocab_size": V})


def toy_hw(memory: float = 80e9, ranks: int = 4, nodes: int = 1, device: str = "cuda") -> Hardware:
    fit = CollectiveFit([(1.0, 1e-5), (1e9, 1e-5 + 1.0)])  # 10 us + 1 GB/s
    intra = {k: {g: fit for g in (2, 4, 8)} for k in ("all_reduce", "all_gather", "reduce_scatter", "send_recv",
                                                       "broadcast", "all_to_all")}
    return Hardware("toy", device, memory, ranks, nodes, {"float32": [(1.0, 1e10)], "bfloat16": [(1.0, 2e10)]},
                    {"float32": 2e10, "bfloat16": 4e10}, mem_bw=1e12, op_overhead_s=0.0, intra=intra,
                    inter_bw=1e8 if nodes > 1 else 0.0, inter_latency_s=1e-5)


def n_ordered_factorisations(n: int, k: int = 4) -> int:
    """Ordered factorisations of n into k factors: product over primes p^e of C(e + k - 1, k - 1)."""
    total, p = 1, 2
    while n > 1:
        e = 0
        while n % p == 0:
            n //= p
            e += 1
        total *= math.comb(e + k - 1, k - 1)
        p += 1
    return total


# ------------------------------------------------------------------------------------------ mesh planning
@pytest.mark.parametrize("world", [1, 2, 4, 6, 8, 12, 1024])
def test_factorisations_are_every_4d_split_with_degree_one_cases(world):
    dims = factorisations(world)
    shapes = [(d.pp, d.dp_replicate, d.dp_shard, d.tp) for d in dims]
    assert all(math.prod(s) == world and d.ep == 1 for s, d in zip(shapes, dims))
    assert len(set(shapes)) == len(shapes) == n_ordered_factorisations(world)  # 1024 -> C(13, 3) = 286
    for i in range(4):  # the whole world on one dimension, every other degree 1
        assert tuple(world if j == i else 1 for j in range(4)) in shapes
    assert factorisations(world) == dims  # deterministic order


def test_factorisations_reject_a_bad_world_size():
    with pytest.raises(StrategyError, match="positive integer"):
        factorisations(0)


def test_view_sizes_and_node_spans():
    d = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, tp=4)  # 32 ranks
    assert {v: view_size(d, v) for v in ("pp", "dp", "dp_shard", "dp_replicate", "tp")} == \
        {"pp": 2, "dp": 4, "dp_shard": 2, "dp_replicate": 2, "tp": 4}
    # 8 ranks a node: tp (adjacent ranks) and dp_shard x tp fit; dp_replicate (stride 8) and pp (stride 16) cross
    assert not spans_nodes(d, "tp", 8) and not spans_nodes(d, "dp_shard", 8)
    assert spans_nodes(d, "dp_replicate", 8) and spans_nodes(d, "dp", 8) and spans_nodes(d, "pp", 8)
    assert spans_nodes(d, "tp", 2)  # tp=4 on 2-rank nodes
    assert not any(v["spans_nodes"] for v in describe(d, 32).values())  # one node holds everything
    with pytest.raises(StrategyError, match="unknown mesh view 'ep_shard'"):
        view_size(d, "ep_shard")
    assert divisors(12) == [1, 2, 3, 4, 6, 12]


# ------------------------------------------------------------------------------------------ enumeration
def test_every_candidate_is_valid_for_the_world_and_batch():
    info = toy_info()
    space = enumerate_space(info, 4, 8, SearchOptions())
    assert space.bases
    seen_meshes = set()
    for c in space.bases:
        assert math.prod(c.dims.as_dict().values()) == 4
        assert c.global_batch == 8 and c.micro_batch * c.grad_accum * c.dims.dp == 8
        seen_meshes.add((c.dims.pp, c.dims.dp_replicate, c.dims.dp_shard, c.dims.tp))
        s = c.strategy()  # a valid Strategy object: conflicts were never enumerated
        if c.dims.dp > 1:
            assert any(n in s for n in ("ddp", "fsdp"))
    # degree-1 cases: pure data parallel both ways, pure tp, pure pp, and 2-D mixes
    assert {(1, 4, 1, 1), (1, 1, 4, 1), (1, 1, 1, 4), (4, 1, 1, 1), (1, 2, 2, 1), (2, 2, 1, 1), (1, 2, 1, 2)} <= seen_meshes
    labels = {c.label().split(" | ")[1] for c in space.bases}
    assert {"ddp", "zero1", "zero2", "zero3"} <= labels  # ZeRO-1/2/3 and DDP
    assert any(c.dims.dp_replicate > 1 and c.dims.dp_shard > 1 and c.config("fsdp") == {} for c in space.bases)  # HSDP
    # under tp, "ddp" is FSDP over a replicate-only mesh (DDP cannot hold DTensors); zero1 (needs DDP) absent
    tp_dp = [c for c in space.bases if c.dims.tp > 1 and c.dims.dp_replicate > 1]
    assert tp_dp and all("ddp" not in c.names and "zero1" not in c.names for c in tp_dp)
    assert all(c.config("fsdp") == {"reshard_after_forward": False} for c in tp_dp)
    assert any("sequence_parallel" in c.names for c in space.bases)
    assert any(c.config("amp") == {"dtype": "bfloat16"} for c in space.bases)
    pp = [c for c in space.bases if c.dims.pp > 1]
    assert pp and all(c.config("pipeline_parallel")["num_microbatches"] == c.grad_accum for c in pp)
    assert len({c.key() for c in space.bases}) == len(space.bases)  # nothing enumerated twice


def test_validate_prunes_what_auto_accelerate_would_reject():
    info = toy_info(heads=4)  # tp=3 cannot split 4 heads
    space = enumerate_space(info, 6, 6, SearchOptions())
    tp3 = [c for c in space.bases if c.dims.tp == 3]
    assert tp3
    assert all("3" in (check(c, info) or "") for c in tp3)
    from torchloom.search.validate import validate_strategy
    with pytest.raises(StrategyError) as apply_error:
        validate_strategy(tp3[0].strategy(), info, tp3[0].dims)
    assert check(tp3[0], info) == str(apply_error.value)
    # 1F1B with fewer micro-batches than stages: the configure check auto_accelerate makes
    bad = Candidate(ParallelDims(pp=4), (("pipeline_parallel", {"schedule": "1f1b", "num_microbatches": 2}),), 1, 2, S)
    assert "num_microbatches >= the number of stages (4)" in check(bad, info)
    ok = Candidate(ParallelDims(dp_shard=2, tp=2), (("fsdp", {}), ("tensor_parallel", {})), 1, 1, S)
    assert check(ok, info) is None


def test_pins_and_excludes_are_honoured():
    info = toy_info()
    space = enumerate_space(info, 8, 16, SearchOptions.parse({"fixed": {"tp": 2}, "exclude": ["pipeline_parallel", "amp"]}))
    assert space.bases and all(c.dims.tp == 2 and c.dims.pp == 1 and "amp" not in c.names for c in space.bases)
    space = enumerate_space(info, 4, 8, SearchOptions.parse({"include": ["zero3", "amp"], "fixed": {"micro_batch": 1}}))
    # zero3 (with accumulation also its sharded-accumulation variant)
    assert space.bases and all(c.config("fsdp") in ({}, {"accumulate_sharded": True}) and c.dims.dp_replicate == 1
                               and "amp" in c.names and c.micro_batch == 1 for c in space.bases)
    space = enumerate_space(info, 4, 8, SearchOptions.parse({"exclude": ["fsdp", "zero1"], "include": ["pp"]}))
    assert space.bases and all(c.dims.pp > 1 and "fsdp" not in c.names and "zero1" not in c.names
                               for c in space.bases)


@pytest.mark.parametrize("bad,match", [
    ({"exclud": ["pp"]}, "unknown search option.*'exclud'.*Did you mean 'exclude'"),
    ({"exclude": ["pipline_parallel"]}, "unknown method 'pipline_parallel'.*Did you mean 'pipeline_parallel'"),
    ({"fixed": {"tpp": 2}}, "unknown fixed key 'tpp'.*Did you mean 'tp'"),
    ({"fixed": {"tp": 0}}, "fixed tp must be a positive integer"),
    ({"fixed": {"tp": 2}, "exclude": ["tensor_parallel"]}, "fixed tp=2 but tensor_parallel is excluded"),
    ({"include": ["amp"], "exclude": ["amp_native"]}, r"\['amp'\] both included and excluded"),
    ({"time_limit_s": 0}, "time_limit_s must be a number > 0"),
    ({"top_k": -1}, "top_k must be an integer >= 0"),
    ({"on_mismatch": "ignore"}, "on_mismatch must be 'error' or 'research'"),
    ({"exclude": ["ddp", "zero1", "fsdp"]}, "every data-parallel method is excluded"),
    ({"include": ["parallel_mode"]}, "not a method to include or exclude"),
    ("fast", "search must be a dict"),
])
def test_bad_search_options_are_named(bad, match):
    with pytest.raises(StrategyError, match=match):
        SearchOptions.parse(bad)


@dataclass
class _FuseConfig:
    width: int = 1


class _Fuse(Method):
    name = "test_fuse_ops"
    Config = _FuseConfig
    search_configs = ({"width": 2}, {"width": 4})


def test_user_method_with_search_configs_joins_the_space():
    register_method(_Fuse)
    try:
        info = toy_info()
        space = enumerate_space(info, 2, 4, SearchOptions())
        widths = {(c.config("test_fuse_ops") or {}).get("width") for c in space.bases}
        assert widths == {None, 2, 4}  # absent, and each search config
        only = enumerate_space(info, 2, 4, SearchOptions.parse({"include": ["test_fuse_ops"]}))
        assert {c.config("test_fuse_ops")["width"] for c in only.bases} == {2, 4}
        none = enumerate_space(info, 2, 4, SearchOptions.parse({"exclude": ["test_fuse_ops"]}))
        assert all("test_fuse_ops" not in c.names for c in none.bases)
    finally:
        unregister_method("test_fuse_ops")


# ------------------------------------------------------------------------------------------ search
def test_ranking_is_by_predicted_throughput_and_deterministic():
    info, hw = toy_info(), toy_hw()
    r = search(info=info, world_size=4, global_batch=8, hw=hw, options={"top_k": 0})
    # by throughput to 4 significant digits (closer is a tie), then the smaller peak memory
    tps = [float(f"{e.prediction.tokens_per_s:.4g}") for e in r.ranked]
    assert tps == sorted(tps, reverse=True) and len(tps) > 20
    for a, b in zip(r.ranked, r.ranked[1:]):
        if float(f"{a.prediction.tokens_per_s:.4g}") == float(f"{b.prediction.tokens_per_s:.4g}"):
            assert a.prediction.peak_memory_bytes <= b.prediction.peak_memory_bytes
    assert r.chosen.key() == r.ranked[0].candidate.key() and r.chosen_by == "predicted"
    again = search(info=info, world_size=4, global_batch=8, hw=hw, options={"top_k": 0})
    assert [e.candidate.key() for e in again.ranked] == [e.candidate.key() for e in r.ranked]
    assert "chose" in r.notes[0] and r.chosen.label() in r.table()


def test_memory_pruning_picks_the_least_checkpointing_that_fits():
    info = toy_info(act=4e6)  # activations dominate the peak
    opts = {"top_k": 0, "exclude": ["amp"], "fixed": {"micro_batch": 4}}
    free = search(info=info, world_size=1, global_batch=4, hw=toy_hw(), options=opts)
    assert len(free.ranked) == 1 and "checkpoint" not in free.ranked[0].candidate.names  # fits without
    no_ac = free.ranked[0].prediction.peak_memory_bytes
    # 1% less memory than that: the least checkpointing that fits. Every 4th block (1 of 4) saves nothing at
    # the peak (its recomputation during its own backward needs the same bytes); every 2nd block does.
    tight = search(info=info, world_size=1, global_batch=4, hw=toy_hw(memory=no_ac * 0.99 / 0.95), options=opts)
    assert len(tight.ranked) == 1
    chosen = tight.ranked[0]
    assert chosen.candidate.config("checkpoint") == {"every_k": 2}
    assert chosen.prediction.peak_memory_bytes <= no_ac * 0.99
    # probed: none (too big), every block (fits), then bisection: every 4th (too big), every 2nd (fits)
    assert [e.candidate.config("checkpoint") for e in tight.evaluated] == [None, {}, {"every_k": 4}, {"every_k": 2}]
    assert [e.fits for e in tight.evaluated] == [False, True, False, True]


def test_a_model_that_fits_nowhere_says_by_how_much_and_what_would_fit():
    info = toy_info()
    with pytest.raises(StrategyError) as e:
        search(info=info, world_size=2, global_batch=4, hw=toy_hw(memory=50_000, ranks=2),
               options={"top_k": 0, "fixed": {"micro_batch": 2}})
    msg = str(e.value)
    assert "fits no candidate on 2 ranks" in msg and "over" in msg
    assert "more devices" in msg and "CPU offload" in msg and "smaller micro-batch" in msg and "KiB" in msg


class _FakeRunner:
    """Measures each candidate as given by ``times`` (by label) and records what it was asked."""

    def __init__(self, times=None, fail=False):
        self.times, self.fail, self.calls = times or {}, fail, []

    def __call__(self, cands, *, total_time_s, time_budget_s, steps):
        self.calls.append((len(cands), total_time_s, time_budget_s, steps))
        from torchloom.search.runner import TrialResult
        out = []
        for i, c in enumerate(cands):
            if self.fail:
                out.append(TrialResult(c, "oom", error="rank 0: OutOfMemoryError: boom"))
            else:
                t = self.times.get(i, 1.0)
                out.append(TrialResult(c, "ok", step_time_s=t, step_times=[t], peak_memory_bytes=1e6))
        return out


def test_the_best_measured_trial_is_chosen_within_the_time_limit():
    info, hw = toy_info(), toy_hw()
    runner = _FakeRunner({0: 0.3, 1: 0.1, 2: 0.2})  # the second-best predicted runs fastest
    r = search(info=info, world_size=4, global_batch=8, hw=hw, options={"top_k": 3, "time_limit_s": 30},
               runner=runner)
    assert r.chosen.key() == r.ranked[1].candidate.key() and r.chosen_by == "measured"
    assert [t.candidate.key() for t in r.trials] == [e.candidate.key() for e in r.ranked[:3]]
    n, total, budget, steps = runner.calls[0]
    assert n == 3 and 0 < total <= 30 and budget == pytest.approx(total / 3) and steps == 3
    assert "meas ms" in r.table() and "100.0" in r.table()


def test_no_finished_trial_falls_back_to_the_best_prediction_with_a_warning():
    info, hw = toy_info(), toy_hw()
    with pytest.warns(UserWarning, match="none of the 2 confirming runs finished"):
        r = search(info=info, world_size=2, global_batch=4, hw=hw, options={"top_k": 2}, runner=_FakeRunner(fail=True))
    assert r.chosen.key() == r.ranked[0].candidate.key() and r.chosen_by == "predicted"
    assert all(t.status == "oom" and not t.ok for t in r.trials)


def test_a_thousand_gpus_plan_prunes_cross_node_tp_and_ranks_thousands():
    info = toy_info(blocks=32, heads=32, block_params=200_000_000)
    r = search(info=info, world_size=1024, global_batch=1024, hw=toy_hw(80e9, ranks=8, nodes=128),
               options={"top_k": 0, "exclude": ["amp"]})
    assert len(r.evaluated) > 1000 and r.ranked
    assert all(e.candidate.dims.tp <= 8 for e in r.evaluated)  # TP stays inside a node of 8
    assert any("cross nodes" in k for k in r.pruned_reasons)


def test_predictions_only_when_no_runner():
    r = search(info=toy_info(), world_size=2, global_batch=4, hw=toy_hw(), options={"top_k": 2})
    assert not r.trials and any("no runner" in n for n in r.notes)
    assert isinstance(r.chosen_prediction, Prediction)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        SearchOptions.parse(None)


# ------------------------------------------------------------------ errors when nothing valid is left (F1)
def test_pinned_degree_that_does_not_divide_the_world_is_named_not_memory():
    with pytest.raises(StrategyError) as e:
        search(info=toy_info(), world_size=2, global_batch=4, hw=toy_hw(ranks=2),
               options={"top_k": 0, "fixed": {"tp": 3}})
    msg = str(e.value)
    assert "tp=3 does not divide the world size 2" in msg and "search fixed tp=3" in msg
    assert "fits no candidate" not in msg and "more devices" not in msg and "micro-batch" not in msg


def test_every_candidate_failing_validate_names_the_validate_message_not_memory():
    import dataclasses

    base = toy_info(heads=4)  # tp=4 cannot split 2 KV heads; a new signature: check() memoises per model
    info = dataclasses.replace(base, dims={**base.dims, "num_kv_heads": 2}, signature=base.signature + "-kv2")
    with pytest.raises(StrategyError) as e:
        search(info=info, world_size=4, global_batch=8, hw=toy_hw(ranks=4), options={"top_k": 0, "fixed": {"tp": 4}})
    msg = str(e.value)
    assert "no valid candidate on 4 ranks" in msg and "num_kv_heads = 2 is not divisible by tp=4" in msg
    assert "fits no candidate" not in msg and "more devices" not in msg


def test_memory_advice_never_asks_for_fewer_devices_than_there_are():
    # the state (~3.25 MiB) fits 4 ranks of 1 MiB when sharded; the activations are what overflow
    info = toy_info(act=50e6)
    with pytest.raises(StrategyError) as e:
        search(info=info, world_size=4, global_batch=8, hw=toy_hw(memory=2**20, ranks=4, device="cpu"),
               options={"top_k": 0, "exclude": ["checkpoint"]})
    msg = str(e.value)
    assert "fits no candidate on 4 ranks" in msg and "more devices" not in msg, msg


# ----------------------------------------------------------- the time limit, the fallback, the table (F9)
def _slow_predict(delay_s):
    from torchloom.search.pricing import predict

    def slow(cand, info, hw):
        import time

        time.sleep(delay_s)
        return predict(cand, info, hw)

    return slow


def test_a_spent_time_limit_skips_the_trials_says_so_and_warns(caplog):
    import logging

    runner = _FakeRunner()
    with pytest.warns(UserWarning, match=r"no confirming run started: the search's time limit of 0\.01 s"), \
            caplog.at_level(logging.WARNING, logger="torchloom.search"):
        r = search(info=toy_info(), world_size=2, global_batch=4, hw=toy_hw(ranks=2),
                   options={"top_k": 2, "time_limit_s": 0.01}, runner=runner, predict=_slow_predict(0.02))
    assert not runner.calls and r.chosen_by == "predicted" and r.chosen.key() == r.ranked[0].candidate.key()
    assert [t.status for t in r.trials] == ["skipped", "skipped"] and all("0.01 s" in t.error for t in r.trials)
    rows = r.table().splitlines()[2:4]
    assert all(row.endswith("skipped") and "failed" not in row for row in rows), r.table()
    # the logger gets it at WARNING too (loom train's log listens to it)
    assert any(rec.levelno == logging.WARNING and "no confirming run started" in rec.getMessage()
               for rec in caplog.records)


def test_table_shows_whole_labels_and_every_mfu_peak():
    r = search(info=toy_info(), world_size=4, global_batch=8, hw=toy_hw(), options={"top_k": 0})
    table = r.table(n=len(r.ranked))
    labels = [e.candidate.label() for e in r.ranked]
    assert max(map(len, labels)) > 64  # e.g. "pp2 tp2 | amp(bfloat16) tensor_parallel sequence_parallel ..."
    assert all(label in table for label in labels)
    footer = table.splitlines()[-1]
    assert "0.02 TFLOP/s (float32 rows)" in footer and "0.04 TFLOP/s (bfloat16 rows)" in footer, footer


def test_loom_train_log_does_not_repeat_the_search_summary():
    import logging

    from torchloom.train.job import _LogToJob

    class _Job:
        lines: list = []

        def log(self, msg):
            self.lines.append(msg)

    handler = _LogToJob(_Job())
    logger = logging.getLogger("torchloom.search")
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        r = search(info=toy_info(), world_size=2, global_batch=4, hw=toy_hw(ranks=2), options={"top_k": 0})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert r.notes[0] in handler.seen  # Job.setup skips the notes in handler.seen: the summary appears once
    assert sum(r.notes[0] in line for line in handler.job.lines) == 1


def test_context_parallel_is_searched_for_long_sequences_only():
    """cp meshes (with context_parallel and fsdp over dp_shard x cp) appear from CP_MIN_SEQ tokens, with degrees
    that split the sequence into 2 cp chunks; a pin selects one degree; excluding it removes them."""
    import dataclasses

    from torchloom.search.space import CP_MIN_SEQ

    short = toy_info()
    long = dataclasses.replace(toy_info(), seq_len=CP_MIN_SEQ)
    assert not [c for c in enumerate_space(short, 8, 8, SearchOptions(), context_parallel=True).bases if c.dims.cp > 1]
    # without context_parallel=True (the search passes it) no cp meshes
    assert not [c for c in enumerate_space(long, 8, 8, SearchOptions()).bases if c.dims.cp > 1]
    cps = [c for c in enumerate_space(long, 8, 8, SearchOptions(), context_parallel=True).bases if c.dims.cp > 1]
    assert {c.dims.cp for c in cps} == {2, 4, 8}
    for c in cps:
        names = [n for n, _ in c.methods]
        assert ("context_parallel" in names) != ("ulysses" in names) and "fsdp" in names and c.dims.world == 8
        assert c.global_batch == 8
    # Ulysses where cp divides the 4 heads (cp 2, 4; not 8); cp inside pipeline stages too
    assert {c.dims.cp for c in cps if ("ulysses", {}) in c.methods} == {2, 4}
    assert any(c.dims.pp > 1 for c in cps)
    pinned = enumerate_space(long, 8, 8, SearchOptions.parse({"fixed": {"cp": 4}}), context_parallel=True).bases
    assert pinned and {c.dims.cp for c in pinned} == {4}
    too_big = enumerate_space(long, 8, 8, SearchOptions.parse({"fixed": {"cp": 32}}), context_parallel=True)
    assert not too_big.bases and any("cp=32" in p.reason for p in too_big.pruned)  # named, not a crash
    assert not [c for c in enumerate_space(long, 8, 8, SearchOptions.parse({"exclude": ["context_parallel"]}),
                                           context_parallel=True).bases if c.dims.cp > 1]


def test_float8_is_a_precision_only_where_the_hardware_has_it():
    info = toy_info()
    plain = enumerate_space(info, 4, 8, SearchOptions()).bases
    fp8 = enumerate_space(info, 4, 8, SearchOptions(), fp8=True).bases
    assert not any(n == "float8" for c in plain for n, _ in c.methods)
    with8 = [c for c in fp8 if any(n == "float8" for n, _ in c.methods)]
    assert with8 and not any(n == "tensor_parallel" for c in with8 for n, _ in c.methods)  # declared conflict
    assert len(fp8) > len(plain)
