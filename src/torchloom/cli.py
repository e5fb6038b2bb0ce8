"""The ``loom`` command line: ``loom run`` (launcher), ``loom train`` (the reference job), ``loom config`` (the
config file) and ``loom ckpt``.

See ``docs/launch.md``, ``docs/train.md`` and ``docs/config.md``.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import click

from . import __version__


def _exit(code: int) -> None:
    """Leave with ``code`` through the reliable shutdown (flush, ``os._exit``)."""
    from .elastic.shutdown import clean_exit

    clean_exit(int(code))


def launch_options(default_nproc: int | str, nproc_shown: str | None = None):
    """The torchrun options shared by ``loom run``, ``loom train`` and ``loom config`` (``nproc_shown``: the
    default ``--help`` shows for ``--nproc`` when the command computes it)."""
    def deco(f):
        opts = [
            click.option("--nproc", "--nproc-per-node", "nproc", default=str(default_nproc),
                         show_default=nproc_shown or True, help="processes per node: an integer or auto/cpu/gpu/xpu"),
            click.option("--nnodes", default="1", show_default=True, help="nodes: N or MIN:MAX (elastic)"),
            click.option("--node-rank", type=int, default=None, help="this node's rank (static rendezvous)"),
            click.option("--rdzv-backend", default=None, help="rendezvous backend (c10d, etcd, static, ...)"),
            click.option("--rdzv-endpoint", default=None, help="rendezvous HOST:PORT"),
            click.option("--rdzv-id", default=None, help="job id shared by all nodes"),
            click.option("--rdzv-conf", default=None, help="extra rendezvous config, key1=v1,key2=v2"),
            click.option("--max-restarts", type=int, default=None, help="worker-group restarts on failure"),
            click.option("--monitor-interval", type=float, default=None, help="seconds between worker checks"),
            click.option("--master-addr", default=None, help="static rendezvous: address of node 0"),
            click.option("--master-port", type=int, default=None, help="static rendezvous: port on node 0"),
            click.option("--log-dir", default=None, help="directory for worker logs"),
            click.option("--redirects", default=None, help="redirect worker std streams to --log-dir (0-3)"),
            click.option("--tee", default=None, help="tee worker std streams to console and --log-dir (0-3)"),
            click.option("--local-ranks-filter", default=None, help="show console output of these local ranks only"),
        ]
        for o in reversed(opts):
            f = o(f)
        return f

    return deco


_LAUNCH_KEYS = ("nproc", "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
                "max_restarts", "monitor_interval", "master_addr", "master_port", "log_dir", "redirects", "tee",
                "local_ranks_filter")


def health_options(f):
    """``--health-check`` and its settings, shared by ``loom run`` and ``loom train`` (docs/health.md)."""
    opts = [
        click.option("--health-check", is_flag=True,
                     help="before the job, benchmark every rank (matmul, all-reduce); refuse to start if one is "
                          "failing or slow"),
        click.option("--health-threshold", type=float, default=0.5, show_default=True,
                     help="a rank is slow below this fraction of the median matmul GFLOP/s"),
        click.option("--health-timeout", type=float, default=60.0, show_default=True,
                     help="seconds to wait for each rank's health result"),
        click.option("--exclude-unhealthy", is_flag=True,
                     help="with --nnodes MIN:MAX: a node that fails the check leaves; the job starts on the rest"),
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def _preflight(opts, kw: dict) -> None:
    """Run the ``--health-check`` gate; leave with its code when the job must not start on this node."""
    check, threshold = kw.pop("health_check"), kw.pop("health_threshold")
    timeout, exclude = kw.pop("health_timeout"), kw.pop("exclude_unhealthy")
    if exclude and not check:
        raise click.UsageError("--exclude-unhealthy needs --health-check.")
    if not check:
        return
    from .elastic import health

    try:
        code = health.preflight(opts, threshold=threshold, timeout_s=timeout, exclude_unhealthy=exclude)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if code:
        _exit(code)


def _launch_opts(kw: dict):
    from .elastic.launcher import LaunchOptions

    return LaunchOptions(**{k: kw.pop(k) for k in _LAUNCH_KEYS})


class _BadInput(click.ClickException):
    """A bad file or value: ``error: ...`` and exit code 2, without the usage text."""

    exit_code = 2

    def show(self, file=None) -> None:
        click.echo(f"error: {self.format_message()}", err=True)


def _given(name: str) -> bool:
    """Whether option ``name`` of the running command was given on its command line (not a default)."""
    from click.core import ParameterSource

    return click.get_current_context().get_parameter_source(name) not in (
        None, ParameterSource.DEFAULT, ParameterSource.DEFAULT_MAP)


def _apply_config_file(kw: dict, explicit: str | None) -> None:
    """``loom run``: take the config file's launch settings where no flag was given, say so on stderr, and point
    the workers at the same file (``auto_accelerate(strategy=None)`` reads its strategy there)."""
    from .strategy import config_file as cf

    try:
        found = cf.find(explicit)
    except cf.ConfigFileError as e:
        raise _BadInput(str(e)) from e
    if found is None:
        return
    taken = {k: v for k, v in found.launch.items() if not _given(k)}
    kw.update(taken)
    line = f"[loom] config file {found.path} ({found.source}): launch " + (
        " ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items()) or "settings: none")
    won = [f"--{k.replace('_', '-')}" for k in found.launch if k not in taken]
    if won:
        line += f" ({', '.join(won)} given on the command line win)"
    line += ("; no strategy" if found.strategy is None else
             f"; strategy {found.strategy!r} for auto_accelerate(strategy=None)")
    click.echo(line, err=True)
    os.environ[cf.ENV_VAR] = str(found.path)  # the workers read this file, whatever their working directory


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", "-V", prog_name="torchloom")
@click.pass_context
def main(ctx: click.Context) -> None:
    """torchloom: single-device PyTorch training code to distributed training with one call."""
    ctx.with_resource(one_line_warnings())  # for the command's run only (restored after, e.g. in tests)


@contextlib.contextmanager
def one_line_warnings():
    """While a ``loom`` command runs, a Python warning is one line on stderr: ``warning: <message>`` (the
    category named when it is not a ``UserWarning``), without the file, line and source line Python adds
    (they point into torchloom or torch, not at anything the user typed). Filters are unchanged; the previous
    ``warnings.showwarning`` is restored after."""
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        yield


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    kind = "" if category is UserWarning else f"{category.__name__}: "
    try:
        (file or sys.stderr).write(f"warning: {kind}{message}\n")
    except (OSError, ValueError):  # a closed stream: as Python's own showwarning, never fail the caller
        pass


# ------------------------------------------------------------------------------------------- run
@main.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@launch_options(default_nproc=1)
@health_options
@click.option("-m", "--module", "module", is_flag=True, help="TARGET is a module name (python -m TARGET)")
@click.option("--config-file", default=None, type=click.Path(dir_okay=False),
              help="the torchloom config file to take launch settings from (default: the lookup of "
                   "docs/config.md; TORCHLOOM_CONFIG_FILE=none reads none)")
@click.argument("target", required=False)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def run(module: bool, config_file: str | None, target: str | None, args: tuple[str, ...], **kw) -> None:
    """Run TARGET (a script, or -m MODULE) on --nproc processes per node with torchrun.

    Everything after TARGET is passed to it. Exits with the job's exit code. Launch settings not given as
    flags come from the torchloom config file when there is one (`loom config`; the line it prints names it).

    \b
    Examples:
      loom run --nproc 2 train.py --lr 1e-3
      loom run --nproc 4 -m mypkg.train
      loom run --nnodes 2 --nproc 8 --rdzv-endpoint node0:29400 --rdzv-id job1 train.py
    """
    from .elastic import launcher

    if not target:
        raise click.UsageError("give a script to run, or -m MODULE.")
    if target.startswith("-"):  # unknown options are let through for the script; before it they are typos
        raise click.UsageError(f"no such option: {target} (loom run's options go before the script, see "
                               "--help; everything after the script is passed to it; a script whose name starts "
                               f"with '-' is ./{target}).")
    _apply_config_file(kw, config_file)
    opts = _launch_opts(kw)
    _preflight(opts, kw)
    try:
        code = launcher.run(opts, target, list(args), module=module)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    _exit(code)


# ---------------------------------------------------------------------------------------- config
@main.group("config", invoke_without_command=True)
@click.option("--file", "path", default=None, type=click.Path(dir_okay=False),
              help="where to write (default: $TORCHLOOM_CONFIG_FILE, else the user default "
                   "~/.cache/torchloom/default_config.yaml; ./torchloom.yaml is a per-project file)")
@click.option("--strategy", default=None,
              help="methods for auto_accelerate(strategy=None): fsdp,amp or a JSON/YAML list "
                   "'[fsdp, {amp: {dtype: bfloat16}}]', or none")
@launch_options(default_nproc=1, nproc_shown="the GPUs of this machine, else 1")
@click.option("--default", "defaults", is_flag=True, help="ask nothing: what is not given takes its default")
@click.pass_context
def config(ctx, path: str | None, strategy: str | None, defaults: bool, **kw) -> None:
    """Write a torchloom config file: a default strategy for auto_accelerate(strategy=None) and launch
    settings for `loom run` (its flags win). See docs/config.md.

    In a terminal with no option given it asks; otherwise it writes the options given (launch options as
    `loom run` takes them; --nproc and --nnodes always, other launch options only when given).

    \b
    Examples:
      loom config
      loom config --strategy fsdp,amp --nproc 2
      loom config --default --file torchloom.yaml
      loom config show
    """
    if ctx.invoked_subcommand is not None:
        given = [f"--{p.replace('_', '-')}" for p in ctx.params if _given(p)]
        if given:
            raise click.UsageError(f"{', '.join(given)}: options of `loom config` itself, not of `loom config "
                                   f"{ctx.invoked_subcommand}` (e.g. `loom config show --file PATH`).")
        return
    from .strategy import config_file as cf

    try:
        target = cf.write_target(path)
        interactive = not defaults and _stdin_is_tty() and not any(_given(p) for p in ("strategy", *_LAUNCH_KEYS))
        if interactive:
            strategy, kw = _ask_config(kw)
        launch = {k: kw[k] for k in _LAUNCH_KEYS if k in ("nproc", "nnodes") or _given(k) or interactive
                  and kw.get(k) is not None}
        if not _given("nproc") and not interactive:
            launch["nproc"] = _default_nproc()
        data = {"config_version": cf.CONFIG_VERSION, "strategy": _strategy_value(strategy), "launch": launch}
        cfg = cf.parse(data, target, "--file")
        existed = target.exists()
        cfg.save(target)
    except cf.ConfigFileError as e:
        raise _BadInput(str(e)) from e
    click.echo(f"{'replaced' if existed else 'wrote'} {target}:")
    click.echo(cfg.to_yaml(), nl=False)
    try:
        in_use = cf.locate()
    except cf.ConfigFileError:
        in_use = None
    if in_use is None or in_use[0] != target:
        why = f"{in_use[0]} ({in_use[1]}) comes first" if in_use else "it is not on the lookup path"
        click.echo(f"note: this file is not the one loom run and auto_accelerate read: {why}. Lookup order: "
                   f"{'; '.join(cf.lookup_order())} (docs/config.md); use it with --config-file {target} or "
                   f"{cf.ENV_VAR}={target}.", err=True)


@config.command("show")
@click.option("--file", "path", default=None, type=click.Path(dir_okay=False),
              help="show this file (default: the one the lookup finds)")
def config_show(path: str | None) -> None:
    """Print the config file in use (validated) and what `loom run` and auto_accelerate take from it."""
    from .strategy import config_file as cf

    try:
        found = cf.find(path)
    except cf.ConfigFileError as e:
        raise _BadInput(str(e)) from e
    if found is None:
        off = os.environ.get(cf.ENV_VAR, "").strip().lower() == cf.OFF
        click.echo(f"no torchloom config file is read ({cf.ENV_VAR}=none)." if off else
                   "no torchloom config file; looked at, in order:\n" +
                   "".join(f"  {i}. {p}\n" for i, p in enumerate(cf.lookup_order(), 1)) +
                   "write one with `loom config`.")
        return
    click.echo(f"# {found.path} ({found.source})")
    click.echo(found.to_yaml(), nl=False)
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in found.launch.items()) or "nothing"
    click.echo(f"# auto_accelerate(strategy=None) uses: "
               f"{'plain data parallel (no strategy here)' if found.strategy is None else repr(found.strategy)}")
    click.echo(f"# loom run uses: {flags} (where its own flags are not given)")


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


def _default_nproc() -> int:
    """What `loom config` writes for --nproc when not given: one process per GPU, else 1."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def _strategy_value(text: str | None):
    """``--strategy`` text as the file's list of methods (None for none); the same forms as `loom plan`'s."""
    from .search.plan_cli import parse_strategy_option
    from .strategy import config_file as cf

    if text is None or text.strip().lower() in ("", "none", "null"):
        return None
    try:
        return cf.compact_methods(parse_strategy_option(text))
    except cf.StrategyError as e:
        raise cf.ConfigFileError(f"--strategy {text!r}: {e}") from e


