"""`loom train` end to end on 2 gloo processes: metrics, evaluation, checkpoints, sample, and an exact resume.

The smoke config (2-layer model, 20 steps, checkpoint every 10) runs three times: once uninterrupted,
and once stopped after 13 steps (--max-steps-this-run, which saves step 13) then re-run in the same output dir,
which resumes from step 13 and must end with bitwise the same weights and losses as the uninterrupted run.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]

REPO = Path(__file__).resolve().parents[2]
TRAIN_FIELDS = {"step", "loss", "lr", "tokens_per_s", "step_time_s", "peak_mem_bytes", "mfu", "mfu_unreliable",
                "peak_flops", "peak_flops_source", "tokens_seen", "grad_norm", "world_size"}


def loom(*args: str, timeout: float = 180, env: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    env.pop("OMP_NUM_THREADS", None)  # let the launcher pick cores / nproc
    return subprocess.run([sys.executable, "-m", "torchloom.cli", *args], cwd=REPO, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


def smoke(out: Path, cache: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return loom("train", "smoke", "--output-dir", str(out), "--set", f"data.cache_dir={cache}", *extra, env=env)


SLOW_MATMUL = 1e8  # FLOP/s of the hand-built calibration: predicts seconds per smoke step, which take ~30 ms


def hand_calibration(directory: Path) -> Path:
    """A calibration of this machine for `loom train smoke`'s layout (2 ranks) in ``directory`` (a
    TORCHLOOM_CACHE_DIR) that the job's re-check keeps without measuring (its probe reads far faster than any
    now), with a matmul rate so low that the prediction check must warn. Returns the file."""
    from tests.unit.test_search_cost import toy_hw
    from torchloom.cost import calibrate

    hw = toy_hw(ranks=2, device="cpu")
    hw.matmul_flops = {"float32": [(1.0, SLOW_MATMUL)], "bfloat16": [(1.0, SLOW_MATMUL)]}
    hw.fingerprint = calibrate.fingerprint("gloo")
    hw.threads_per_rank = calibrate.threads_per_rank(2)
    hw.load = {"probe_flops": 1e18, "probe_version": calibrate.PROBE_VERSION, "under_load": False}
    hw.provisional = False
    path = calibrate.cache_path(hw.fingerprint, 2, 1, directory / "hardware")
    calibrate.save_cache(path, hw)
    return path


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("smoke_full")
    calibration = tmp_path_factory.mktemp("calibration")
    hand_calibration(calibration)
    return out, smoke(out, cache, env={"TORCHLOOM_CACHE_DIR": str(calibration)})


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_smoke_run(full_run):
    out, proc = full_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    log = proc.stdout

    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["type"] == "train"]
    evals = [r for r in records if r["type"] == "eval"]
    assert [r["step"] for r in train] == list(range(1, 21))
    for r in train:
        assert TRAIN_FIELDS <= set(r), TRAIN_FIELDS - set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["loss"] > 0 and r["lr"] > 0
        assert len(r["peak_mem_bytes"]) == 2 and all(b > 10 * 2**20 for b in r["peak_mem_bytes"])
        assert (r["mfu"] is None and r["mfu_unreliable"]) or 0 < r["mfu"] <= 1, r["mfu"]  # never above 1
        assert r["peak_flops"] > 1e9 and r["peak_flops_source"].startswith(("measured:", "table:"))
        assert r["world_size"] == 2 and r["tokens"] == 8 * 64
    assert train[-1]["tokens_seen"] == 20 * 8 * 64
    # the peak MFU divides by: measured at start (its load on the first record), again at step 10 (evaluation and
    # checkpoint), the highest kept; each record names its peak
    assert {"stolen_fraction", "under_load", "loadavg_1m"} <= set(train[0]["peak_flops_load"])
    assert train[0]["peak_flops_step"] == 0 and all(r["peak_flops_step"] in (0, 10) for r in train)
    assert all(b["peak_flops"] >= a["peak_flops"] for a, b in zip(train, train[1:]))
    assert train[-1]["loss"] < train[0]["loss"] - 0.5

    assert [e["step"] for e in evals] == [0, 10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"] - 0.5
    assert 7.0 < evals[0]["eval_loss"] < 8.5  # ~ln(2048) at initialisation

    ckpts = sorted((out / "checkpoints").iterdir())
    assert [p.name for p in ckpts] == ["step_00000010", "step_00000020"]
    assert all((p / "COMPLETE").is_file() for p in ckpts)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["final_eval_loss"] == evals[-1]["eval_loss"]
    assert summary["initial_eval_loss"] == evals[0]["eval_loss"]
    assert summary["tokens_per_s"] > 0 and summary["sample"]
    peak = summary["mfu_peak"]
    assert [m["step"] for m in peak["measurements"]] == [0, 10] and "stolen_fraction" in peak["load"]
    assert peak["flops"] == summary["peak_flops"] == train[-1]["peak_flops"]
    assert peak["flops"] == max(m["flops"] for m in peak["measurements"])
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert "held-out loss" in log and "sample:" in log and summary["sample"].splitlines()[0] in log
    # the cost model's online check (hand-built calibration: predicts seconds per step): the prediction of the plan
    # that ran in every record, the window's median from step 13 (3 warm-up + 10), one warning, the summary
    pred = summary["prediction"]
    assert pred["unavailable"] is None and pred["plan"] == "dpr2 | ddp | mb2x2" and pred["calibration"] == "quiet"
    from torchloom.search.drift import STEP_TIME_BAND
    assert pred["band"] == STEP_TIME_BAND and pred["steps_measured"] == 17 and pred["predicted_step_s"] > 1.0
    assert 0 < pred["measured_step_s"] < pred["predicted_step_s"] / 5
    assert pred["drift"] == pytest.approx(pred["measured_step_s"] / pred["predicted_step_s"] - 1)
    assert all(r["predicted_step_s"] == pred["predicted_step_s"] for r in train)
    assert [r["measured_step_s"] is None for r in train] == [True] * 12 + [False] * 8
    assert all(r["drift"] < -0.2 for r in train[12:])
    assert f"prediction check: dpr2 | ddp | mb2x2 predicted {pred['predicted_step_s']:.2f} s per step" in log
    assert log.count("warning: step time off the cost model") == 1 and pred["warning"] in log
    assert "Faster than predicted" in pred["warning"] and "loom calibrate --refresh --nproc 2" in pred["warning"]
    # the output is a pipe, not a terminal: plain progress lines (smoke: 20 steps -> one a step), no tqdm bars
    # (text mode turns their "\r" redraws into newlines, so look for the bar itself: "45%|####  | 9/20 [...step/s]")
    bars = [line for line in log.splitlines() if "%|" in line or "step/s" in line]
    assert not bars, bars[:3]
    assert "train step 1/20 (5%)" in log and "train step 20/20 (100%) | loss " in log


def test_interrupted_run_resumes_exactly(tmp_path, full_run, cache):
    from safetensors.torch import load_file

    ref_out, ref = full_run
    assert ref.returncode == 0, ref.stdout[-4000:]
    out = tmp_path / "resumed"

    first = smoke(out, cache, "--max-steps-this-run", "13")
    assert first.returncode == 0, first.stdout[-4000:]
    # a requested stop saves the step it reached and says so (not "step 0" or the older interval checkpoint)
    assert (f"stopped after step 13 of 20 (--max-steps-this-run): checkpoint step 13 saved "
            f"({out.resolve() / 'checkpoints' / 'step_00000013'}); re-run the same command") in first.stdout
    assert not (out / "summary.json").exists()
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000010", "step_00000013"]

    second = smoke(out, cache)
    assert second.returncode == 0, second.stdout[-4000:]
    assert "resumed from step 13" in second.stdout

    a, b = read_jsonl(ref_out / "metrics.jsonl"), read_jsonl(out / "metrics.jsonl")
    key = lambda r: (r["type"], r["step"], r.get("loss"), r.get("eval_loss"), r.get("lr"))  # noqa: E731
    assert [key(r) for r in b] == [key(r) for r in a]  # bitwise: same steps, losses, lrs; redone steps replaced
    wa, wb = load_file(ref_out / "model.safetensors"), load_file(out / "model.safetensors")
    assert wa.keys() == wb.keys()
    for k in wa:
        assert (wa[k] == wb[k]).all(), k
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (ref_out, out))
    assert sa["final_eval_loss"] == sb["final_eval_loss"] and sb["resumed_from"] == 13
    assert sa["tokens_seen"] == sb["tokens_seen"]


def test_ckpt_list_and_export(tmp_path, full_run):
    from safetensors.torch import load_file

    out, proc = full_run
    assert proc.returncode == 0
    listing = loom("ckpt", "list", str(out), timeout=60)
    assert listing.returncode == 0, listing.stdout
    assert "step_00000020" in listing.stdout and "(latest)" in listing.stdout and "complete" in listing.stdout
    exported = tmp_path / "w.safetensors"
    r = loom("ckpt", "export", str(out / "checkpoints"), str(exported), timeout=60)
    assert r.returncode == 0, r.stdout
    a, b = load_file(out / "model.safetensors"), load_file(exported)
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


def test_rerun_of_a_finished_job_does_not_train_again(full_run, cache):
    out, proc = full_run
    assert proc.returncode == 0
    config = (out / "config.yaml").read_bytes()
    summary = json.loads((out / "summary.json").read_text())
    again = smoke(out, cache, "--set", "sample.max_new_tokens=0", "--set", "eval.batches=1")
    assert again.returncode == 0, again.stdout[-4000:]
    assert "resumed from step 20" in again.stdout
    # its log says so (no "? tokens/s", no [0, 0] MiB); summary.json keeps the trained run's numbers, its losses
    # included (this evaluation used 1 batch, the run's initial one more), and its sample
    assert "done: all 20 steps were trained before, nothing trained now" in again.stdout and "? tokens/s" not in again.stdout
    assert json.loads((out / "summary.json").read_text()) == summary
    # it trains nothing: config.yaml keeps the settings the trained steps used (smoke's max_new_tokens 16, not 0)
    assert (out / "config.yaml").read_bytes() == config
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["type"] == "train"] == list(range(1, 21))


def test_the_run_held_its_output_dir(full_run):
    """The output-dir lock (docs/train.md, "One run per output dir"): the launcher claimed it, each worker rank
    held the workers' lock under that claim (a claim of their own would have been refused: the launcher held it)."""
    from torchloom.train.run_lock import lock_paths

    out, proc = full_run
    assert proc.returncode == 0, proc.stdout[-4000:]
    launcher_lock, workers_lock = (read_jsonl(p) for p in lock_paths(out))
    assert [r["role"] for r in launcher_lock] == ["launcher"] and " train smoke " in launcher_lock[0]["command"]
    assert sorted((r["role"], r["rank"]) for r in workers_lock) == [("worker", 0), ("worker", 1)]

