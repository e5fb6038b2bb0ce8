"""Hardware calibration (fingerprint, cache, real measurement on 2 gloo ranks) and the accelerator table."""
from __future__ import annotations

import json
import math
import os

import pytest

from torchloom.errors import HardwareError
from torchloom.cost import accelerators as acc
from torchloom.cost import calibrate
from torchloom.cost.hardware import COLLECTIVES, CollectiveFit, Hardware
from torchloom.testing.dist import run_ranks

KiB, MiB = 1 << 10, 1 << 20


# ------------------------------------------------------------------------------------------ fingerprint
def test_fingerprint_is_stable_and_names_the_machine():
    a, b = calibrate.fingerprint(), calibrate.fingerprint()
    assert a == b
    assert calibrate.fingerprint_hash(a) == calibrate.fingerprint_hash(b)
    assert len(calibrate.fingerprint_hash(a)) == 12
    assert {"cpu", "cores", "ram_gib", "gpu", "gpu_count", "torch", "backend"} <= set(a)
    assert a["cores"] == len(os.sched_getaffinity(0)) and a["backend"] == "gloo"
    assert calibrate.fingerprint_hash(calibrate.fingerprint("nccl")) != calibrate.fingerprint_hash(a)


def test_threads_per_rank_follows_omp_or_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert calibrate.threads_per_rank(4) == 3
    monkeypatch.delenv("OMP_NUM_THREADS")
    cores = len(os.sched_getaffinity(0))
    assert calibrate.threads_per_rank(1) == cores
    assert calibrate.threads_per_rank(4 * cores) == 1  # never 0


# ------------------------------------------------------------------------------------------------ cache
PROBE = 1e9  # the re-check probe's FLOP/s recorded in _fake_hw (and returned by `counted`'s probe)
QUIET = {"method": "/proc/stat", "cores": 2, "ranks": 1, "threads_per_rank": 1, "cores_used": 1,
         "other_busy_cores": 0.0, "stolen_fraction": 0.0, "threshold": 0.2, "under_load": False,
         "loadavg_1m": 0.1, "wall_s": 1.0, "probe_flops": PROBE, "probe_workers": 1,
         "probe_version": calibrate.PROBE_VERSION}


def _fake_hw(ranks: int, fp=None, threads=None, load=None) -> Hardware:
    load = dict(QUIET if load is None else load)
    return Hardware(name="local-cpu", device_type="cpu", memory_bytes=1e9, ranks_per_node=ranks,
                    matmul_flops={"float32": [(1e6, 1e9), (1e9, 2e9)]}, peak_flops={"float32": 2e9},
                    mem_bw=1e9, op_overhead_s=1e-6,
                    intra={k: {ranks: CollectiveFit([(4096.0, 1e-4), (1e6, 1e-3)])} for k in COLLECTIVES},
                    fingerprint=fp or calibrate.fingerprint(),
                    threads_per_rank=threads or calibrate.threads_per_rank(ranks),
                    load=load, provisional=bool(load.get("under_load")))


@pytest.fixture
def counted(monkeypatch):
    """Replace the spawning measurement by a counter returning a hand-built Hardware, and the load measured
    before a cache is used by the quiet record with the probe rate it recorded (the machine unchanged)."""
    calls = []
    monkeypatch.setattr(calibrate, "measure_now", lambda device, threads, ranks: dict(QUIET))

    def fake(ranks, budget_s=0, **kw):
        calls.append(ranks)
        return _fake_hw(ranks)

    monkeypatch.setattr(calibrate, "measure_standalone", fake)
    return calls


def test_cache_written_then_reused_without_measuring(tmp_path, counted):
    hw1 = calibrate.local_hardware(2, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 2, 1, tmp_path)
    assert counted == [2] and path.exists()
    assert path.name == f"{calibrate.fingerprint_hash({**calibrate.fingerprint(), **calibrate.CALIBRATION_METHOD})}-w2.json"
    hw2 = calibrate.local_hardware(2, cache_dir=tmp_path)
    assert counted == [2], "the second call measured again instead of reading the cache"
    assert hw2.to_dict() == hw1.to_dict()
    calibrate.local_hardware(2, cache_dir=tmp_path, refresh=True)
    assert counted == [2, 2]
    calibrate.local_hardware(1, cache_dir=tmp_path)  # another ranks-per-node level: its own file
    assert counted == [2, 2, 1]


def test_cache_dir_from_environment(tmp_path, monkeypatch, counted):
    monkeypatch.setenv("TORCHLOOM_CACHE_DIR", str(tmp_path))
    calibrate.local_hardware(1)
    assert list((tmp_path / "hardware").glob("*-w1.json"))