def _ask_config(kw: dict) -> tuple[str | None, dict]:
    """The questions of an interactive `loom config`; each answer is checked as it is given."""
    from .strategy import config_file as cf

    def check(key):
        def proc(value):
            try:
                return cf.parse({"config_version": 1, "launch": {key: value}}).launch[key]  # checked as on read
            except cf.ConfigFileError as e:
                raise click.BadParameter(str(e).split("launch: ", 1)[-1]) from e
        return proc

    def check_strategy(value):
        try:
            _strategy_value(value)
        except cf.ConfigFileError as e:
            raise click.BadParameter(str(e)) from e
        return value

    kw = dict(kw)
    strategy = click.prompt("Strategy for auto_accelerate(strategy=None): methods, comma-separated (e.g. fsdp,amp), "
                            "or none", default="none", value_proc=check_strategy)
    kw["nproc"] = click.prompt("Processes per node (loom run --nproc)", default=str(_default_nproc()),
                               value_proc=check("nproc"))
    kw["nnodes"] = click.prompt("Nodes: N, or MIN:MAX for an elastic job", default="1", value_proc=check("nnodes"))
    if kw["nnodes"] != "1":
        kw["rdzv_endpoint"] = click.prompt("Rendezvous endpoint HOST:PORT (on one of the nodes)",
                                           value_proc=check("rdzv_endpoint"))
        kw["rdzv_id"] = click.prompt("Job id, the same on every node", default="loom", value_proc=check("rdzv_id"))
        kw["max_restarts"] = click.prompt("Restarts of the worker group on failure", default="0",
                                          value_proc=lambda v: check("max_restarts")(int(v) if v.isdigit() else v))
    return strategy, kw


