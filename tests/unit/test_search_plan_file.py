"""Plan files and the plan cache: a search result saved as a strategy file with a ``plan`` section, reused
by ``auto_accelerate(strategy=file)`` without searching, refused (each difference named) when made for
another model, world size, batch or machine, or searched again on request; ``strategy="auto"`` reusing the
cached plan. One process (the world size is 1); calibration is replaced by hand-built hardware."""
import json

import pytest
import torch

import torchloom
from tests.models import tiny_llama, token_batches
from tests.unit.test_search_space import toy_hw, toy_info
from torchloom.errors import StrategyError
from torchloom.parallel.mesh import ParallelDims
from torchloom.cost import calibrate
from torchloom.search.auto import machine_fingerprint, model_signature
from torchloom.search.candidate import Candidate
from torchloom.search.plan_file import Plan, read_plan, refusal, save_plan
from torchloom.search.result import SearchResult
from torchloom.search.search import search
from torchloom.strategy.strategy import Strategy

SEQ = 16


def _data(n=16):
    ids = token_batches(n, seq=SEQ)
    return [{"input_ids": r, "labels": r} for r in ids]


def _accelerate(model, strategy, search=None, batch=4):
    return torchloom.auto_accelerate(model, torch.optim.SGD, _data(), None, strategy=strategy,
                                     optim_args={"lr": 0.1}, dataloader_args={"batch_size": batch},
                                     model_input_format="unpack_dict", search=search)


def _cpu_hw():
    hw = toy_hw(memory=8e9, ranks=1, device="cpu")
    hw.fingerprint = machine_fingerprint()
    return hw


@pytest.fixture
def no_calibration(monkeypatch, tmp_path):
    """Hand-built hardware instead of calibrating; the plan cache in a fresh directory."""
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "job_hardware", lambda *a, **k: _cpu_hw())
    return tmp_path / "cache" / "plans"


def _one_rank_plan(tmp_path, net, **over):
    cand = Candidate(ParallelDims(), (("checkpoint", {"every_k": 2}),), 2, 2, SEQ)
    result = SearchResult(chosen=cand, chosen_by="measured", world_size=1, global_batch=4, seq_len=SEQ)
    path = save_plan(tmp_path / "plan.json", result, model={"signature": model_signature(net), "name": "llama"},
                     machine=machine_fingerprint())
    if over:
        data = json.loads(path.read_text())
        for k, v in over.items():
            data["plan"][k] = v if not isinstance(v, dict) else {**data["plan"][k], **v}
        path.write_text(json.dumps(data))
    return path


def test_plan_file_round_trip_is_a_normal_strategy_file(tmp_path):
    info, hw = toy_info(), toy_hw(ranks=2)
    result = search(info=info, world_size=2, global_batch=4, hw=hw, options={"top_k": 0})
    path = save_plan(tmp_path / "p.json", result, model={"signature": "abc", "name": "toy"},
                     machine={"cpu": "x", "cores": 2}, options={"top_k": 0})
    assert Strategy.load(path) == result.chosen.strategy()  # what auto_accelerate(strategy=path) applies
    strategy, plan = read_plan(path)
    assert strategy == result.chosen.strategy() and isinstance(plan, Plan)
    assert plan.candidate == result.chosen and (plan.world_size, plan.global_batch, plan.seq_len) == (2, 4, SEQ)
    saved = plan.result
    assert saved.chosen == result.chosen and [e.candidate for e in saved.ranked] == \
        [e.candidate for e in result.ranked[:50]]
    assert saved.ranked[0].prediction.step_time_s == result.ranked[0].prediction.step_time_s
    c = result.chosen
    per_call = c.micro_batch * (c.grad_accum if c.dims.pp > 1 else 1)
    assert plan.dataloader_args() == {"batch_size": 4, "micro_batch_size": per_call}
    with pytest.raises(StrategyError, match="use a .json name"):
        save_plan(tmp_path / "p.yaml", result, model={}, machine={})


