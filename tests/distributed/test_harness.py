import pytest

from torchloom.testing import run_ranks
from tests.distributed._probe import allreduce_rank


@pytest.mark.distributed
def test_run_ranks_allreduce():
    assert run_ranks(allreduce_rank, 2) == [1.0, 1.0]
