"""CI smoke of the side-by-side benchmarks (docs/benchmarks.md): ``python -m benchmarks compare --smoke`` (tiny
model, 2 gloo ranks, hand-written DDP vs torchloom DDP) and ``python -m benchmarks compare-ckpt --smoke`` (~20 MB
state, torchloom flash vs synchronous DCP, one kill + restore). They prove the suite still runs and its checks
still pass; they time nothing (timings on a shared CI machine mean nothing)."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, f"exit {p.returncode}\n" + p.stdout[-3000:] + p.stderr[-3000:]
    return p


def test_compare_smoke_runs_both_contenders_and_their_checks(tmp_path):
    out = tmp_path / "cs"
    _run(["compare", "--smoke", "--out", str(out)], tmp_path)
    result = json.loads(out.with_suffix(".json").read_text())
    (section,) = result["sections"]
    rows = {r["contender"]: r for r in section["rows"]}
    assert set(rows) == {"torch_ddp", "loom_ddp"}
    for r in rows.values():
        assert "error" not in r and r["checks"] == [], r
        assert r["dist_world_size"] == r["contender_world_size"] == 2
        assert "DistributedDataParallel" in r["wrapper"]
        assert r["timed_steps"] == 2 and r["step_s_median"] > 0
    # same weights, data and optimizer: the same first loss (fp32, 2 ranks)
    assert abs(rows["loom_ddp"]["first_loss"] - rows["torch_ddp"]["first_loss"]) <= 1e-6 * rows["torch_ddp"]["first_loss"]
    (ddp,) = section["headlines"]["overhead"]
    assert ddp["strategy"] == "ddp" and ddp["valid"] and ddp["ratio"] > 0
    md = out.with_suffix(".md").read_text()
    assert "Framework overhead" in md and "| loom_ddp |" in md
    assert (tmp_path / "cs_tiny_w2.png").stat().st_size > 0


def test_compare_ckpt_smoke_saves_kills_and_restores(tmp_path):
    p = _run(["compare-ckpt", "--smoke", "--out", str(tmp_path)], tmp_path)
    result = json.loads((tmp_path / "compare_ckpt.json").read_text())
    log = "\n--- run output ---\n" + p.stdout[-3000:] + p.stderr[-3000:]  # every failure says what the run said
    assert result["checks"]["world_size_ok"] is True, json.dumps(result["checks"]) + log
    flash = result["contenders"]["torchloom flash"]
    assert not flash.get("error"), str(flash["error"]) + log
    assert flash["stall_s"]["n"] >= 1 and flash["stall_s"]["median"] > 0, json.dumps(flash["stall_s"]) + log
    restore = flash["restore"]
    assert restore["state_matches_saved"] is True and not restore["errors"], json.dumps(restore) + log
    assert not result["contenders"]["dcp sync"].get("error"), str(result["contenders"]["dcp sync"]) + log
    assert (tmp_path / "compare_ckpt.md").read_text().strip()
