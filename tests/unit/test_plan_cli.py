"""``loom plan`` in-process (click's CliRunner): the ranked table for Llama-3-70B on 1,024 H100, ``--explain``,
the ``--json`` schema, ``--strategy`` evaluation, ``--local``, and the bad inputs (unknown model, missing or
inconsistent cluster fields, a model that fits nothing). Nothing is launched and no model is allocated."""
from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from torchloom.cli import main
from torchloom.cost.cluster import ClusterError, cluster_spec

CLUSTER_70B = ["--gpu", "h100", "--gpus", "1024", "--gpus-per-node", "8"]


def _plan(*args):
    return CliRunner().invoke(main, ["plan", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def plan_70b_json():
    r = _plan("llama3-70b", *CLUSTER_70B, "--json", "--top", "5", "--explain", "2")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_70b_on_1024_h100_json_schema(plan_70b_json):
    d = plan_70b_json
    assert d["schema"] == 1 and d["mode"] == "search"
    assert d["model"]["name"] == "llama3-70b" and d["model"]["n_params"] == 70_553_706_496
    assert d["cluster"]["hardware"] == "h100-sxm" and d["cluster"]["gpus"] == 1024
    assert d["seq_len"] == 8192 and d["global_batch"] == 1024  # defaults: the preset's, one sample per device
    assert d["evaluated"] >= len(d["candidates"]) == 5
    tps = [c["prediction"]["tokens_per_s"] for c in d["candidates"]]
    assert tps == sorted(tps, reverse=True)  # ranked by predicted throughput
    for c in d["candidates"]:
        p = c["prediction"]
        world = math.prod(c["candidate"]["dims"].values())
        assert world == 1024
        assert math.isclose(sum(p["time"].values()), p["step_time_s"], rel_tol=1e-6)
        assert math.isclose(sum(p["memory"].values()), p["peak_memory_bytes"], rel_tol=1e-6)
        assert p["peak_memory_bytes"] <= p["memory_limit_bytes"]  # only fitting candidates are ranked
        assert math.isclose(p["tokens_per_s_per_device"] * 1024, p["tokens_per_s"], rel_tol=1e-6)
        assert p["peak_flops"] == d["cluster"]["peak_flops"][_dtype(c)] and 0 < p["mfu"] < 1
        assert c["strategy"]["methods"][0]["name"] == "parallel_mode"
    assert d["explain"]["rank"] == 2 and d["explain"]["label"] == d["candidates"][1]["label"]


def _dtype(c):
    names = [n for n, _ in c["candidate"]["methods"]]
    amp = next((cfg for n, cfg in c["candidate"]["methods"] if n == "amp"), None)
    if amp is None:
        return "bfloat16" if "float8" in names else "float32"  # float8 implies bf16 amp (the MFU's peak)
    return amp.get("dtype", "bfloat16")


def test_70b_table_and_explain():
    # pinned degrees keep this second 70B search small (the full space is searched by the JSON test above)
    r = _plan("llama3-70b", *CLUSTER_70B, "--top", "3", "--explain", "1", "--fix", "tp=8", "--fix", "pp=1")
    assert r.exit_code == 0, r.output
    out = r.stdout
    assert out.count(" tp8 ") >= 3 and "pp" not in out.split("---")[-1].split("candidate #1")[0]
    assert "1024 x h100-sxm (128 nodes of 8)" in out and "70.55 B parameters" in out
    assert "tok/s/dev" in out and "peak TF/s" in out and "MFU" in out
    rows = [ln for ln in out.splitlines() if ln[:3].strip() in ("1", "2", "3") and "|" in ln]
    assert len(rows) == 3
    for part in ("candidate #1:", "time (s)", "= step", "memory per device (GiB)", "= peak", "strategy"):
        assert part in out


def test_strategy_is_evaluated_not_searched():
    from torchloom.search.candidate import Candidate
    from torchloom.cost.cluster import cluster_hardware
    from torchloom.search.pricing import predict
    from torchloom.cost.presets import resolve_model

    r = _plan("llama3-70b", *CLUSTER_70B, "--global-batch", "256", "--json",
              "--strategy", "[{parallel_mode: {tp: 8}}, tensor_parallel, fsdp, {amp: {dtype: bfloat16}}, checkpoint]")
    assert r.exit_code == 0, r.output
    d = json.loads(r.stdout)
    assert d["mode"] == "strategy" and d["evaluated"] == 1 and len(d["candidates"]) == 1
    c = d["candidates"][0]
    assert c["candidate"]["dims"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 128, "ep": 1, "tp": 8, "cp": 1}
    assert c["candidate"]["micro_batch"] == 2 and c["candidate"]["grad_accum"] == 1  # 256 / dp 128
    assert [n for n, _ in c["candidate"]["methods"]] == ["tensor_parallel", "fsdp", "amp", "checkpoint"]
    # the same numbers as the cost model gives that candidate directly
    cand = Candidate.from_dict(c["candidate"])
    want = predict(cand, resolve_model("llama3-70b").analyze(8192, attention="flash"),
                   cluster_hardware(cluster_spec(gpu="h100", gpus=1024, gpus_per_node=8)))
    assert math.isclose(c["prediction"]["step_time_s"], want.step_time_s, rel_tol=1e-9)


def test_strategy_adds_data_parallel_as_auto_accelerate_does():
    r = _plan("default", "--gpu", "a100", "--gpus", "4", "--global-batch", "16", "--json", "--strategy", "amp")
    assert r.exit_code == 0, r.output
    c = json.loads(r.stdout)["candidates"][0]["candidate"]
    assert c["dims"]["dp_replicate"] == 4 and [n for n, _ in c["methods"]] == ["amp", "ddp"]


def test_local_plans_with_the_calibration(monkeypatch):
    from torchloom.cost import calibrate
    from torchloom.cost.hardware import COLLECTIVES, CollectiveFit, Hardware

    seen = []

    def fake_local(ranks_per_node=1, **kw):
        seen.append(ranks_per_node)
        fits = {k: {g: CollectiveFit([(4e3, 1e-4), (64e6, 0.1)]) for g in (2,)} for k in COLLECTIVES}
        return Hardware("local-cpu", "cpu", 8 * 2**30, ranks_per_node=ranks_per_node,
                        matmul_flops={"float32": [(1e5, 5e9), (1e9, 2e10)], "bfloat16": [(1e5, 2e9), (1e9, 8e9)]},
                        peak_flops={"float32": 2.5e10, "bfloat16": 1e10}, mem_bw=5e9, op_overhead_s=1e-5,
                        intra=fits)

    monkeypatch.setattr(calibrate, "local_hardware", fake_local)
    r = _plan("default", "--local", "--nproc", "2", "--global-batch", "16", "--top", "2")
    assert r.exit_code == 0, r.output
    assert seen == [2] and "this machine, 2 processes (calibrated)" in r.stdout and "seq 128" in r.stdout


# --------------------------------------------------------------------------------------------- bad input
def test_unknown_model_lists_the_known_ones():
    r = _plan("llama-3-70b", *CLUSTER_70B)
    assert r.exit_code == 2
    for name in ("llama3-8b", "llama3-70b", "llama3.1-405b", "mixtral-8x7b", "default"):
        assert name in r.stderr
    assert "Did you mean 'llama3-70b'" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--gpus", "8"], "missing --gpu "),
    (["--gpu", "h100"], "missing --gpus "),
    (["--gpu", "h100", "--gpus", "1024"], "missing --gpus-per-node"),
    (["--gpu", "h100", "--gpus", "1020", "--gpus-per-node", "8"], "--gpus 1020 is not divisible by --gpus-per-node 8"),
    (["--gpu", "h1000", "--gpus", "8"], "unknown GPU 'h1000'"),
    (["--local", "--gpu", "h100"], "drop --gpu"),
    (["--nproc", "2"], "--nproc is the process count of --local"),
    ([], "no cluster given"),
])
def test_cluster_fields_named(args, message):
    r = _plan("llama3-8b", *args)
    assert r.exit_code == 2 and message in r.stderr, r.stderr


