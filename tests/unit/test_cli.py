"""The `loom` CLI and the launcher's torchrun argument building (no processes are started here)."""
import pytest
from click.testing import CliRunner

import torchloom
from torchloom import cli
from torchloom.elastic import launcher
from torchloom.elastic.launcher import LaunchOptions, build_run_args, failure_exit_code, worker_env


# ------------------------------------------------------------------------------ argument building
def test_default_is_standalone_single_node():
    args = build_run_args(LaunchOptions(nproc=2), "train.py", ["--lr", "1e-3"])
    assert args == ["--nproc-per-node", "2", "--nnodes", "1", "--standalone", "train.py", "--lr", "1e-3"]


def test_module_target():
    args = build_run_args(LaunchOptions(nproc=2), "torchloom.train.job", ["smoke"], module=True)
    assert args[-3:] == ["-m", "torchloom.train.job", "smoke"]


def test_rendezvous_options_pass_through():
    opts = LaunchOptions(nproc=4, nnodes="1:2", rdzv_endpoint="node0:29400", rdzv_id="job7",
                         rdzv_conf="join_timeout=30", max_restarts=3, monitor_interval=0.5)
    args = build_run_args(opts, "t.py")
    assert "--standalone" not in args
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--nproc-per-node"] == "4" and pairs["--nnodes"] == "1:2"
    assert pairs["--rdzv-backend"] == "c10d"  # implied by an endpoint
    assert pairs["--rdzv-endpoint"] == "node0:29400" and pairs["--rdzv-id"] == "job7"
    assert pairs["--rdzv-conf"] == "join_timeout=30"
    assert pairs["--max-restarts"] == "3" and pairs["--monitor-interval"] == "0.5"
    assert args[-1] == "t.py"


def test_static_rendezvous_with_master_addr():
    opts = LaunchOptions(nproc=1, nnodes="2", node_rank=1, master_addr="10.0.0.1", master_port=29501)
    args = build_run_args(opts, "t.py")
    assert "--standalone" not in args and "--rdzv-backend" not in args
    assert args[args.index("--master-addr") + 1] == "10.0.0.1"
    assert args[args.index("--master-port") + 1] == "29501"
    assert args[args.index("--node-rank") + 1] == "1"


def test_explicit_backend_and_multi_node_are_not_standalone():
    assert "--standalone" not in build_run_args(LaunchOptions(rdzv_backend="c10d"), "t.py")
    assert "--standalone" not in build_run_args(LaunchOptions(nnodes="2"), "t.py")
    assert "--standalone" in build_run_args(LaunchOptions(nnodes="1:1"), "t.py")


def test_built_args_parse_with_torchrun():
    from torch.distributed.run import parse_args

    a = parse_args(build_run_args(LaunchOptions(nproc=2, max_restarts=2), "mod.x", ["--foo", "1"], module=True))
    assert a.nproc_per_node == "2" and a.standalone and a.module and a.max_restarts == 2
    assert a.training_script == "mod.x" and a.training_script_args == ["--foo", "1"]


@pytest.mark.parametrize("bad", [0, -1, "two", ""])
def test_bad_nproc(bad):
    with pytest.raises(ValueError, match="--nproc"):
        build_run_args(LaunchOptions(nproc=bad), "t.py")


def test_no_target():
    with pytest.raises(ValueError, match="nothing to run"):
        build_run_args(LaunchOptions(), "")


