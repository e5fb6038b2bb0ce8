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


@pytest.fixture(autouse=True)
def _isolate_process_state():
    """A test that initialises the default process group in the pytest process (ATorch's one-process tests
    call ``init_distributed``) or runs ``auto_accelerate`` there leaves state the next test would see (a live
    group, the current torchloom mesh): tear both down after each test."""
    import torch.distributed as dist

    from torchloom.parallel import mesh as loom_mesh

    had_group = dist.is_available() and dist.is_initialized()
    yield
    loom_mesh.set_current_mesh(None)
    if not had_group and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