def test_differences_are_each_named():
    plan = Plan(Candidate(ParallelDims(dp_shard=2), (("fsdp", {}),), 1, 1, SEQ), {"signature": "aaa", "name": "m"},
                2, 8, SEQ, {"cpu": "Xeon", "cores": 2, "torch": "2.13"})
    assert plan.differences(model="aaa", world_size=2, global_batch=8, machine=dict(plan.machine)) == []
    diffs = plan.differences(model="bbb", world_size=4, global_batch=16, machine={"cpu": "EPYC", "cores": 2,
                                                                                 "torch": "2.13"})
    msg = str(refusal("p.json", diffs))
    assert "model: the plan is for m with signature aaa, this model's is bbb" in msg
    assert "world size: the plan is for 2 ranks, this job has 4" in msg
    assert "global batch: the plan is for 8 samples per step, this job uses 16" in msg
    assert "machine: cpu 'Xeon' vs 'EPYC' (plan vs here)" in msg
    assert "on_mismatch" in msg and "strategy='auto'" in msg


def test_auto_accelerate_reuses_a_plan_file_without_searching(tmp_path, monkeypatch):
    model = tiny_llama()
    path = _one_rank_plan(tmp_path, model)

    def no_search(*a, **k):
        raise AssertionError("searched although the plan matches")

    monkeypatch.setattr("torchloom.search.search.search", no_search)
    monkeypatch.setattr(calibrate, "job_hardware", no_search)
    res = _accelerate(model, str(path))
    assert (res.micro_batch_size, res.grad_accum_steps, res.global_batch_size) == (2, 2, 4)
    assert "checkpoint" in res.strategy and res.search.chosen_by == "plan"
    assert any("no new search" in n for n in res.notes)
    loss0 = res.train_step(next(iter(res.dataloader)))
    assert torch.isfinite(loss0)
    with pytest.raises(StrategyError, match="model: the plan is for llama with signature"):
        _accelerate(tiny_llama(layers=3), str(path))  # another architecture


@pytest.mark.parametrize("over,named", [
    ({"world_size": 2}, "world size: the plan is for 2 ranks, this job has 1"),
    ({"global_batch": 8}, "global batch: the plan is for 8 samples per step, this job uses 4"),
    ({"machine": {"cpu": "another CPU"}}, "machine: cpu 'another CPU' vs"),
    ({"model": {"signature": "0123456789abcdef"}}, "model: the plan is for llama with signature 0123456789abcdef"),
])
def test_a_plan_for_another_setup_is_refused_with_the_difference(tmp_path, over, named):
    model = tiny_llama()
    path = _one_rank_plan(tmp_path, model, **over)
    with pytest.raises(StrategyError, match="was made for another setup") as e:
        _accelerate(model, str(path))
    assert named in str(e.value)


def test_a_mismatching_plan_is_searched_again_when_asked(tmp_path, no_calibration):
    model = tiny_llama()
    path = _one_rank_plan(tmp_path, model, world_size=2)
    res = _accelerate(model, str(path), search={"on_mismatch": "research", "top_k": 0})
    assert res.search.chosen_by == "predicted" and res.search.world_size == 1
    assert "searching again" in res.notes[0] and "world size" in res.notes[0]


def test_auto_reuses_the_cached_plan_for_the_same_model_batch_and_machine(no_calibration):
    first = _accelerate(tiny_llama(), "auto", search={"top_k": 0})
    assert first.search.chosen_by == "predicted" and len(list(no_calibration.glob("*.json"))) == 1
    again = _accelerate(tiny_llama(), "auto", search={"top_k": 0})
    assert again.search.chosen_by == "cache" and again.strategy == first.strategy
    assert (again.micro_batch_size, again.grad_accum_steps) == (first.micro_batch_size, first.grad_accum_steps)
    other_batch = _accelerate(tiny_llama(), "auto", search={"top_k": 0}, batch=8)
    assert other_batch.search.chosen_by == "predicted"
    other_options = _accelerate(tiny_llama(), "auto", search={"top_k": 0, "exclude": ["amp"]})
    assert other_options.search.chosen_by == "predicted"
    fresh = _accelerate(tiny_llama(), "auto", search={"top_k": 0, "cache": False})
    assert fresh.search.chosen_by == "predicted"
    assert len(list(no_calibration.glob("*.json"))) == 3  # cache=False neither reads nor writes


