"""Measurements taken on a busy machine (issue [11] item 4): the load is recorded, a calibration under load is
cached only as provisional, a cached one is re-checked by a probe, timings keep the best of several, and MFU
is never reported above 1. Load, clock and probe are injected: deterministic, no real load, one process."""
from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from torchloom.search import calibrate
from torchloom.search import load as machine_load
from torchloom.search import microbench as mb
from torchloom.search.hardware import Hardware
from torchloom.testing import free_port
from torchloom.train import metrics


# --------------------------------------------------------------------------------------- injected sources
def inject_load(monkeypatch, *, own_cpu_s: float, busy_s: float, wall_s: float = 10.0, cores: int = 2,
                loadavg: float = 3.0) -> None:
    """One LoadWindow (one start, one finish) sees ``busy_s`` CPU seconds on the host's ``cores`` cores over
    ``wall_s`` seconds, ``own_cpu_s`` of them this process's."""
    monkeypatch.setattr(machine_load, "_usable_cpus", lambda: list(range(cores)))
    monkeypatch.setattr(machine_load, "_clock", iter([100.0, 100.0 + wall_s]).__next__)
    monkeypatch.setattr(machine_load, "_cpu_seconds", iter([(500.0, 900.0), (500.0 + busy_s, 920.0)]).__next__)
    monkeypatch.setattr(machine_load, "_own_cpu_seconds", iter([7.0, 7.0 + own_cpu_s]).__next__)
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
    """local_hardware's measurement runs measure_in_group in this process (the load injected per call) and is
    counted; the re-check probe returns ``probe_now[0]``."""
    calls, probe_now = [], [0.0]

    def measure(ranks, budget_s=0, **kw):
        calls.append(ranks)
        return Hardware.from_dict(calibrate.measure_in_group(0.05, **TINY))

    monkeypatch.setattr(calibrate, "measure_standalone", measure)
    monkeypatch.setattr(calibrate, "threads_per_rank", lambda ranks: 1)
    monkeypatch.setattr(calibrate, "_probe", lambda device, threads: probe_now[0])
    return calls, probe_now


def test_provisional_calibration_is_rechecked_and_replaced_once_the_machine_is_faster(tmp_path, monkeypatch,
                                                                                       measured):
    calls, probe_now = measured
    busy(monkeypatch)
    with pytest.warns(UserWarning, match=r"provisional: measured under load \(other processes kept 1\.50 of 2"):
        first = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    cached = json.loads(path.read_text())
    assert cached["provisional"] is True and cached["load"]["under_load"] is True  # never cached as final
    then = first.load["probe_flops"]

    probe_now[0] = then * 1.05  # as busy as then: the provisional cache is used, with a warning
    with pytest.warns(UserWarning, match="is provisional"):
        assert calibrate.local_hardware(1, cache_dir=tmp_path).provisional
    assert calls == [1]

    probe_now[0] = then * 3  # quiet now: the cached figures were taken under load -> measured again
    quiet(monkeypatch)
    with pytest.warns(UserWarning, match=r"measured under load: this machine is 3\.0x faster now"):
        hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1] and not hw.provisional
    assert json.loads(path.read_text())["provisional"] is False


def test_quiet_cache_is_kept_when_the_machine_is_slower_now_and_not_replaced_by_a_busy_one(tmp_path, monkeypatch,
                                                                                          measured):
    calls, probe_now = measured
    quiet(monkeypatch)
    first = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    kept = path.read_text()
    probe_now[0] = first.load["probe_flops"] / 2  # loaded now: keep the calibration, say timings are disturbed
    with pytest.warns(UserWarning, match=r"2\.0x slower now .* timings measured now .* are disturbed"):
        hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1] and hw.to_dict() == first.to_dict()
    busy(monkeypatch)  # re-measured under load on request: the result is returned but the quiet file stays
    with pytest.warns(UserWarning, match="is not cached: .* holds a quiet one"):
        fresh = calibrate.local_hardware(1, cache_dir=tmp_path, refresh=True)
    assert fresh.provisional and path.read_text() == kept and calls == [1, 1]


