"""Measurements taken on a busy machine (issue [11] item 4): the load is recorded, a calibration under load is
cached only as provisional and re-measured at its first use on a quiet machine, a cached one is re-checked
against the load measured now and a probe run in the calibration's layout, timings keep the best of several,
the train peak is re-measured during the run (the highest kept) and MFU is never reported above 1. Load,
clock and probe are injected: deterministic, no real load, one process."""
from __future__ import annotations

import itertools
import json
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

from torchloom.cost import calibrate
from torchloom.cost import load as machine_load
from torchloom.cost import microbench as mb
from torchloom.cost.hardware import Hardware
from torchloom.testing import free_port
from torchloom.train import metrics


# --------------------------------------------------------------------------------------- injected sources
def inject_load(monkeypatch, *, own_cpu_s: float, busy_s: float, wall_s: float = 10.0, cores: int = 2,
                loadavg: float = 3.0) -> None:
    """Every LoadWindow (one start, one finish; windows do not nest) from now on sees ``busy_s`` CPU seconds on
    the host's ``cores`` cores over ``wall_s`` seconds, ``own_cpu_s`` of them this process's."""
    monkeypatch.setattr(machine_load, "_usable_cpus", lambda: list(range(cores)))
    monkeypatch.setattr(machine_load, "_clock", itertools.cycle([100.0, 100.0 + wall_s]).__next__)
    monkeypatch.setattr(machine_load, "_cpu_seconds",
                        itertools.cycle([(500.0, 900.0), (500.0 + busy_s, 920.0)]).__next__)
    monkeypatch.setattr(machine_load, "_own_cpu_seconds", itertools.cycle([7.0, 7.0 + own_cpu_s]).__next__)
    monkeypatch.setattr(machine_load, "_loadavg", lambda: loadavg)