# ----------------------------------------------------------------------------------------- train
@main.command()
@click.argument("config", required=False)
@launch_options(default_nproc=2)
@health_options
@click.option("--output-dir", default=None, help="where metrics, checkpoints and weights go (overrides output_dir)")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="override one config value, e.g. --set train.steps=100 (repeatable)")
@click.option("--max-steps-this-run", type=int, default=None, metavar="K",
              help="stop after K steps and save a checkpoint (re-run the same command to resume; "
                   "--set checkpoint.save_on_stop=false stops like a crash)")
@click.option("--no-launch", is_flag=True, help="run the job in this process (no launcher; used by workers)")
def train(config: str | None, output_dir: str | None, overrides: tuple[str, ...], max_steps_this_run: int | None,
          no_launch: bool, **kw) -> None:
    """Train the reference LLaMA-style model on Shakespeare.

    CONFIG is a YAML file or a packaged config name (default, smoke); without it the default config runs.
    The job resumes from the newest complete checkpoint in the output dir; an output dir holding a run of
    another model (model sizes, MoE, vocabulary), a checkpoint it cannot resume (another train.seed, a batch
    layout its data position does not fall on) and one another run trains in are refused before anything starts
    (exit 2; the message says what to do).

    \b
    Examples:
      loom train
      loom train smoke --output-dir /tmp/smoke
      loom train my.yaml --set train.steps=500 --set strategy=[fsdp]
    """
    from .errors import TorchloomError
    from .train.config import ConfigError, TrainConfig

    job_args: list[str] = [config] if config else []
    if output_dir is not None:
        job_args += ["--output-dir", output_dir]
    for item in overrides:
        job_args += ["--set", item]
    if max_steps_this_run is not None:
        job_args += ["--max-steps-this-run", str(max_steps_this_run)]
    if no_launch:
        from .train.job import main as job_main

        job_main(job_args)  # never returns
        return
    try:  # fail fast, before any process starts
        cfg = TrainConfig.load(config or "default", list(overrides), output_dir)
        from .train.corpus import check_eval_plays

        check_eval_plays(cfg.data.eval_plays)
        _check_fits(cfg, kw)
        from .train.run_dir import check_output_dir, check_resume_layout

        check_output_dir(cfg)  # a run of another model, or another seed: refused before anything is written
        if _fixed_world(kw) is not None:
            check_resume_layout(cfg, _fixed_world(kw))  # a batch layout the checkpoint's data position misses
        from .train.run_lock import CLAIMED_ENV, claim

        # one run per output dir: held until this launcher exits (the kernel releases it, also on SIGKILL)
        dir_lock = claim(cfg.output_dir, job=_multinode_job(kw))
        os.environ[CLAIMED_ENV] = str(Path(cfg.output_dir).resolve())  # its workers hold the workers' lock
    except (ConfigError, TorchloomError) as e:
        click.echo(f"error: {e}", err=True)
        _exit(2)
    if max_steps_this_run is not None and max_steps_this_run < 1:
        raise click.BadParameter("must be >= 1", param_hint="--max-steps-this-run")
    from .elastic import launcher

    opts = _launch_opts(kw)
    _preflight(opts, kw)
    try:
        code = launcher.run(opts, "torchloom.train.job", job_args, module=True)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    _exit(code)
    dir_lock.release()  # (_exit does not return; tests replace it)