def test_other_fingerprint_cache_is_refused(tmp_path, counted):
    fp = calibrate.fingerprint()
    path = calibrate.cache_path(fp, 2, 1, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    other = _fake_hw(2, fp={**fp, "torch": "1.0.0"})
    path.write_text(json.dumps(other.to_dict()))
    with pytest.warns(UserWarning, match=r"another setup .*torch: '1\.0\.0' there"):
        hw = calibrate.local_hardware(2, cache_dir=tmp_path)
    assert counted == [2] and hw.fingerprint == fp
    assert Hardware.from_dict(json.loads(path.read_text())).fingerprint == fp  # replaced by the new measurement


def test_other_thread_count_and_unreadable_cache_are_refused(tmp_path, counted):
    path = calibrate.cache_path(calibrate.fingerprint(), 2, 1, tmp_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_fake_hw(2, threads=calibrate.threads_per_rank(2) + 5).to_dict()))
    with pytest.warns(UserWarning, match="threads_per_rank"):
        calibrate.local_hardware(2, cache_dir=tmp_path)
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"):
        calibrate.local_hardware(2, cache_dir=tmp_path)
    assert counted == [2, 2]


# --------------------------------------------------------------------------------------- Hardware itself
def test_collective_fit_interpolates_and_extrapolates():
    fit = CollectiveFit([(1000.0, 1.0), (2000.0, 3.0), (4000.0, 4.0)])
    assert fit.time(500) == 1.0  # latency floor below the smallest point
    assert fit.time(1500) == pytest.approx(2.0)  # linear in bytes between points
    assert fit.time(3000) == pytest.approx(3.5)
    assert fit.time(8000) == pytest.approx(6.0)  # last segment's bandwidth (1 s per 2000 B) beyond the largest
    assert fit.time(0) == 0.0 and CollectiveFit().time(100) == 0.0


def test_hardware_round_trips_through_json():
    hw = acc.cluster("h100", 16, 8)
    back = Hardware.from_dict(json.loads(json.dumps(hw.to_dict())))
    assert back == hw
    assert back.collective_time("all_gather", 1e8, 4) == hw.collective_time("all_gather", 1e8, 4)
    local = _fake_hw(2)
    assert Hardware.from_dict(json.loads(json.dumps(local.to_dict()))) == local


# ------------------------------------------------------------------------------------- accelerator table
DATASHEET_BF16 = {"a100-40gb": 312e12, "a100-80gb": 312e12, "h100-sxm": 989.4e12, "h100-pcie": 756.5e12,
                  "h200": 989.4e12, "b200": 2250e12, "mi300x": 1307.4e12}  # dense, from each datasheet


def test_accelerator_table_is_complete_with_sources():
    assert set(acc.ACCELERATORS) == set(DATASHEET_BF16)
    for name, a in acc.ACCELERATORS.items():
        assert a.peak_flops["bfloat16"] == pytest.approx(DATASHEET_BF16[name]), name
        assert a.peak_flops["bfloat16"] == a.peak_flops["float16"]
        assert a.peak_flops["bfloat16"] > a.peak_flops["tf32"] > a.peak_flops["float32"] > 0, name
        assert a.memory_bytes >= 40 * 2 ** 30 and a.mem_bw >= 1.5e12 and a.link_bw > 0 and a.inter_bw > 0
        for f in ("peak_flops", "memory_bytes", "mem_bw", "link", "link_bw", "inter_bw"):
            assert a.sources.get(f, "").startswith("https://"), (name, f)
        a.check()
    assert acc.ACCELERATORS["h200"].memory_bytes == 141 * 2 ** 30
    assert acc.ACCELERATORS["h100-sxm"].inter_bw == 50e9  # 400 Gb/s NDR per GPU