@pytest.fixture()
def group(monkeypatch):
    """A one-process gloo group in this process (no launch); one intra-op thread; 1 MiB memory-bandwidth
    tensors (64 MiB take most of a tiny calibration's time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    monkeypatch.setitem(mb.STREAM_BYTES, "cpu", 1 << 20)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch.set_num_threads(threads)


TINY = {"matmul_sizes": (64,), "message_sizes": (4096,)}


def busy(monkeypatch):  # the rank got half of its core for 10 s; other processes kept 1.5 of 2 cores busy
    inject_load(monkeypatch, own_cpu_s=5.0, busy_s=20.0)


def quiet(monkeypatch):  # the rank had its core; 0.1 core of daemons on the other one
    inject_load(monkeypatch, own_cpu_s=10.0, busy_s=11.0, loadavg=1.0)


# ------------------------------------------------------------------------------------------ load records
def test_assess_counts_only_what_other_processes_take_from_the_measured_cores():
    row = {"host": "h", "wall_s": 10.0, "own_cpu_s": 5.0, "loadavg_before": 3.0, "loadavg_after": 3.0, "cores": 4}
    # 2 ranks x 1 thread on 4 cores: others kept 2.5 cores busy, 2 cores were free -> 0.5 of 2 used = 25 %
    rec = machine_load.assess([{**row, "busy_s": 35.0}, {**row, "busy_s": 35.0}], threads_per_rank=1)
    assert (rec["cores_used"], rec["other_busy_cores"], rec["stolen_fraction"]) == (2, 2.5, 0.25)
    assert rec["under_load"] and rec["ranks"] == 2 and rec["method"] == "/proc/stat"
    # the same others on the free cores only: nothing taken from the measurement
    rec = machine_load.assess([{**row, "busy_s": 28.0}, {**row, "busy_s": 28.0}], threads_per_rank=1)
    assert rec["stolen_fraction"] == 0.0 and not rec["under_load"]
    # no /proc/stat: the load average stands in (6 runnable on 4 cores used by 4 threads -> 2 others)
    rec = machine_load.assess([{**row, "busy_s": None, "loadavg_after": 6.0}], threads_per_rank=4)
    assert rec["method"] == "loadavg" and rec["stolen_fraction"] == 0.5 and rec["under_load"]
    assert "UNDER LOAD" in machine_load.describe(rec) and "2.00 of 4 cores" in machine_load.describe(rec)


def test_calibration_under_load_is_recorded_and_provisional(monkeypatch, group):
    monkeypatch.setattr(calibrate, "_probe", lambda device, threads, workers: 1e9)  # 0.3 s of real GEMMs saved
    busy(monkeypatch)
    hw = Hardware.from_dict(calibrate.measure_in_group(0.05, **TINY))
    assert hw.provisional and hw.load["under_load"]
    assert (hw.load["other_busy_cores"], hw.load["stolen_fraction"], hw.load["cores_used"]) == (1.5, 0.5, 1)
    assert hw.load["loadavg_1m"] == 3.0 and hw.load["probe_flops"] > 0 and hw.load["threads_per_rank"] == 1
    assert "UNDER LOAD" in hw.sources["load"]
    quiet(monkeypatch)
    hw = Hardware.from_dict(calibrate.measure_in_group(0.05, **TINY))
    assert not hw.provisional and hw.load["stolen_fraction"] == 0.0 and hw.load["other_busy_cores"] == 0.1


# ----------------------------------------------------------------------------------------------- cache
@pytest.fixture()
def measured(monkeypatch, group):
    """local_hardware's measurement runs measure_in_group in this process (the load injected) and is counted;
    the re-check probe (in the calibration and in measure_now) returns ``probe_now[0]`` and records the
    workers it was asked for."""
    calls, probe_now, workers = [], [0.0], []

    def measure(ranks, budget_s=0, **kw):
        calls.append(ranks)
        return Hardware.from_dict(calibrate.measure_in_group(0.05, **TINY))

    def probe(device, threads, *rest):  # rest: the workers (ranks per node)
        workers.append(rest[0] if rest else None)
        return probe_now[0]

    monkeypatch.setattr(calibrate, "measure_standalone", measure)
    monkeypatch.setattr(calibrate, "threads_per_rank", lambda ranks: 1)
    monkeypatch.setattr(calibrate, "_probe", probe)
    return calls, probe_now, workers


def test_provisional_calibration_is_measured_again_at_its_first_use_on_a_quiet_machine(tmp_path, monkeypatch,
                                                                                       measured):
    # the fresh-user repro: calibrated beside two busy loops, then the loops end; the probe sees no speed-up
    # (then rank 0 alone: best-of-N single calls are hardly slowed), so only the load measured now can tell
    calls, probe_now, _ = measured
    probe_now[0] = 57e9
    busy(monkeypatch)
    with pytest.warns(UserWarning, match=r"provisional: measured under load \(other processes kept 1\.50 of 2"):
        first = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    cached = json.loads(path.read_text())
    assert cached["provisional"] is True and cached["load"]["under_load"] is True  # never cached as final
    assert first.load["probe_flops"] == 57e9

    with pytest.warns(UserWarning, match=r"is provisional: .* first use on a quiet machine.* Now: .*UNDER LOAD"):
        assert calibrate.local_hardware(1, cache_dir=tmp_path).provisional  # still busy: the cache is used
    assert calls == [1]

    quiet(monkeypatch)  # the loops ended; the probe reads what it read then
    with pytest.warns(UserWarning, match=r"is provisional \(measured under load: .*\) and the machine is quiet now"):
        hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1] and not hw.provisional
    assert json.loads(path.read_text())["provisional"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a quiet cache on a quiet machine: used silently
        assert calibrate.local_hardware(1, cache_dir=tmp_path).to_dict() == hw.to_dict()
    assert calls == [1, 1]


def test_load_now_is_measured_in_the_calibrations_layout(monkeypatch, measured):
    # 2 ranks x 1 thread on 2 cores; other processes keep one core busy while the probe runs. For the job's
    # layout (both cores) that takes half its cores; a probe of one rank alone would have had a free core.
    _, probe_now, workers = measured
    probe_now[0] = 28e9
    inject_load(monkeypatch, own_cpu_s=0.3, busy_s=0.6, wall_s=0.3, cores=2)
    now = calibrate.measure_now(torch.device("cpu"), 1, 2)
    assert workers == [2] and now["probe_workers"] == 2 and now["probe_flops"] == 28e9
    assert (now["ranks"], now["cores_used"], now["other_busy_cores"]) == (2, 2, 1.0)
    assert now["stolen_fraction"] == 0.5 and now["under_load"]
    alone = machine_load.assess([machine_load.LoadWindow().finish()], 1)  # what one rank alone would see
    assert alone["cores_used"] == 1 and not alone["under_load"]


def test_layout_probe_runs_every_rank_at_once_and_keeps_the_slowest(monkeypatch):
    lock, active, most = threading.Lock(), [0], [0]
    pace = {"torchloom-probe-0": 0.002, "torchloom-probe-1": 0.008}  # seconds per GEMM of each worker

    def mm(a, b, out):
        with lock:
            active[0] += 1
            most[0] = max(most[0], active[0])
        time.sleep(pace[threading.current_thread().name])
        with lock:
            active[0] -= 1

    monkeypatch.setattr(mb, "_mm", mm)
    rate = mb.layout_matmul_rate(torch.device("cpu"), workers=2, n=8, seconds=0.05)
    assert most[0] == 2  # both workers computed at the same moment
    assert 0 < rate <= 2 * 8 ** 3 / 0.008  # the slow worker's best call, not the fast one's


def test_quiet_cache_is_kept_when_the_machine_is_busy_now_and_not_replaced_by_a_busy_one(tmp_path, monkeypatch,
                                                                                         measured):
    calls, probe_now, _ = measured
    probe_now[0] = 20e9
    quiet(monkeypatch)
    first = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    kept = path.read_text()
    busy(monkeypatch)  # loaded now (the probe reads the same): keep the calibration, say timings are disturbed
    with pytest.warns(UserWarning, match=r"busy now \(.*UNDER LOAD.*\): the calibration .* kept, .* disturbed"):
        hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1] and hw.to_dict() == first.to_dict()
    quiet(monkeypatch)
    probe_now[0] = 10e9  # quiet by /proc/stat, yet 2x slower (load we cannot see, e.g. another VM): kept, warned
    with pytest.warns(UserWarning, match=r"2\.0x slower now .*probe 10\.0 GFLOP/s now, 20\.0 when calibrated"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    busy(monkeypatch)  # re-measured under load on request: the result is returned but the quiet file stays
    with pytest.warns(UserWarning, match="is not cached: .* holds a quiet one"):
        fresh = calibrate.local_hardware(1, cache_dir=tmp_path, refresh=True)
    assert fresh.provisional and path.read_text() == kept and calls == [1, 1]


def test_quiet_cache_taken_under_undetected_load_is_measured_again_on_a_quiet_machine(tmp_path, monkeypatch,
                                                                                       measured):
    calls, probe_now, _ = measured
    probe_now[0] = 20e9
    quiet(monkeypatch)
    calibrate.local_hardware(1, cache_dir=tmp_path)
    probe_now[0] = 40e9
    busy(monkeypatch)  # faster now, but busy: a re-measurement would be provisional -> kept until quiet
    with pytest.warns(UserWarning, match=r"reads low .* under load now .* first use on a quiet machine"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1]
    quiet(monkeypatch)
    with pytest.warns(UserWarning, match="2.0x faster now"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1]


def test_cache_without_a_load_record_or_with_the_old_probe_is_measured_again(tmp_path, monkeypatch, measured):
    calls, probe_now, _ = measured
    probe_now[0] = 20e9
    quiet(monkeypatch)
    hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    old = hw.to_dict()
    del old["load"], old["provisional"]  # as an older torchloom wrote it
    path.write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="records no machine load"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1]
    old = json.loads(path.read_text())
    del old["load"]["probe_version"], old["load"]["probe_workers"]  # rank 0's solo probe: not comparable
    path.write_text(json.dumps(old))
    with pytest.warns(UserWarning, match="records an older re-check probe"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1, 1]


def test_job_hardware_measures_the_load_now_before_using_a_provisional_cache(tmp_path, monkeypatch, measured):
    _, probe_now, workers = measured
    probe_now[0] = 30e9
    busy(monkeypatch)
    with pytest.warns(UserWarning, match="provisional"):
        first = calibrate.job_hardware(cache_dir=tmp_path, budget_s=0.05, **TINY)
    assert first.provisional and workers == [1]
    with pytest.warns(UserWarning, match="is provisional: "):
        assert calibrate.job_hardware(cache_dir=tmp_path).to_dict() == first.to_dict()  # still busy
    quiet(monkeypatch)
    with pytest.warns(UserWarning, match="the machine is quiet now"):
        hw = calibrate.job_hardware(cache_dir=tmp_path, budget_s=0.05, **TINY)
    assert not hw.provisional and workers == [1, 1, 1, 1]  # calibration, check, check, calibration


# ---------------------------------------------------------------------------------------------- best of N
class ScriptedClock:
    """Each timed region (two reads: start, end) lasts the next of ``durations`` seconds."""

    def __init__(self, durations):
        self.durations, self.t, self.reads = list(durations), 0.0, 0

    def __call__(self) -> float:
        self.reads += 1
        if self.reads % 2 == 0:
            self.t += self.durations.pop(0)
        return self.t


def test_matmul_rate_is_the_best_of_three_timings_even_when_one_call_spends_the_budget(monkeypatch):
    monkeypatch.setattr(mb.Timer, "slowest", lambda self, seconds: seconds)  # one rank: no group needed
    monkeypatch.setattr(mb, "_clock", ScriptedClock([1.0, 0.6, 0.3]))  # disturbed, less, then a clean one
    (flops, rate), = mb.matmul_rates(mb.Timer(torch.device("cpu")), torch.float32, [64], target_s=0.5)
    assert rate == pytest.approx(2 * 64 ** 3 / 0.3)
    # loop path: the probe call is a timing too (the chunks after it were disturbed)
    monkeypatch.setattr(mb, "_clock", ScriptedClock([0.01] + [2.0] * 3))
    assert mb.Timer(torch.device("cpu")).per_call(lambda: None, 0.05) == pytest.approx(0.01)


def test_oversubscribed_timing_uses_chunks_spanning_time_slices(monkeypatch):
    """With ``min_chunk_s`` the single probe call (short enough to run while co-tenants are descheduled) does
    not count and every timed chunk holds enough calls to last ``min_chunk_s``: probe 1 ms -> chunks of 50
    calls; the best chunk's per-call time wins."""
    monkeypatch.setattr(mb.Timer, "slowest", lambda self, seconds: seconds)
    calls = []
    monkeypatch.setattr(mb, "_clock", ScriptedClock([0.001, 0.2, 0.15]))  # probe, then two 50-call chunks
    t = mb.Timer(torch.device("cpu"), min_chunk_s=0.05).per_call(lambda: calls.append(1), 0.01, warmup=False)
    assert t == pytest.approx(0.15 / 50) and len(calls) == 1 + 2 * 50
    # the calibration turns it on only when the ranks oversubscribe the cores
    from torchloom.cost import calibrate
    assert calibrate.OVERSUBSCRIBED_CHUNK_S >= 0.02