def _multinode_job(kw: dict) -> str | None:
    """None for a single-node launch; else the key its launchers share (rendezvous endpoint and id), so the
    launchers of one multi-node job on one machine share the output dir's lock (:func:`.train.run_lock.claim`)."""
    from .elastic.launcher import LaunchOptions

    if LaunchOptions(nnodes=str(kw.get("nnodes") or "1")).single_node():
        return None
    where = kw.get("rdzv_endpoint") or f"{kw.get('master_addr')}:{kw.get('master_port')}"
    return f"{where}/{kw.get('rdzv_id') or 'none'}"


def _fixed_world(kw: dict) -> int | None:
    """The number of processes a launch with these options starts, when fixed (None: auto / elastic ranges)."""
    nproc, nnodes = str(kw.get("nproc")), str(kw.get("nnodes") or "1")
    return int(nproc) * int(nnodes) if nproc.isdigit() and nnodes.isdigit() else None


def _check_fits(cfg, kw: dict) -> None:
    """With a fixed number of processes, check the mesh and the batch split before starting any (a bad fit
    would otherwise surface as one traceback per rank after the corpus is loaded)."""
    world = _fixed_world(kw)
    if world is not None:  # auto / elastic ranges: the workers check it (Job.setup)
        cfg.check_fits(world)


