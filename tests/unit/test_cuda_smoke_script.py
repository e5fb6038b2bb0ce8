"""scripts/cuda_smoke.py is run by hand on GPU machines only: dry-run a few of its checks on the CPU here so the
script cannot rot between GPU sessions (its CUDA-only numbers are not checked here)."""
import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_smoke.py"


def test_cuda_smoke_script_dry_runs_on_cpu(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_SMOKE_ALLOW_CPU", "1")
    monkeypatch.setenv("CUDA_SMOKE_ONLY", "ddp,sumloss_token_count_on_device,set_global_batch_size")
    spec = importlib.util.spec_from_file_location("cuda_smoke", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(str(tmp_path)) == 0, mod.RESULTS
    assert set(mod.RESULTS) == {"ddp", "sumloss_token_count_on_device", "set_global_batch_size"}
    assert (tmp_path / "cuda_smoke.json").is_file()
