"""Fixtures shared by the e2e tests: one corpus cache (tokenizer trained once per session) and the elastic
tests' uninterrupted reference run."""
import pytest

from ._elastic_util import train

ELASTIC_STEPS = 12


@pytest.fixture(scope="session")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("corpus_cache")


@pytest.fixture(scope="session")
def reference(tmp_path_factory, cache):
    """The uninterrupted 2-process smoke job of ``ELASTIC_STEPS`` steps that restarted runs must reproduce."""
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = train(out, cache, ELASTIC_STEPS)
    assert proc.returncode == 0, proc.stdout[-4000:]
    return out