def test_cluster_spec_fills_one_node():
    s = cluster_spec(gpu="H100", gpus=4)
    assert (s.gpu, s.gpus, s.gpus_per_node, s.nodes) == ("h100-sxm", 4, 4, 1)
    with pytest.raises(ClusterError, match="--gpus must be >= 1"):
        cluster_spec(gpu="h100", gpus=0)


def test_explain_out_of_range_is_named():
    r = _plan("default", "--gpu", "a100", "--gpus", "2", "--strategy", "ddp", "--explain", "3")
    assert r.exit_code == 2 and "--explain 3: there is 1 ranked candidate(s); give 1..1" in r.stderr


def test_bad_strategy_is_named():
    r = _plan("default", "--gpu", "a100", "--gpus", "2", "--strategy", "fsdp,nosuchmethod")
    assert r.exit_code == 2 and "nosuchmethod" in r.stderr
    r = _plan("default", "--gpu", "a100", "--gpus", "4", "--global-batch", "6", "--strategy", "ddp")
    assert r.exit_code == 2 and "global batch 6 does not split over 4 data-parallel ranks" in r.stderr
    r = _plan("default", "--gpu", "a100", "--gpus", "4", "--strategy", "[{parallel_mode: {tp: 2}}, ddp]")
    assert r.exit_code == 2 and "'tp' dimension" in r.stderr  # the error auto_accelerate would give


