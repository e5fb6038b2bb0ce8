"""ATorch's ``examples/auto_accelerate`` (toy, gpt2, llama) run through ``torchloom.compat.atorch``.

The example is ported unchanged but for its import path (tests/compat/examples/auto_accelerate/). Each case
runs the command line of one of ATorch's entry scripts / README examples, in-process or on 2 gloo ranks, with
only the sizes shrunk so that it runs on CPU in seconds (each change is noted next to its arguments): the
dataset (``--datasize``) and the epochs (``--epoch 1``), and ``--log_interval 1`` so that every step prints
its ``[step=N]`` line, which is how the test checks that all steps ran. Model sizes are the entry scripts'
(hidden 64, 4 heads, 4 layers, sequence 32). On CPU the example itself leaves out ``amp_native`` and
``module_replace`` (it adds them only when CUDA is available).

Fully automatic mode (no ``--load_strategy``: ``load_strategy=None``) runs torchloom's strategy search
(issue [7]): the cost model ranks the candidates and short real runs confirm the best; the test checks that
the search ran its trials, that the strategy it chose is one of the measured ones, and that the example
then trained all its steps. ``TORCHLOOM_CACHE_DIR`` points at a temporary directory so the machine's
calibration and plan caches are not read or written.

The one-process cases run in a fresh interpreter (:func:`_fresh`): the example's DataLoader forks its workers
(``fork``, Linux's default), and forking the long-lived pytest process, which holds a gloo group's threads and
the heap of every earlier test, crashed a worker with a segmentation fault in the child's garbage collection
(in filelock's after-fork hook) in a full-suite run, and left its sibling waiting forever.
"""
import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.compat.examples.auto_accelerate.train import parse_args, train
from tests.compat._ranks import RankCodes

# ATorch's entry scripts / README command lines, shrunk for CPU: --datasize 16 (default 200) and --epoch 1
# (default 2); --log_interval 1 (default 10) so each step is printed.
SHRINK = ["--datasize", "16", "--epoch", "1", "--log_interval", "1"]
LLM = ["--hidden_size", "64", "--head_num", "4", "--layer_num", "4", "--seq_length", "32"]  # as the .sh files
GPT2 = ["--model_type", "gpt2", "--distributed", *LLM, "--load_strategy", "--use_fsdp", "--use_amp",
        "--use_module_replace"]  # train_gpt2_entry.sh
LLAMA = ["--model_type", "llama", "--distributed", *LLM, "--load_strategy", "--use_fsdp", "--use_amp",
         "--use_module_replace", "--use_checkpointing", "--user_created_dataloader"]  # train_llama_entry.sh


def _run_example(argv):
    """Run the example's train() with ``argv``; return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train(parse_args(argv))
    return out.getvalue()


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _run_searched(argv, cache_dir):
    """The fully automatic example: what it printed and the search's log lines (logger torchloom.search and
    compat's "the search chose" line)."""
    import os

    os.environ["TORCHLOOM_CACHE_DIR"] = str(cache_dir)
    rec = _Records()
    loggers = [logging.getLogger("torchloom.search"), logging.getLogger("torchloom.compat.atorch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(rec)
        lg.setLevel(logging.INFO)
    try:
        printed = _run_example(argv)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(rec)
            lg.setLevel(level)
    return printed, rec.lines


def _assert_searched(lines):
    """The search measured trials and chose one of the measured candidates."""
    trials = [ln.split(": ", 1)[0].split(" ", 2)[2] for ln in lines if ln.startswith("trial ")]
    chosen = [ln for ln in lines if ln.startswith("auto_accelerate: the search chose ")]
    assert trials and chosen, lines
    label = chosen[0][len("auto_accelerate: the search chose "):].split(" (")[0]
    assert label in trials and "(measured)" in chosen[0], (label, trials, chosen)


_ROOT = Path(__file__).resolve().parents[2]
_MARK = "@@fresh-result@@"


def _fresh(name: str, *args):
    """``name(*args)`` (a function of this module, JSON arguments and result) in a new interpreter."""
    code = (f"import json, sys; from tests.compat.test_atorch_examples import {name} as f; "
            f"out = f(*json.loads(sys.argv[1])); print({_MARK!r} + json.dumps(out))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", code, json.dumps(list(args))], cwd=_ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{name} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(_MARK)][-1]
    return json.loads(line[len(_MARK):])


def _steps(printed):
    return sum(1 for line in printed.splitlines() if line.startswith("[step="))


def _assert_trained(printed, steps):
    assert "Finished training!" in printed, printed
    assert _steps(printed) == steps, printed


def test_toy_fully_automatic(tmp_path):
    """train_toy_fully_automatic_entry.sh (`train.py --model_type toy`): load_strategy=None searches."""
    printed, lines = _fresh("_run_searched", ["--model_type", "toy", *SHRINK], str(tmp_path))
    _assert_searched(lines)
    _assert_trained(printed, 16 // 8)  # datasize / batchsize (8), one epoch


def test_toy_semi_automatic_one_process():
    """README's toy example with --load_strategy, --use_fsdp and --use_checkpointing in one process: fsdp is
    a distributed-only method and is dropped (as ATorch does); checkpoint wraps nn.Linear."""
    printed = _fresh("_run_example", ["--model_type", "toy", "--load_strategy", "--use_fsdp", "--use_checkpointing",
                                      "--optim_grouped_params", *SHRINK])
    _assert_trained(printed, 16 // 8)  # datasize / batchsize (8, the example's default), one epoch


_CACHE = tempfile.mkdtemp(prefix="loom-examples-cache-")  # the ranks' calibration cache (not the machine's)

# the 2-rank cases run in one launch (tests/compat/_ranks.py)
_CODES = RankCodes({
    "toy_distributed": (_run_searched, (["--model_type", "toy", "--distributed", *SHRINK], _CACHE),
                        {}),
    "gpt2": (_run_example, ([*GPT2, *SHRINK],), {}),
    "llama": (_run_example, ([*LLAMA, *SHRINK],), {}),
})


@pytest.mark.distributed
def test_toy_distributed_fully_automatic():
    """train_toy_distributed_entry.sh (`--model_type toy --distributed`) on 2 gloo ranks: fully automatic; both
    ranks log the same trials and choice, rank 0 prints the 16 // 8 steps."""
    (printed, lines), (_, lines1) = _CODES.result("toy_distributed")
    _assert_searched(lines)
    assert [ln for ln in lines if ln.startswith("auto_accelerate: the search chose")] == \
        [ln for ln in lines1 if ln.startswith("auto_accelerate: the search chose")]
    _assert_trained(printed, 16 // 8)


@pytest.mark.distributed
def test_gpt2_fsdp_two_ranks():
    """train_gpt2_entry.sh on 2 gloo ranks: parallel_mode + fsdp (GPT2Block wrapped), global batch 8."""
    printed = _CODES.result("gpt2")
    _assert_trained(printed[0], 16 // 8)


@pytest.mark.distributed
def test_llama_fsdp_checkpoint_user_dataloader_two_ranks():
    """train_llama_entry.sh on 2 gloo ranks: parallel_mode + fsdp + checkpoint (LlamaDecoderLayer), AGD, and
    the user's own DataLoader split by get_data_partition_rank_and_size (per-rank batch 8 // 2)."""
    printed = _CODES.result("llama")
    _assert_trained(printed[0], 16 // 2 // (8 // 2))  # each rank: 8 samples in batches of 4
