"""Confirming trial runs (torchloom.search.runner) in one process (a 1-rank gloo group): failures recorded,
time budgets honoured, the process state a run after the trials sees left as it was. The 2-rank checks
(group tear-down, a real run after trials bitwise equal to one without) are in
tests/distributed/test_search_trials.py."""
import random
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.models import tiny_llama, token_batches
from torchloom.parallel import mesh as loom_mesh
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate
from torchloom.search.isolation import live_groups
from torchloom.search.runner import TrialResult, _loader_args, resize_batch, run_trials
from torchloom.testing.dist import free_port

DATA = [{"input_ids": x, "labels": x} for x in token_batches(32)]


@pytest.fixture()
def group(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def cand(methods=(), mb=4, accum=1, **dims):
    return Candidate(ParallelDims(**dims), tuple(methods), mb, accum, 16)


def lm_loss(batch, out):
    return out.loss


def trials(cands, **kw):
    args = dict(make_model=tiny_llama, optim_func=torch.optim.SGD, optim_args={"lr": 0.1}, dataset=DATA,
                loss_func=lm_loss, model_input_format="unpack_dict", steps=2, warmup=1)
    args.update(kw)
    return run_trials(cands, **args)


def test_failing_and_oom_candidates_recorded_others_measured(group):
    def loss(batch, out):
        if batch["input_ids"].shape[0] == 8:  # the mb8 candidate "runs out of memory" after its forward
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return out.loss

    got = trials([cand(), cand([("fsdp", {"bogus": 1})]), cand(mb=8), cand([("checkpoint", {})], mb=2, accum=2)],
                 loss_func=loss)
    assert [r.status for r in got] == ["ok", "error", "oom", "ok"], [(r.status, r.error) for r in got]
    assert "bogus" in got[1].error and got[1].error.startswith("rank 0: StrategyError"), got[1].error
    assert "out of memory" in got[2].error, got[2].error
    for r in (got[0], got[3]):
        assert len(r.step_times) == 2 and r.step_time_s > 0, r
        assert r.peak_memory_bytes > 0 and r.memory_source == "memtracker", r
    assert got[1].step_time_s is None and got[2].step_time_s is None


def test_user_model_deep_copied_and_unchanged(group):
    model = tiny_llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    got = trials([cand()], make_model=model)
    assert got[0].ok, got[0]
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # the trials trained copies
    assert not any(hasattr(m, "_checkpoint_wrapped_module") for m in model.modules())


def test_process_state_restored(group):
    """RNG of torch / Python / NumPy continues as if no trial had run; the current mesh is the caller's."""
    def draws():
        return torch.rand(4), random.random(), np.random.rand(3)

    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    expected = draws()
    torch.manual_seed(7), random.seed(7), np.random.seed(7)
    groups = len(live_groups())
    got = trials([cand(), cand([("checkpoint", {})])])
    assert all(r.ok for r in got), got
    after = draws()
    assert torch.equal(after[0], expected[0]) and after[1] == expected[1] and np.array_equal(after[2], expected[2])
    assert loom_mesh.current_mesh() is None  # auto_accelerate inside the trials set it
    assert len(live_groups()) == groups


def test_time_budget_stops_measuring(group):
    def slow_loss(batch, out):
        time.sleep(0.3)
        return out.loss

    t = time.perf_counter()
    got = trials([cand(), cand()], loss_func=slow_loss, steps=50, warmup=1, time_budget_s=1.0)
    wall = time.perf_counter() - t
    for r in got:
        assert r.status == "timeout" and "time budget of 1 s" in r.error, r
        assert 1 <= len(r.step_times) < 50 and r.step_time_s >= 0.3, r
    # 50 steps of >= 0.3 s would take 15 s per trial; the budget ends each within a few steps
    assert wall < 2 * 15, wall


def test_total_time_skips_later_candidates(group):
    def slow_loss(batch, out):
        time.sleep(0.3)
        return out.loss

    # two steps sleep 0.6 s: the first trial's budget, capped by the 0.5 s total, ends it; the others never start
    got = trials([cand(), cand(), cand()], loss_func=slow_loss, steps=2, warmup=0, total_time_s=0.5)
    assert [r.status for r in got] == ["timeout", "skipped", "skipped"], got
    assert len(got[0].step_times) < 2 and "total time limit of 0.5 s" in got[1].error


def test_sample_batch_without_dataset(group):
    x = token_batches(3)
    got = trials([cand(mb=4)], dataset=None, sample_batch={"input_ids": x, "labels": x})
    assert got[0].ok, got[0]


def test_bad_arguments(group):
    with pytest.raises(ValueError, match="steps >= 1"):
        trials([cand()], steps=0)
    with pytest.raises(ValueError, match="dataset or a sample_batch"):
        trials([cand()], dataset=None)


def test_no_process_group():
    with pytest.raises(RuntimeError, match="initialised process group"):
        trials([cand()])


def test_resize_batch():
    b = {"x": torch.arange(6).reshape(3, 2), "y": (torch.arange(3), "tag")}
    out = resize_batch(b, 5)
    assert out["x"].shape == (5, 2) and out["x"][3:].tolist() == [[0, 1], [2, 3]]
    assert out["y"][0].tolist() == [0, 1, 2, 0, 1] and out["y"][1] == "tag"
    assert resize_batch(b, 2)["x"].tolist() == [[0, 1], [2, 3]]


def test_loader_args_batch_split():
    c = cand(mb=2, accum=4, dp_shard=2)
    assert _loader_args(c, {"batch_size": 99, "shuffle": True}) == {"shuffle": True, "batch_size": 16,
                                                                     "micro_batch_size": 2}
    # pipeline: one train_step call runs the schedule's micro-batches, the loader yields them together
    p = cand([("pipeline_parallel", {"schedule": "1f1b"})], mb=2, accum=4, pp=2)
    assert _loader_args(p, None) == {"batch_size": 8, "micro_batch_size": 8}


def test_trial_result_round_trip():
    r = TrialResult(cand(), "timeout", 0.5, [0.4, 0.5, 0.6], 1e6, [1e6], {"params": 10}, "memtracker", "",
                    "time budget spent", 2.0, 3)
    assert TrialResult.from_dict(r.to_dict()) == r


# ------------------------------------------------------------- model_factory must build the same model (F2)
def _factory_runner(model, factory):
    from torchloom.search.auto import _runner
    from torchloom.search.options import SearchOptions

    return _runner(model, SearchOptions.parse({"model_factory": factory}), {"optim_func": torch.optim.SGD}, {}, None)


def test_model_factory_building_another_model_is_refused_before_the_trials():
    from torchloom.errors import StrategyError

    model = tiny_llama(layers=4)
    with pytest.raises(StrategyError, match=r"different model.*no parameter model\.layers\.2\."):
        _factory_runner(model, lambda: tiny_llama(layers=2))  # fewer layers
    with pytest.raises(StrategyError, match=r"different model.*shape \(128, 64\) in the factory's model, "
                                            r"\(256, 64\) in the model"):
        _factory_runner(tiny_llama(vocab=256), lambda: tiny_llama(vocab=128))  # other shapes
    with pytest.raises(StrategyError, match=r"dtype torch\.bfloat16 in the factory's model"):
        _factory_runner(model, lambda: tiny_llama(layers=4).to(torch.bfloat16))


def test_model_factory_building_the_same_model_is_accepted_and_built_on_meta():
    devices = []

    def factory():
        m = tiny_llama(layers=4)
        devices.append(next(m.parameters()).device.type)
        return m

    assert callable(_factory_runner(tiny_llama(layers=4), factory))
    assert devices == ["meta"]  # the check is cheap: no storage allocated