# ----------------------------------------------------------------------------------------- check
@main.command()
@launch_options(default_nproc=1)
@click.option("--threshold", type=float, default=0.5, show_default=True,
              help="a rank is slow below this fraction of the median matmul GFLOP/s")
@click.option("--timeout", type=float, default=60.0, show_default=True,
              help="seconds to wait for each rank's result")
@click.option("--json", "as_json", is_flag=True, help="also print the report as one JSON line")
def check(threshold: float, timeout: float, as_json: bool, **kw) -> None:
    """Health-check the ranks a job would get: fp32 matmul GFLOP/s and all-reduce time per rank.

    Prints a table (rank, host, local rank, GFLOP/s, all-reduce ms, verdict). Exit code 0 when every
    rank is healthy, 1 when a rank failed, timed out or is slower than THRESHOLD x the median.

    \b
    Examples:
      loom check --nproc 4
      loom check --nnodes 2 --nproc 8 --rdzv-endpoint node0:29400 --rdzv-id job1
    """
    from .elastic import health

    opts = _launch_opts(kw)
    try:
        code, report = health.launch_check(opts, threshold=threshold, timeout_s=timeout)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    if report is None:
        click.echo(f"error: the health check produced no report (exit code {code}); see the worker output above.",
                   err=True)
        _exit(code or 1)
    if as_json:
        click.echo(report.to_json())
    _exit(0 if report.healthy else 1)