def test_lookup_aliases_and_device_names():
    assert acc.lookup("H100").name == "h100-sxm" and acc.lookup("a100_40gb").name == "a100-40gb"
    assert acc.match_device_name("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert acc.match_device_name("NVIDIA H100 PCIe").name == "h100-pcie"
    assert acc.match_device_name("NVIDIA H200").name == "h200"
    assert acc.match_device_name("NVIDIA A100-SXM4-40GB").name == "a100-40gb"
    assert acc.match_device_name("Tesla T4") is None


def test_cluster_hardware_models_the_nodes():
    hw = acc.cluster("h100", 1024, 8)
    assert (hw.ranks_per_node, hw.num_nodes, hw.world_size) == (8, 128, 1024)
    assert hw.peak_flops["bfloat16"] == 989.4e12
    big, small = hw.matmul_rate("bfloat16", 2 * 8192 ** 3), hw.matmul_rate("bfloat16", 2 * 512 ** 3)
    assert 0.7 * 989.4e12 < big < 989.4e12 and small < 0.5 * big
    assert set(hw.intra["all_reduce"]) == {2, 4, 8}
    # ring all-reduce of 1 GB over 8 GPUs: 2*7/8 GB at 0.8 x 450 GB/s = 4.86 ms (+10 us)
    assert hw.collective_time("all_reduce", 1e9, 8) == pytest.approx(1.75e9 / 360e9 + 10e-6, rel=1e-6)
    assert hw.collective_time("all_reduce", 1e9, 8, spans_nodes=True) > hw.collective_time("all_reduce", 1e9, 8)
    mi = acc.cluster("mi300x", 8)
    # xGMI mesh: a pair shares one 64 GB/s link, eight GPUs use seven
    assert mi.collective_time("all_gather", 1e9, 2) > 3 * mi.collective_time("all_gather", 1e9, 8)
    assert acc.cluster("a100", 4).ranks_per_node == 4  # fewer GPUs than a node: one node of 4


def test_cluster_errors_name_the_problem():
    with pytest.raises(HardwareError, match=r"unknown GPU 'h10'.*Did you mean 'h100'.*Known: a100-40gb"):
        acc.cluster("h10", 8, 8)
    with pytest.raises(HardwareError, match="1000 GPUs do not fill nodes of 24.*multiple of gpus_per_node"):
        acc.cluster("h100", 1000, 24)
    with pytest.raises(HardwareError, match="missing 'gpus'"):
        acc.cluster("h100", None, 8)
    with pytest.raises(HardwareError, match="missing 'gpu'"):
        acc.cluster(None, 8, 8)
    with pytest.raises(HardwareError, match=">= 1"):
        acc.cluster("h100", 0, 8)
    with pytest.raises(HardwareError, match="missing mem_bw, link"):
        acc.cluster({"name": "x1", "vendor": "nvidia", "peak_flops": {"bfloat16": 1e15}, "memory_bytes": 1e11,
                     "link_bw": 1e11, "inter_bw": 1e10}, 8, 8)
    custom = acc.cluster({"name": "x1", "vendor": "nvidia", "peak_flops": {"bfloat16": 1e15}, "memory_bytes": 1e11,
                          "mem_bw": 2e12, "link": "nvlink", "link_bw": 1e11, "inter_bw": 1e10}, 16, 8)
    assert custom.num_nodes == 2 and custom.matmul_rate("bfloat16", 1e13) < 1e15


# ------------------------------------------------------------------------------------- real measurement
QUICK = {"message_sizes": (4 * KiB, 8 * MiB), "matmul_sizes": (64, 256)}


def _check_measured(hw: Hardware, ranks: int) -> None:
    assert hw.device_type == "cpu" and hw.ranks_per_node == ranks and hw.threads_per_rank >= 1
    for dt in ("float32", "bfloat16"):
        (f0, r0), (f1, r1) = hw.matmul_flops[dt]
        assert f0 == 2 * 64 ** 3 and f1 == 2 * 256 ** 3 and r0 > 0 and r1 > 0
    assert hw.mem_bw > 1e8 and 0 < hw.op_overhead_s < 1e-3
    # host work of the step as run (calibration method 5): DTensor optimizer, TrainStep; FSDP2's own work per
    # unit only with a collective to wait on (2+ ranks), each >= 0 after its subtraction
    assert hw.optimizer_dtensor_s > 0 and hw.train_step_call_s >= 0
    assert min(hw.fsdp_unit_s, hw.fsdp_tensor_s, hw.fsdp_unit_reduce_s) >= 0
    assert ranks == 1 or hw.fsdp_unit_s + hw.fsdp_tensor_s > 0
    for kind in COLLECTIVES:
        (b0, t0), (b1, t1) = hw.intra[kind][ranks].points
        assert (b0, b1) == (4 * KiB, 8 * MiB)
        assert 0 < t0 <= t1, (kind, t0, t1)  # non-decreasing by contract (suffix minimum); a noisy small one can tie
    assert hw.fingerprint == calibrate.fingerprint()
    # the load it ran under is recorded (whatever it was: other tests share this machine)
    assert hw.load["method"] in ("/proc/stat", "loadavg") and hw.load["probe_flops"] > 0
    assert hw.load["ranks"] == ranks and hw.provisional == hw.load["under_load"]
    assert hw.load["probe_workers"] == ranks and hw.load["probe_version"] == calibrate.PROBE_VERSION  # its layout


def test_real_calibration_on_two_gloo_ranks(tmp_path, monkeypatch):
    # without OMP_NUM_THREADS each of 2 ranks gets cores // 2 threads, as `loom run` gives them
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # the re-check (test_calibration_load.py, injected load) could rightly re-measure on a shared machine
    monkeypatch.setattr(calibrate, "recheck", lambda hw, path, now: True)
    hw = calibrate.local_hardware(2, cache_dir=tmp_path, budget_s=0.5, **QUICK)
    _check_measured(hw, 2)
    assert hw.threads_per_rank == calibrate.threads_per_rank(2) == max(1, len(os.sched_getaffinity(0)) // 2)
    assert calibrate.local_hardware(2, cache_dir=tmp_path).to_dict() == hw.to_dict()  # cached


def _job_twice(cache_dir: str) -> tuple[dict, dict]:
    calibrate.recheck = lambda hw, path, now: True  # as in test_real_calibration_on_two_gloo_ranks (this rank only)
    first = calibrate.job_hardware(cache_dir=cache_dir, budget_s=0.5, **QUICK)

    def refuse(*a, **k):
        raise AssertionError("job_hardware measured although the cache holds this machine")

    calibrate.measure_in_group = refuse  # this rank's module only; the process ends after the test
    second = calibrate.job_hardware(cache_dir=cache_dir)
    return first.to_dict(), second.to_dict()


def test_job_hardware_measures_in_the_live_group_then_reuses_the_cache(tmp_path):
    results = run_ranks(_job_twice, 2, str(tmp_path), env={"OMP_NUM_THREADS": "1"})
    (a0, b0), (a1, b1) = results
    assert a0 == a1 == b0 == b1  # rank 0's measurement on every rank, and the same from the cache
    hw = Hardware.from_dict(a0)
    _check_measured(hw, 2)
    assert list(tmp_path.glob("*-w2.json"))


# ------------------------------------------------------------------------------------------ loom calibrate
def test_loom_calibrate_prints_table_and_json(tmp_path, monkeypatch, counted):
    from click.testing import CliRunner

    from torchloom import cli

    codes = []
    monkeypatch.setattr(cli, "_exit", codes.append)  # the real one leaves the process
    out = CliRunner().invoke(cli.main, ["calibrate", "--nproc", "1,2", "--cache-dir", str(tmp_path)])
    assert out.exit_code == 0 and codes == [0], out.output
    assert counted == [1, 2]
    assert "matmul GFLOP/s per rank" in out.output and "all_reduce" in out.output and "GB/s" in out.output
    assert "load: other processes kept 0.00 of 2 cores busy" in out.output and "PROVISIONAL" not in out.output
    out = CliRunner().invoke(cli.main, ["calibrate", "--nproc", "2", "--cache-dir", str(tmp_path), "--json"])
    assert counted == [1, 2], "cached level measured again without --refresh"
    assert Hardware.from_dict(json.loads(out.output)[0]).ranks_per_node == 2
    CliRunner().invoke(cli.main, ["calibrate", "--nproc", "2", "--cache-dir", str(tmp_path), "--refresh"])
    assert counted == [1, 2, 2]
    out = CliRunner().invoke(cli.main, ["calibrate", "--nproc", "two", "--cache-dir", str(tmp_path)])
    assert codes[-1] == 2 and "'two' is not an integer" in out.output


def _four_ranks() -> tuple[dict, dict]:
    one_node = calibrate.measure_in_group(0.3, **QUICK)  # LOCAL_WORLD_SIZE=4: groups of 2 (two at once) and 4
    two_nodes = calibrate.measure_in_group(0.3, ranks_per_node=2, **QUICK)  # as if 2 nodes of 2 ranks
    return one_node, two_nodes


def test_four_ranks_group_sizes_and_nodes():
    results = run_ranks(_four_ranks, 4, env={"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "4"})
    assert all(r == results[0] for r in results)  # rank 0's result everywhere
    one, two = (Hardware.from_dict(d) for d in results[0])
    assert (one.ranks_per_node, one.num_nodes) == (4, 1) and set(one.intra["all_reduce"]) == {2, 4}
    assert one.inter_bw == 0.0
    assert (two.ranks_per_node, two.num_nodes) == (2, 2) and set(two.intra["all_reduce"]) == {2}
    assert two.inter_bw > 0 and two.inter_latency_s >= 0  # ring fit across the "nodes"
    for kind in COLLECTIVES:
        for g in (2, 4):
            (_, t0), (_, t1) = one.intra[kind][g].points
            # non-decreasing by contract (microbench.collective_points: suffix minimum), so equal when the larger
            # message happened to be measured faster (seen in CI: both 0.01436 s); strictly larger was a flake
            assert 0 < t0 <= t1, (kind, g)