def test_worker_env(monkeypatch):
    monkeypatch.setattr(launcher, "usable_cores", lambda: 8)
    env = worker_env(LaunchOptions(nproc=2), environ={})
    assert env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "OMP_NUM_THREADS": "4"}
    assert worker_env(LaunchOptions(nproc=16), environ={})["OMP_NUM_THREADS"] == "1"
    # what the user set wins
    assert worker_env(LaunchOptions(nproc=2), environ={"OMP_NUM_THREADS": "3",
                                                       "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}) == {}


def test_failure_exit_codes():
    assert failure_exit_code(3) == 3
    assert failure_exit_code(-6) == 134  # SIGABRT
    assert failure_exit_code(-9) == 137
    assert failure_exit_code(None) == 1


# ---------------------------------------------------------------------------------------- click
@pytest.fixture
def captured(monkeypatch):
    """Replace the launcher and the process exit: record what `loom` would run."""
    calls = {}

    def fake_run(opts, target, args, module=False):
        calls.update(opts=opts, target=target, args=args, module=module)
        return 5

    def fake_exit(code):
        raise SystemExit(code)

    monkeypatch.setattr(launcher, "run", fake_run)
    monkeypatch.setattr(cli, "_exit", fake_exit)
    # `loom train` claims its output dir (runs/..., /tmp/x) before launching: not these tests' subject
    from torchloom.train import run_lock

    monkeypatch.setattr(run_lock, "claim", lambda out, **kw: run_lock.OutputDirLock(out))
    monkeypatch.setenv(run_lock.CLAIMED_ENV, "")  # restored after the test (the CLI sets it for its workers)
    return calls


def test_help_and_version():
    r = CliRunner()
    out = r.invoke(cli.main, ["--help"])
    assert out.exit_code == 0 and all(c in out.output for c in ("run", "train", "ckpt"))
    out = r.invoke(cli.main, ["--version"])
    assert out.exit_code == 0 and torchloom.__version__ in out.output
    for sub in (["run", "--help"], ["train", "--help"], ["ckpt", "--help"], ["ckpt", "export", "--help"],
                ["ckpt", "list", "--help"]):
        out = r.invoke(cli.main, sub)
        assert out.exit_code == 0, (sub, out.output)
    assert "--rdzv-endpoint" in r.invoke(cli.main, ["run", "--help"]).output
    assert "--max-steps-this-run" in r.invoke(cli.main, ["train", "--help"]).output


def test_run_passes_script_args_verbatim(captured):
    out = CliRunner().invoke(cli.main, ["run", "--nproc", "3", "--max-restarts", "1", "train.py", "--nproc", "9",
                                        "-m", "x"])
    assert out.exit_code == 5  # the job's exit code
    assert captured["target"] == "train.py" and captured["args"] == ["--nproc", "9", "-m", "x"]
    assert captured["module"] is False and captured["opts"].nproc == "3" and captured["opts"].max_restarts == 1


def test_run_module(captured):
    out = CliRunner().invoke(cli.main, ["run", "-m", "pkg.mod", "a"])
    assert out.exit_code == 5 and captured["module"] is True and captured["target"] == "pkg.mod"
    assert captured["opts"].nproc == "1"


def test_run_without_target_is_a_usage_error(captured):
    out = CliRunner().invoke(cli.main, ["run", "--nproc", "2"])
    assert out.exit_code == 2 and "script" in out.output and not captured


def test_train_launches_the_job_module(captured):
    out = CliRunner().invoke(cli.main, ["train", "smoke", "--output-dir", "/tmp/x", "--set", "train.steps=3",
                                        "--max-steps-this-run", "2"])
    assert out.exit_code == 5, out.output
    assert captured["module"] is True and captured["target"] == "torchloom.train.job"
    assert captured["args"] == ["smoke", "--output-dir", "/tmp/x", "--set", "train.steps=3",
                                "--max-steps-this-run", "2"]
    assert captured["opts"].nproc == "2"  # loom train defaults to 2 processes


def test_train_bad_config_fails_before_launch(captured):
    out = CliRunner().invoke(cli.main, ["train", "--set", "train.bogus=1"])
    assert out.exit_code == 2 and "train.bogus" in out.output and not captured
    out = CliRunner().invoke(cli.main, ["train", "no_such_config.yaml"])
    assert out.exit_code == 2 and "does not exist" in out.output and not captured
    out = CliRunner().invoke(cli.main, ["train", "smoke", "--set", "data.eval_plays=[hamlet, hamlett]"])
    assert out.exit_code == 2 and "hamlett" in out.output and "tempest" in out.output and not captured


def test_ckpt_list_empty(tmp_path):
    out = CliRunner().invoke(cli.main, ["ckpt", "list", str(tmp_path)])
    assert out.exit_code == 0 and "no checkpoints" in out.output


# ------------------------------------------------------------------- script arguments stay the script's
# torchrun's argparse parser expands unambiguous prefixes of its own options and stops on ambiguous ones
# (allow_abbrev): `--d` (--duplicate-stdout-filters...), `--n` (--nnodes, --nproc-per-node...), `--sig`,
# `--shutdown`. Everything after the script must reach the script verbatim, exact torchrun flags included.
TRICKY_SCRIPT_ARGS = ["--d", "48", "--n", "3", "--sig", "x", "--shutdown", "--nnodes", "5", "--standalone",
                      "--nproc-per-node=7", "--", "-h", "--max-r", "2"]


@pytest.mark.parametrize("module", [False, True])
def test_launch_hands_script_args_to_torchrun_unparsed(monkeypatch, module):
    """launcher.run parses only the launcher's part with torchrun's parser (nothing starts: torchrun's
    run() is replaced by a recorder)."""
    import torch.distributed.run as torchrun

    seen = {}
    monkeypatch.setattr(torchrun, "run", lambda args: seen.setdefault("args", args))
    monkeypatch.setattr(launcher, "worker_env", lambda opts: {})
    code = launcher.run(LaunchOptions(nproc=2, max_restarts=1), "mod.x" if module else "train.py",
                        TRICKY_SCRIPT_ARGS, module=module)
    assert code == 0 and "args" in seen, f"torchrun's parser rejected the script's arguments (exit code {code})"
    a = seen["args"]
    assert a.training_script == ("mod.x" if module else "train.py") and a.module is module
    assert a.training_script_args == TRICKY_SCRIPT_ARGS
    assert a.nproc_per_node == "2" and a.nnodes == "1" and a.standalone and a.max_restarts == 1


def test_run_rejects_a_mistyped_launcher_option(captured):
    """An unknown option before the script is a usage error, not a script named '--nprocs'."""
    out = CliRunner().invoke(cli.main, ["run", "--nprocs", "2", "train.py"])
    assert out.exit_code == 2 and "--nprocs" in out.output and not captured


def test_train_checks_tp_and_pp_against_the_model_before_launch(captured):
    """The smoke model has 4 query heads, 2 kv heads, 2 layers (5 pipeline units: embedding, 2 blocks, norm,
    head): tp=4 and pp=6 must be refused before any process starts, naming the key and the valid values."""
    out = CliRunner().invoke(cli.main, ["train", "smoke", "--nproc", "4", "--set", "parallel.tp=4"])
    assert out.exit_code == 2 and not captured, out.output
    assert "parallel.tp=4" in out.output and "model.num_kv_heads=2" in out.output, out.output
    assert "Valid parallel.tp for this model: 1, 2" in out.output, out.output
    out = CliRunner().invoke(cli.main, ["train", "smoke", "--nproc", "6", "--set", "parallel.pp=6",
                                        "--set", "parallel.pp_microbatches=1", "--set", "parallel.pp_schedule=gpipe"])
    assert out.exit_code == 2 and not captured, out.output
    assert "parallel.pp=6" in out.output and "model.num_layers=2" in out.output, out.output
    assert "Valid parallel.pp for this model: 1, 2, 3, 4, 5" in out.output, out.output
    out = CliRunner().invoke(cli.main, ["train", "smoke", "--nproc", "4", "--set", "parallel.tp=2",
                                        "--set", "parallel.pp=2"])
    assert out.exit_code == 5 and captured["target"] == "torchloom.train.job", out.output  # fits: launched


def test_a_warning_is_one_clean_line_while_a_loom_command_runs(monkeypatch):
    """Python would print the warning's file, line and source line (``hws = [local_hardware(...)]``: torchloom's
    code, not the user's); under ``loom`` it is ``warning: <message>``, and the previous display is back after."""
    import warnings

    from torchloom.errors import StrategyError
    from torchloom.search import plan_cli

    def plan(*_a, **_kw):
        warnings.simplefilter("always")  # pytest's configuration ignores UserWarning
        warnings.warn("calibrated under load: the figures are provisional", UserWarning)
        warnings.warn("old API", FutureWarning)
        raise StrategyError("stop here")

    monkeypatch.setattr(plan_cli, "plan", plan)
    shown = warnings.showwarning
    r = CliRunner().invoke(cli.main, ["plan", "default"])
    assert r.exit_code == 2, r.output
    assert r.stderr.splitlines() == ["warning: calibrated under load: the figures are provisional",
                                     "warning: FutureWarning: old API", "error: stop here"], r.stderr
    assert warnings.showwarning is shown