def test_train_peak_benchmark_times_at_least_three_calls(monkeypatch):
    # reads: the deadline, then (start, end) per call; the first call alone passes the 0.3 s deadline
    reads = iter([0.0, 0.0, 1.0, 1.0, 1.1, 1.1, 1.3, 1.3])
    monkeypatch.setattr(mb, "_clock", reads.__next__)
    assert metrics.measure_matmul_flops(torch.device("cpu"), n=32) == pytest.approx(2 * 32 ** 3 / 0.1)


def test_probe_and_peak_benchmarks_leave_the_random_stream_alone():
    # the train peak is re-measured mid-run: its matrices must not shift the training's random draws
    state = torch.random.get_rng_state()
    mb.solo_matmul_rate(torch.device("cpu"), n=16, seconds=0.0)
    assert torch.equal(torch.random.get_rng_state(), state)


# --------------------------------------------------------------------------------------------------- MFU
def test_mfu_is_never_above_one_and_flags_an_unreliable_peak():
    meter = metrics.MfuMeter(metrics.PeakFlops(1e10, "measured:cpu_matmul_float32_threads1", {}))
    first = meter.record(5e9)
    assert (first["mfu"], first["mfu_unreliable"], first["peak_flops"]) == (0.5, False, 1e10)
    assert first["peak_flops_step"] == 0 and first["peak_flops_load"] == {}  # no load record given
    assert not meter.take_note()
    rec = meter.record(1.67e10)  # the 1.67: the peak read low
    assert (rec["mfu"], rec["mfu_unreliable"]) == (None, True)
    note = meter.take_note()
    assert "16.7 GFLOP/s" in note and "above the peak 10.0" in note and "measured:cpu" in note
    rec = meter.record(5e9)
    assert (rec["mfu"], rec["mfu_unreliable"]) == (0.5, True) and not meter.take_note()  # known low now
    assert meter.summary()["mfu"] is None and meter.summary()["mfu_unreliable"]
    for achieved in (0.0, 1e9, 1e10, 1.0000001e10, 3e10, 1e12):
        m = meter.record(achieved)["mfu"]
        assert m is None or 0 <= m <= 1
    ok = metrics.MfuMeter(metrics.PeakFlops(1e10, "table:x:float32"))
    ok.record(2e9), ok.record(4e9)
    summary = ok.summary()
    assert summary["mfu"] == pytest.approx(0.3) and not summary["mfu_unreliable"]
    assert summary["mfu_unreliable_reason"] == "" and summary["mfu_peak"]["source"] == "table:x:float32"