def test_auto_where_it_makes_no_sense_is_a_clear_error(tmp_path):
    with pytest.raises(StrategyError, match="pass it to auto_accelerate"):
        Strategy.parse("auto")
    with pytest.raises(StrategyError, match="'auto' is not a method.*stands alone"):
        Strategy(["fsdp", "auto"])
    with pytest.raises(StrategyError, match="search=... options are read only with strategy='auto'"):
        _accelerate(tiny_llama(), ["ddp"], search={"top_k": 1})
    with pytest.raises(StrategyError, match="unknown search option"):
        _accelerate(tiny_llama(), "auto", search={"topk": 1})


# ------------------------------------------- `loom train`: a saved plan for another --nproc (F5)
@pytest.fixture
def one_rank_group(monkeypatch):
    import torch.distributed as dist

    from torchloom.testing.dist import free_port

    if dist.is_initialized():  # an earlier auto_accelerate call left its group
        yield
        return
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _job_with_saved_plan(tmp_path, overrides=(), plan_world=4):
    """A `loom train` Job of 2 ranks whose output dir holds a strategy.json searched on ``plan_world`` ranks."""
    from torchloom.train.config import TrainConfig
    from torchloom.train.job import SEARCHED_STRATEGY, Job

    cfg = TrainConfig.load("default", ["strategy=auto", *overrides], str(tmp_path / "run"))
    job = Job.__new__(Job)
    job.cfg, job.rank, job.world, job.lines = cfg, 0, 2, []
    job.out, job.ckpt_root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    job.log = job.lines.append
    cand = Candidate(ParallelDims(dp_shard=plan_world), (("fsdp", {}),), 1, cfg.train.global_batch // plan_world, SEQ)
    result = SearchResult(chosen=cand, chosen_by="measured", world_size=plan_world,
                          global_batch=cfg.train.global_batch, seq_len=SEQ)
    save_plan(job.out / SEARCHED_STRATEGY, result, model={"signature": "sig", "name": "llama"},
              machine=machine_fingerprint())
    return job


def test_saved_plan_for_another_nproc_is_a_config_error_with_safe_advice(tmp_path, one_rank_group, monkeypatch):
    from torchloom import checkpoint
    from torchloom.train.config import ConfigError

    job = _job_with_saved_plan(tmp_path)
    with pytest.raises(ConfigError) as e:  # main() prints ConfigError as one "[loom] error:" line, exit 2
        job.plan_strategy(job.cfg, lambda: None, signature="sig")
    msg = str(e.value)
    assert "world size: the plan is for 4 ranks, this job has 2" in msg and "same --nproc" in msg, msg
    assert "--output-dir" in msg and "on_mismatch=research" in msg and "reshard" not in msg
    monkeypatch.setattr(checkpoint, "latest_complete", lambda root: root / "step_00000010")
    with pytest.raises(ConfigError) as e:  # with checkpoints: no "delete strategy.json"; research reshards
        job.plan_strategy(job.cfg, lambda: None, signature="sig")
    msg = str(e.value)
    assert "same --nproc" in msg and "delete" not in msg and "docs/reshard.md" in msg and "on_mismatch" in msg, msg


def test_saved_plan_for_another_nproc_searches_again_on_request(tmp_path, one_rank_group):
    job = _job_with_saved_plan(tmp_path, ["search.on_mismatch=research"])
    strategy, search = job.plan_strategy(job.cfg, lambda: None, signature="sig")
    logging_handler = job._search_log
    import logging
    logging.getLogger("torchloom.search").removeHandler(logging_handler)
    assert strategy == "auto" and search["on_mismatch"] == "research" and callable(search["model_factory"])
    assert any("does not match this run" in line for line in job.lines), job.lines