def test_model_that_fits_nothing_says_by_how_much_and_what_would_fit():
    r = _plan("llama3.1-405b", "--gpu", "h100", "--gpus", "8", "--exclude", "cpu_offload")
    assert r.exit_code == 1, r.output
    err = r.stderr
    assert "fits no candidate on 8 ranks" in err and "76.00 GiB usable per rank" in err
    assert "GiB per rank on the best mesh" in err  # how much even the smallest needs
    for fix in ("more devices", "CPU offload", "a smaller micro-batch"):
        assert fix in err


_NET = '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.l1, self.l2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.l2(torch.relu(self.l1(x)))


class Net(nn.Module):
    def __init__(self, d=64, n=4):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d) for _ in range(n)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).mean()


def build():
    return Net()


def sample():
    return torch.randn(1, 128, 64)


def sample_pair():
    return (torch.randn(1, 128, 64),)


class TwoArgs(Net):
    def forward(self, x, scale):
        return super().forward(x) * scale


def build_two():
    return TwoArgs()


def sample_two():
    return (torch.randn(1, 128, 64), 2.0)
'''


@pytest.fixture
def plain_pkg(tmp_path, monkeypatch):
    """A plain (non-Hugging Face) model in a package of the current directory, not on sys.path (as a user
    runs ``loom plan pkg.models:build`` from their project)."""
    import sys

    pkg = tmp_path / "plainpkg_f3"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(_NET)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    for m in [m for m in sys.modules if m.startswith("plainpkg_f3")]:
        monkeypatch.delitem(sys.modules, m)
    return pkg


_GPUS = ["--gpu", "h200", "--gpus", "16", "--gpus-per-node", "8", "--seq-len", "128"]


def test_plain_model_without_a_sample_is_a_named_error(plain_pkg):
    """F3: the factory's module is found from the current directory (as ``python -m`` does), and a model
    that is not a Hugging Face LM without ``--sample`` is exit 2 with an ``error:`` line naming the fix, not
    a traceback."""
    r = CliRunner().invoke(main, ["plan", "plainpkg_f3.models:build", *_GPUS])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert "error:" in r.output and "--sample" in r.output and "Traceback" not in r.output


def test_plain_model_plans_with_a_sample(plain_pkg):
    """F3: ``--sample pkg.module:fn`` gives one micro-batch-1 batch (built on the meta device), and
    ``--input-format`` says how it is passed, as ``auto_accelerate``'s ``input_format``."""
    r = _plan("plainpkg_f3.models:build", *_GPUS, "--sample", "plainpkg_f3.models:sample", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    # 4 blocks of 2 x (64x256 + 256) + 256 + 64 ... plus the head: the module's own parameter count
    assert d["model"]["n_params"] == 4 * (64 * 256 + 256 + 256 * 64 + 64) + 64 * 10 + 10
    assert d["candidates"] and d["seq_len"] == 128
    r = _plan("plainpkg_f3.models:build_two", *_GPUS, "--sample", "plainpkg_f3.models:sample_two",
              "--input-format", "unpack_sequence", "--top", "1")
    assert r.exit_code == 0, r.output


def test_bad_sample_options_are_named(plain_pkg):
    r = CliRunner().invoke(main, ["plan", "plainpkg_f3.models:build", *_GPUS, "--sample", "plainpkg_f3.models:nope"])
    assert r.exit_code == 2 and "error:" in r.output and "nope" in r.output, r.output
    r = CliRunner().invoke(main, ["plan", "llama3-8b", "--gpu", "h100", "--gpus", "8", "--sample",
                                  "plainpkg_f3.models:sample"])
    assert r.exit_code == 2 and "--sample" in r.output, r.output
    r = CliRunner().invoke(main, ["plan", "plainpkg_f3.models:build_two", *_GPUS, "--sample",
                                  "plainpkg_f3.models:sample_two"])  # forward(x, scale) called as model(batch)
    assert r.exit_code == 2 and "error:" in r.output and "--input-format" in r.output, r.output