QUIET_PEAK = {"method": "/proc/stat", "cores": 2, "cores_used": 2, "other_busy_cores": 0.3, "stolen_fraction": 0.15,
              "under_load": False, "loadavg_1m": 1.5, "threshold": 0.2, "ranks": 2, "threads_per_rank": 1}


def test_peak_read_low_at_start_is_raised_by_a_later_measurement_and_each_record_names_its_peak():
    # the fresh-user run: a "quiet" (15 % < 20 %) start measured 41.9 GFLOP/s, other runs 61.7-69.6
    src = "measured:cpu_matmul_float32_threads1"
    meter = metrics.MfuMeter(metrics.PeakFlops(41.9e9, src, QUIET_PEAK), step=0)
    first, second = meter.record(35e9), meter.record(35e9)
    assert first["mfu"] == pytest.approx(35 / 41.9) and not first["mfu_unreliable"]
    assert first["peak_flops_load"] == {"stolen_fraction": 0.15, "other_busy_cores": 0.3, "cores_used": 2,
                                        "loadavg_1m": 1.5, "under_load": False, "method": "/proc/stat"}
    assert "peak_flops_load" not in second and second["peak_flops_step"] == 0  # the load once per peak
    assert meter.offer(metrics.PeakFlops(65e9, src, {**QUIET_PEAK, "stolen_fraction": 0.0}), step=10)
    assert "peak re-measured at step 10: 65.0 GFLOP/s per rank, above the 41.9 measured at step 0" in meter.take_note()
    third = meter.record(35e9)
    assert third["mfu"] == pytest.approx(35 / 65) and third["peak_flops"] == 65e9 and third["peak_flops_step"] == 10
    assert third["peak_flops_load"]["stolen_fraction"] == 0.0
    assert not meter.offer(metrics.PeakFlops(50e9, src, QUIET_PEAK), step=20)  # lower: the highest is kept
    assert meter.record(35e9)["peak_flops"] == 65e9 and not meter.take_note()
    summary = meter.summary()
    assert summary["mfu"] == pytest.approx(35 / 65)  # the run's mean divides by the final (highest) peak
    peak = summary["mfu_peak"]
    assert (peak["flops"], peak["source"], peak["step"], peak["load"]["stolen_fraction"]) == (65e9, src, 10, 0.0)
    assert [(m["step"], m["flops"]) for m in peak["measurements"]] == [(0, 41.9e9), (10, 65e9), (20, 50e9)]


