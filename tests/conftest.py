import os
import sys

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# A developer's own `loom config` file (~/.cache/torchloom/default_config.yaml, ./torchloom.yaml) must not change the
# strategy of tests that pass strategy=None or the ranks of `loom run` tests (docs/config.md); tests of it set their own.
os.environ.setdefault("TORCHLOOM_CONFIG_FILE", "none")
# Test modules must be importable by spawned ranks (functions are pickled by qualified name).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import pytest  # noqa: E402
import torch  # noqa: E402

_BASELINE_THREADS = torch.get_num_threads()  # OMP_NUM_THREADS=1 above: every test starts (and ends) with it


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """A test that initialises the default process group in the pytest process (ATorch's one-process tests
    call ``init_distributed``) or runs ``auto_accelerate`` there leaves state the next test would see (a live
    group, the current torchloom mesh): tear both down after each test."""
    import torch
    import torch.distributed as dist

    from torchloom.parallel import mesh as loom_mesh

    had_group = dist.is_available() and dist.is_initialized()
    threads = _BASELINE_THREADS  # not this test's start: a module fixture's setup ran before this one
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    yield
    # a test that changed the intra-op thread count would change the next tests' single-process references:
    # CPU matmuls sum in another order with 2 threads (the pipeline MoE reference of test_moe_layer_parallel
    # moves 6.7e-6, past its 1e-6 tolerance; it failed once under 3 xdist workers after another file of gw0)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    loom_mesh.set_current_mesh(None)
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


# The longest test files (serial --durations of the whole suite, 2 cores), scheduled first: under
# `scripts/test.sh`'s two xdist workers (--dist loadfile) a long file started last leaves the other worker idle
# for its whole run (the expert-checkpoint file, ~2.5 min serial, did). Within a file the order is unchanged.
LONGEST_FIRST = (
    "tests/distributed/test_expert_checkpoint.py", "tests/distributed/test_flash_checkpoint.py",
    "tests/cases/test_c19_elastic_restart.py", "tests/e2e/test_elastic_restart.py", "tests/e2e/test_train_parallel.py",
    "tests/e2e/test_health_check.py", "tests/e2e/test_train_cli.py", "tests/compat/test_atorch_examples.py",
    "tests/e2e/test_elastic_scale.py", "tests/distributed/test_search_auto.py",
    "tests/distributed/test_pipeline_parallel.py", "tests/e2e/test_launch.py", "tests/distributed/test_hf_trainer.py",
    "tests/e2e/test_train_search.py", "tests/cases/test_c18_torn_checkpoint.py",
    "tests/cases/test_c15_resume_other_world_size.py", "tests/e2e/test_train_corrupt_resume.py",
    "tests/e2e/test_benchmarks_smoke.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath

    def key(item):
        try:
            rel = item.path.relative_to(root).as_posix()
        except ValueError:
            rel = str(item.path)
        return rank.get(rel, len(rank))

    items.sort(key=key)  # stable: the others keep their collection order
