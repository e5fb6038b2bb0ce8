"""`loom config` (write, prompts, show) and `loom run` taking its launch settings from the file: through click's
CliRunner with the launcher replaced, and one real `loom run` whose rank count comes from the file."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from torchloom import cli
from torchloom.elastic import launcher
from torchloom.strategy import config_file as cf

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


@pytest.fixture
def home(tmp_path, monkeypatch):
    """No config anywhere: empty working directory and cache, TORCHLOOM_CONFIG_FILE unset (restored after)."""
    for env in (cf.ENV_VAR, "TORCHLOOM_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("TORCHLOOM_CACHE", str(tmp_path / "cache"))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path


@pytest.fixture
def captured(monkeypatch):
    """Replace the launcher and the process exit: record what `loom run` would run."""
    calls = {}

    def fake_run(opts, target, args, module=False):
        calls.update(opts=opts, target=target, env=os.environ.get(cf.ENV_VAR))
        return 0

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(launcher, "run", fake_run)
    monkeypatch.setattr(cli, "_exit", fake_exit)
    return calls


def loom(*args, input=None):
    """Invoke `loom` in this process; `loom run` points its workers at the file through the environment, which
    in a process of its own would end with it: restore it here."""
    before = os.environ.get(cf.ENV_VAR)
    try:
        return CliRunner().invoke(cli.main, list(args), input=input)
    finally:
        os.environ.pop(cf.ENV_VAR, None)
        if before is not None:
            os.environ[cf.ENV_VAR] = before


def test_write_show_and_run_pickup(home, captured):
    out = loom("config", "--strategy", "fsdp,amp", "--nproc", "2", "--max-restarts", "1")
    user = home / "cache/default_config.yaml"
    assert out.exit_code == 0, out.output
    assert f"wrote {user}" in out.output and "note:" not in out.output  # the file in use: no warning
    data = yaml.safe_load(user.read_text())
    assert data == {"config_version": 1, "strategy": ["fsdp", "amp"],
                    "launch": {"nproc": 2, "nnodes": 1, "max_restarts": 1}}

    out = loom("config", "show")
    assert out.exit_code == 0 and f"# {user} (user default)" in out.output
    assert "auto_accelerate(strategy=None) uses: Strategy[fsdp, amp]" in out.output
    assert "loom run uses: --nproc 2 --nnodes 1 --max-restarts 1" in out.output

    out = loom("run", "train.py", "--lr", "1")  # the file's settings where no flag is given
    assert out.exit_code == 0, out.output
    assert captured["opts"].nproc == 2 and captured["opts"].max_restarts == 1 and captured["env"] == str(user)
    assert f"[loom] config file {user} (user default): launch --nproc 2 --nnodes 1 --max-restarts 1" in out.output
    assert "strategy Strategy[fsdp, amp] for auto_accelerate(strategy=None)" in out.output

    out = loom("run", "--nproc", "1", "train.py")  # a flag given wins, even one equal to the default
    assert captured["opts"].nproc == "1" and captured["opts"].max_restarts == 1
    assert "(--nproc given on the command line win)" in out.output

    project = home / "work/torchloom.yaml"  # a project file comes first; writing elsewhere says so
    assert loom("config", "--file", str(project), "--default").exit_code == 0
    out = loom("config", "--nproc", "3")
    assert out.exit_code == 0 and "note: this file is not the one loom run and auto_accelerate read" in out.output
    assert f"{project} (working directory) comes first" in out.output
    assert f"replaced {user}" in out.output


def test_invalid_input_is_refused(home, captured):
    out = loom("config", "--strategy", "fsdpp")
    assert out.exit_code == 2 and "unknown strategy method 'fsdpp'. Did you mean 'fsdp'" in out.output
    assert not (home / "cache/default_config.yaml").exists()
    out = loom("config", "--nnodes", "two")
    assert out.exit_code == 2 and "nnodes must be N or MIN:MAX" in out.output
    bad = home / "work/torchloom.yaml"
    bad.write_text("config_version: 1\nlaunch: {nprocs: 2}\n")
    for args in (["config", "show"], ["run", "train.py"]):
        out = loom(*args)
        assert out.exit_code == 2 and f"config file {bad} (./torchloom.yaml in the working directory)" in out.output
        assert "unknown key 'nprocs'. Did you mean 'nproc'" in out.output and "TORCHLOOM_CONFIG_FILE=none" in out.output
    assert not captured  # nothing was launched
    out = loom("config", "--nproc", "2", "show")
    assert out.exit_code == 2 and "options of `loom config` itself" in out.output


def test_opt_out_and_explicit_file(home, captured, monkeypatch):
    (home / "work/torchloom.yaml").write_text("config_version: 1\nlaunch: {nproc: 3}\n")
    other = home / "other.yaml"
    other.write_text("config_version: 1\nlaunch: {nproc: 4}\n")
    assert loom("run", "--config-file", str(other), "t.py").exit_code == 0 and captured["opts"].nproc == 4
    monkeypatch.setenv(cf.ENV_VAR, "none")
    out = loom("run", "t.py")
    assert out.exit_code == 0 and captured["opts"].nproc == "1" and "[loom] config file" not in out.output
    assert "TORCHLOOM_CONFIG_FILE=none" in loom("config", "show").output
    monkeypatch.delenv(cf.ENV_VAR)
    out = loom("run", "--config-file", str(home / "missing.yaml"), "t.py")
    assert out.exit_code == 2 and "missing.yaml (the path given) does not exist" in out.output


def test_interactive_prompts(home, monkeypatch):
    monkeypatch.setattr(cli, "_stdin_is_tty", lambda: True)
    monkeypatch.setattr(cli, "_default_nproc", lambda: 1)
    # a bad answer is asked again; nnodes > 1 asks for the rendezvous
    answers = "fsdpp\nfsdp,checkpoint\n0\n2\n1:2\nnode0:29400\n\n1\n"
    out = loom("config", input=answers)
    assert out.exit_code == 0, out.output
    assert "unknown strategy method 'fsdpp'" in out.output and "nproc must be a positive integer" in out.output
    data = yaml.safe_load((home / "cache/default_config.yaml").read_text())
    assert data["strategy"] == ["fsdp", "checkpoint"]
    assert data["launch"] == {"nproc": 2, "nnodes": "1:2", "rdzv_endpoint": "node0:29400", "rdzv_id": "loom",
                              "max_restarts": 1}
    out = loom("config", "--default")  # asks nothing
    assert out.exit_code == 0 and "Strategy for" not in out.output


@pytest.mark.e2e
@pytest.mark.distributed
def test_real_loom_run_takes_nproc_from_the_file(tmp_path):
    """The launcher starts the file's 2 ranks and points them at the same file (what auto_accelerate reads)."""
    cfg = tmp_path / "torchloom.yaml"
    cfg.write_text("config_version: 1\nstrategy: [fsdp]\nlaunch: {nproc: 2}\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHLOOM_CONFIG_FILE=str(cfg))
    p = subprocess.run([sys.executable, "-m", "torchloom.cli", "run", str(HERE / "_echo.py"), str(tmp_path)],
                       cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=120)
    assert p.returncode == 0, p.stdout
    assert f"[loom] config file {cfg} ($TORCHLOOM_CONFIG_FILE): launch --nproc 2" in p.stdout
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text())["env"] for r in range(2)]
    assert [s["WORLD_SIZE"] for s in seen] == ["2", "2"]
    assert all(s["TORCHLOOM_CONFIG_FILE"] == str(cfg) for s in seen)