def test_a_raised_peak_that_explains_every_step_clears_the_flag():
    meter = metrics.MfuMeter(metrics.PeakFlops(1e10, "measured:cpu", {}), step=4)
    assert meter.record(1.67e10)["mfu"] is None and meter.take_note()
    meter.offer(metrics.PeakFlops(2e10, "measured:cpu", {}), step=8)
    rec = meter.record(5e9)
    assert (rec["mfu"], rec["mfu_unreliable"], rec["peak_flops_step"]) == (0.25, False, 8)
    assert meter.summary()["mfu"] == pytest.approx((1.67e10 + 5e9) / 2 / 2e10)
    under = metrics.MfuMeter(metrics.PeakFlops(1e10, "measured:cpu", {"under_load": True, "stolen_fraction": 0.5}))
    assert under.record(5e9)["mfu_unreliable"] and "under load at step 0" in under.summary()["mfu_unreliable_reason"]


def test_train_peak_measured_under_load_is_flagged(monkeypatch, group):
    timed = []
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype, seconds: timed.append(seconds) or 6e9)
    busy(monkeypatch)
    peak = metrics.job_peak_flops(torch.device("cpu"), torch.float32)
    assert peak.flops == 6e9 and peak.under_load and peak.load["stolen_fraction"] == 0.5
    assert "UNDER LOAD" in peak.describe() and "mfu_unreliable" in peak.describe()
    rec = metrics.MfuMeter(peak).record(3e9)
    assert (rec["mfu"], rec["mfu_unreliable"], rec["peak_flops_load"]["under_load"]) == (0.5, True, True)
    quiet(monkeypatch)
    peak = metrics.job_peak_flops(torch.device("cpu"), torch.float32, seconds=metrics.REMEASURE_S)
    rec = metrics.MfuMeter(peak).record(3e9)
    assert not peak.under_load and (rec["mfu"], rec["mfu_unreliable"]) == (0.5, False)
    assert timed == [metrics.PEAK_S, metrics.REMEASURE_S] and metrics.REMEASURE_S <= 0.1  # re-measuring is cheap