# ------------------------------------------------------------------------------------------ plan
class _PlanCommand(click.Command):
    """``loom plan``: a usage error (a bad option value, no MODEL) under ``--json`` also prints the JSON error
    object on stdout (:func:`torchloom.search.plan_cli.json_error`), as every other exit 2 does."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        as_json = "--json" in args  # before parsing, which consumes args
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as e:
            if as_json:
                from .search.plan_cli import json_error

                click.echo(json_error(e.format_message()))
            raise


@main.command(cls=_PlanCommand)
@click.argument("model")
@click.option("--gpu", default=None, help="accelerator of the cluster: h100, h100-pcie, a100, a100-40gb, h200, b200, "
                                          "mi300x, ...")
@click.option("--gpus", type=int, default=None, help="devices in the job")
@click.option("--gpus-per-node", type=int, default=None, help="devices per node (required above 8 GPUs)")
@click.option("--local", is_flag=True, help="plan for this machine (calibrated once, then cached)")
@click.option("--nproc", type=int, default=None, help="with --local: processes (default 1)")
@click.option("--seq-len", type=int, default=None, help="tokens per sample (default: the model's)")
@click.option("--global-batch", type=int, default=None, help="samples per optimizer step (default: one per device)")
@click.option("--micro-batch", type=int, default=None, help="samples per rank per forward (default: searched)")
@click.option("--strategy", default=None, help="evaluate this strategy instead of searching: fsdp,amp or a "
                                               "JSON/YAML list or a strategy file")
@click.option("--exclude", default=None, help="search: names to leave out, e.g. pipeline_parallel,zero1")
@click.option("--include", default=None, help="search: names every candidate must use, e.g. compile (the blocks and "
                                              "a Hugging Face model's loss), checkpoint, float8")
@click.option("--fix", "fixed", multiple=True, metavar="DIM=N", help="search: pin a degree, e.g. --fix tp=8")
@click.option("--top", type=int, default=10, show_default=True, help="rows to show")
@click.option("--explain", type=int, default=None, metavar="N", help="print candidate N's full breakdown")
@click.option("--json", "as_json", is_flag=True, help="print the result as JSON")
@click.option("--sample", default=None, metavar="PKG.MODULE:FN",
              help="factory model: a function returning one batch at micro-batch 1 (built on meta)")
@click.option("--input-format", default=None, type=click.Choice(["unpack_sequence", "unpack_dict"]),
              help="factory model: pass the --sample batch as forward(*batch) / forward(**batch)")
def plan(model: str, **kw) -> None:
    """Rank strategies for MODEL on a cluster with the cost model: nothing runs, the model is never allocated.

    MODEL is a built-in name (llama3-8b, llama3-70b, llama3.1-405b, mixtral-8x7b, default), a Hugging Face
    config.json, or a factory pkg.module:function. Exit code (the same with --json, whose "fits" says it): 0;
    1 when nothing fits or the --strategy given does not; 2 for bad input (a bad or missing config field, a size
    above the sanity bounds, ...; with --json also {"fits": false, "error": ..., "exit_code": 2} on stdout). A
    plan that runs long says on stderr what it is doing.

    \b
    Examples:
      loom plan llama3-70b --gpu h100 --gpus 1024 --gpus-per-node 8
      loom plan llama3-8b --gpu h100 --gpus 8 --global-batch 16 --strategy fsdp,amp,checkpoint --explain 1
      loom plan llama3-8b --gpu h100 --gpus 64 --global-batch 128 --include compile
      loom plan default --local --nproc 4 --global-batch 16 --json
    """
    from .search.plan_cli import run_command

    sys.exit(run_command(model, **kw))


# ------------------------------------------------------------------------------------- calibrate
@main.command()
@click.option("--nproc", default=None, metavar="N[,N...]",
              help="ranks per node to calibrate for, comma-separated (default: 1,2,4 on CPU, the GPU count on CUDA)")
@click.option("--refresh", is_flag=True, help="measure again even when a calibration is cached")
@click.option("--budget", type=float, default=10.0, show_default=True,
              help="measurement seconds per level (starting the ranks comes on top)")
@click.option("--cache-dir", default=None, help="where calibrations are cached (default: $TORCHLOOM_CACHE_DIR/hardware, else ~/.cache/torchloom/hardware)")
@click.option("--json", "as_json", is_flag=True, help="print the calibrations as JSON")
def calibrate(nproc: str | None, refresh: bool, budget: float, cache_dir: str | None, as_json: bool) -> None:
    """Calibrate this machine for the planner: matmul FLOP/s, memory bandwidth and collective times.

    Each level starts that many local ranks that measure at the same time (co-located ranks share cores), and is
    cached per machine fingerprint; see docs/calibration.md.

    \b
    Examples:
      loom calibrate
      loom calibrate --nproc 4 --refresh
      loom calibrate --nproc 1,2 --json
    """
    from .cost.calibrate_cli import run_command

    _exit(run_command(nproc, refresh, budget, cache_dir, as_json))


# ------------------------------------------------------------------------------------------ ckpt
@main.group()
def ckpt() -> None:
    """Inspect and convert checkpoints."""


@ckpt.command("list")
@click.argument("root", type=click.Path(exists=True, file_okay=False, path_type=Path))
def ckpt_list(root: Path) -> None:
    """List the checkpoints under ROOT (a checkpoint root, or a training output dir)."""
    from .checkpoint import commit
    from .errors import CheckpointError

    if not commit.list_checkpoints(root) and (root / "checkpoints").is_dir():
        root = root / "checkpoints"
    rows = commit.list_checkpoints(root)
    tmp = sorted(p.name for p in root.iterdir() if p.name.startswith(commit.TMP_PREFIX))
    if not rows and not tmp:
        click.echo(f"no checkpoints under {root}")
        return
    latest = commit.latest_complete(root)
    click.echo(f"{'step':>10}  {'status':<10}  {'world':>5}  {'size':>10}  {'saved (UTC)':<20}  path")
    for step, path in rows:
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        try:
            m = commit.verify(path)
            status, world, when = "complete", str(m.world_size), _iso(m.time)
        except CheckpointError:
            status, world, when = "INCOMPLETE", "-", "-"
        mark = "  (latest)" if latest is not None and path == latest else ""
        click.echo(f"{step:>10}  {status:<10}  {world:>5}  {_size(size):>10}  {when:<20}  {path}{mark}")
    for name in tmp:
        click.echo(f"{'-':>10}  {'partial':<10}  {'-':>5}  {'-':>10}  {'-':<20}  {root / name}")


@ckpt.command("export")
@click.argument("checkpoint_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path))
def ckpt_export(checkpoint_dir: Path, out: Path) -> None:
    """Write CHECKPOINT_DIR's model weights as one consolidated safetensors file OUT.

    CHECKPOINT_DIR is one checkpoint or a root: then the checkpoint a resume would load (the newest
    usable one; unusable ones are skipped with a warning naming the file, as `loom ckpt verify` reports).
    No process group is needed.
    """
    from .checkpoint import export_from_dcp
    from .errors import CheckpointError

    checkpoint_dir = _ckpt_root(checkpoint_dir)
    try:
        path = export_from_dcp(checkpoint_dir, out)
    except CheckpointError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    click.echo(f"wrote {path} ({_size(path.stat().st_size)})")


def _ckpt_root(path: Path) -> Path:
    """A training output dir holds its checkpoints under ``checkpoints/``."""
    from .checkpoint import commit

    if not commit.is_checkpoint_dir(path) and not commit.list_checkpoints(path) and (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


@ckpt.command("verify")
@click.argument("path", type=click.Path(exists=True, file_okay=False, path_type=Path))
def ckpt_verify(path: Path) -> None:
    """Check PATH: one checkpoint, or every checkpoint under a root (or a training output dir).

    A checkpoint is "ok" if a resume can load it: its COMPLETE marker is valid, every file it lists has
    the recorded size and SHA-256 checksum (every byte is read), and trainer_state.json and the DCP
    .metadata parse. Checkpoints written before checksums were recorded are checked by sizes only, and
    the line says so. For a root, one line per checkpoint and the one a resume would load (the same
    selection rule as resume and `loom ckpt export`). Exit code 0 if PATH (for a root: at least one
    checkpoint under it) is usable, else 1.
    """
    from .checkpoint import check, commit
    from .errors import CheckpointError

    def _line(p: Path) -> bool:
        try:
            m = check(p)
        except CheckpointError as e:
            click.echo(f"FAILED  {p.name}: {e}")
            return False
        how = "checksums match" if m.checksums else "sizes match; no checksums recorded (older torchloom), data not verified"
        click.echo(f"ok      {p.name}: step {m.step}, saved by {m.world_size} rank(s), {len(m.files)} files, "
                   f"{_size(sum(m.files.values()))}, {how}")
        return True

    if commit.is_checkpoint_dir(path):
        if _line(path):
            sys.exit(0)
        hint = commit.root_hint(path).strip()  # a usable checkpoint next to it: name its root
        if hint:
            click.echo(hint)
        sys.exit(1)
    path = _ckpt_root(path)
    results = {p: _line(p) for _step, p in commit.list_checkpoints(path)}
    try:
        chosen, _ = commit.select(path, lambda p: results.get(p) or check(p))
    except CheckpointError:
        click.echo(f"error: no usable checkpoint under {path}", err=True)
        sys.exit(1)
    click.echo(f"a resume from {path} loads {chosen}")


def _iso(t: float) -> str:
    import time

    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


if __name__ == "__main__":
    main()
