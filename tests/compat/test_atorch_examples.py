"""ATorch's ``examples/auto_accelerate`` (toy, gpt2, llama) run through ``torchloom.compat.atorch``.

The example is ported unchanged but for its import path (tests/compat/examples/auto_accelerate/). Each case
runs the command line of one of ATorch's entry scripts / README examples, in-process or on 2 gloo ranks, with
only the sizes shrunk so that it runs on CPU in seconds (each change is noted next to its arguments): the
dataset (``--datasize``) and the epochs (``--epoch 1``), and ``--log_interval 1`` so that every step prints
its ``[step=N]`` line, which is how the test checks that all steps ran. Model sizes are the entry scripts'
(hidden 64, 4 heads, 4 layers, sequence 32). On CPU the example itself leaves out ``amp_native`` and
``module_replace`` (it adds them only when CUDA is available).

Fully automatic mode (no ``--load_strategy``: ``load_strategy=None``) needs the strategy search of issue [7];
until then ``auto_accelerate`` must refuse it with a clear error, which is asserted here.
"""
import contextlib
import io

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


def _steps(printed):
    return sum(1 for line in printed.splitlines() if line.startswith("[step="))


def _assert_trained(printed, steps):
    assert "Finished training!" in printed, printed
    assert _steps(printed) == steps, printed


def test_toy_fully_automatic_needs_search():
    """train_toy_fully_automatic_entry.sh (`train.py --model_type toy`): load_strategy=None, issue [7]."""
    with pytest.raises(Exception) as err:  # noqa: PT011 - the type is compat's choice; the message is checked
        _run_example(["--model_type", "toy", *SHRINK])
    msg = str(err.value)
    assert "load_strategy" in msg and "[7]" in msg, msg


def test_toy_semi_automatic_one_process():
    """README's toy example with --load_strategy, --use_fsdp and --use_checkpointing in one process: fsdp is
    a distributed-only method and is dropped (as ATorch does); checkpoint wraps nn.Linear."""
    printed = _run_example(["--model_type", "toy", "--load_strategy", "--use_fsdp", "--use_checkpointing",
                            "--optim_grouped_params", *SHRINK])
    _assert_trained(printed, 16 // 8)  # datasize / batchsize (8, the example's default), one epoch


def _example_error(argv):
    """The message of the exception the example raises (None if it runs through)."""
    try:
        _run_example(argv)
    except Exception as e:  # noqa: BLE001 - the test checks the message
        return f"{type(e).__name__}: {e}"
    return None


# the 2-rank cases run in one launch (tests/compat/_ranks.py)
_CODES = RankCodes({
    "toy_distributed": (_example_error, (["--model_type", "toy", "--distributed", *SHRINK],), {}),
    "gpt2": (_run_example, ([*GPT2, *SHRINK],), {}),
    "llama": (_run_example, ([*LLAMA, *SHRINK],), {}),
})


@pytest.mark.distributed
def test_toy_distributed_fully_automatic_needs_search():
    """train_toy_distributed_entry.sh (`--model_type toy --distributed`) on 2 gloo ranks: fully automatic."""
    for msg in _CODES.result("toy_distributed"):
        assert msg is not None and "load_strategy" in msg and "[7]" in msg, msg


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