def test_quiet_cache_taken_under_undetected_load_is_measured_again(tmp_path, monkeypatch, measured):
    calls, probe_now = measured
    quiet(monkeypatch)
    first = calibrate.local_hardware(1, cache_dir=tmp_path)
    probe_now[0] = first.load["probe_flops"] * 2
    quiet(monkeypatch)
    with pytest.warns(UserWarning, match="2.0x faster now"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1]


def test_cache_without_a_load_record_is_measured_again(tmp_path, monkeypatch, measured):
    calls, _ = measured
    quiet(monkeypatch)
    hw = calibrate.local_hardware(1, cache_dir=tmp_path)
    path = calibrate.cache_path(calibrate.fingerprint(), 1, 1, tmp_path)
    old = hw.to_dict()
    del old["load"], old["provisional"]  # as an older torchloom wrote it
    path.write_text(json.dumps(old))
    quiet(monkeypatch)
    with pytest.warns(UserWarning, match="records no machine load"):
        calibrate.local_hardware(1, cache_dir=tmp_path)
    assert calls == [1, 1]


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


def test_train_peak_benchmark_times_at_least_three_calls(monkeypatch):
    # reads: the deadline, then (start, end) per call; the first call alone passes the 0.3 s deadline
    reads = iter([0.0, 0.0, 1.0, 1.0, 1.1, 1.1, 1.3, 1.3])
    monkeypatch.setattr(mb, "_clock", reads.__next__)
    assert metrics.measure_matmul_flops(torch.device("cpu"), n=32) == pytest.approx(2 * 32 ** 3 / 0.1)


# --------------------------------------------------------------------------------------------------- MFU
def test_mfu_is_never_above_one_and_flags_an_unreliable_peak():
    meter = metrics.MfuMeter(metrics.PeakFlops(1e10, "measured:cpu_matmul_float32_threads1", {}))
    assert meter.record(5e9) == {"mfu": 0.5, "mfu_unreliable": False} and not meter.take_note()
    rec = meter.record(1.67e10)  # the 1.67: the peak read low
    assert rec == {"mfu": None, "mfu_unreliable": True}
    note = meter.take_note()
    assert "16.7 GFLOP/s" in note and "above the peak 10.0" in note and "measured:cpu" in note
    assert meter.record(5e9) == {"mfu": 0.5, "mfu_unreliable": True} and not meter.take_note()  # known low now
    assert meter.summary()["mfu"] is None and meter.summary()["mfu_unreliable"]
    for achieved in (0.0, 1e9, 1e10, 1.0000001e10, 3e10, 1e12):
        m = meter.record(achieved)["mfu"]
        assert m is None or 0 <= m <= 1
    ok = metrics.MfuMeter(metrics.PeakFlops(1e10, "table:x:float32"))
    ok.record(2e9), ok.record(4e9)
    assert ok.summary() == {"mfu": pytest.approx(0.3), "mfu_unreliable": False, "mfu_unreliable_reason": ""}


def test_train_peak_measured_under_load_is_flagged(monkeypatch, group):
    busy(monkeypatch)
    monkeypatch.setattr(metrics, "measure_matmul_flops", lambda device, dtype: 6e9)
    peak = metrics.job_peak_flops(torch.device("cpu"), torch.float32)
    assert peak.flops == 6e9 and peak.under_load and peak.load["stolen_fraction"] == 0.5
    assert "UNDER LOAD" in peak.describe() and "mfu_unreliable" in peak.describe()
    assert metrics.MfuMeter(peak).record(3e9) == {"mfu": 0.5, "mfu_unreliable": True}
    quiet(monkeypatch)
    peak = metrics.job_peak_flops(torch.device("cpu"), torch.float32)
    assert not peak.under_load and metrics.MfuMeter(peak).record(3e9) == {"mfu": 0.5, "mfu_unreliable": False}
