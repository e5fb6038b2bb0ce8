"""Issue [10] item 5 and train_step's global loss, on 2 ranks (one launch, tests/distributed/_hf_loss_data_workers.py).

* ``SumLoss.from_hf`` with 4 micro-batches of 1 per rank and variable padding (the C10 sequences, 239 and
  215 valid targets on the two ranks): the gradient and the parameters after one SGD step equal one process
  taking the whole batch's per-token mean (rtol 1e-5 / atol 1e-7: per-micro-batch, per-rank token sums
  instead of one), under DDP; passing HF's ``num_items_in_batch`` changes nothing (no double
  normalisation). (FSDP's SumLoss normalisation: tests/cases/test_c10_accum_token_counts.py.) Control: the per-micro-batch mean loss (``output.loss``) is off by > 1e-2 relative.
* The returned loss is the same on both ranks (bitwise) and equals the global token mean of the call's two
  micro-batches (rtol 1e-6); ``loss_report="local"`` returns each rank's own, as ``last_local_loss``.
* A Hugging Face ``IterableDataset`` (``split_dataset_by_node``) resumed through ``torchloom.checkpoint``
  yields exactly the uninterrupted batches and reads only the rows after the position (no replay), on
  each rank its own split.
"""
from __future__ import annotations

import pytest
import torch

from tests.cases._workers import C10_LENGTHS, c10_batch, c10_micro, sgd
from tests.distributed import _hf_loss_data_workers as W
from tests.models import tiny_llama
from torchloom import SumLoss
from torchloom.testing import run_ranks

RTOL, ATOL = 1e-5, 1e-7

pytestmark = pytest.mark.distributed


def _reference():
    """One process, the whole batch of 8: grads and params after one SGD step of the token mean, and the
    per-sequence (total, count) at the initial weights."""
    model = tiny_llama()
    batch = c10_batch()
    out = SumLoss.from_hf(model(**batch), batch["labels"])
    (out.total / out.count).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        per_seq = []
        for i in range(len(C10_LENGTHS)):
            mb = c10_micro(batch, i, i + 1)
            s = SumLoss.from_hf(model(**mb), mb["labels"])
            per_seq.append((s.total.double().item(), int(s.count)))
    opt = sgd(model.parameters())
    opt.step()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}, per_seq


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(W.all_checks, 2, str(tmp_path_factory.mktemp("hf_resume")), timeout=300)


def _close(got, ref, what):
    assert sorted(got) == sorted(ref), what
    for n, v in got.items():
        torch.testing.assert_close(v, ref[n], rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {n}: {m}")


def test_from_hf_under_accumulation_and_padding_matches_whole_batch(ranks):
    grads, params, _ = _reference()
    for rank, r in enumerate(ranks):
        for tag in ("ddp", "ddp_num_items_local"):
            _close(r[tag]["grads"], grads, f"rank {rank} {tag} grads")
            _close(r[tag]["params"], params, f"rank {rank} {tag} params")
        err = max(((g - grads[n]).abs().max() / grads[n].abs().max()).item() for n, g in r["ddp_mean"]["grads"].items())
        assert err > 1e-2, f"the per-micro-batch mean should differ from the token mean (rel err {err})"


def test_returned_loss_is_global_and_equal_on_all_ranks(ranks):
    _, _, per_seq = _reference()
    n = len(C10_LENGTHS) // 2
    want = [(per_seq[k][0] + per_seq[n + k][0]) / (per_seq[k][1] + per_seq[n + k][1]) for k in range(n)]
    assert ranks[0]["ddp"]["losses"] == ranks[1]["ddp"]["losses"]
    torch.testing.assert_close(torch.tensor(ranks[0]["ddp"]["losses"], dtype=torch.float64),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-6, atol=0)
    own = [[t / c for t, c in per_seq[r * n:(r + 1) * n]] for r in range(2)]
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(torch.tensor(r["ddp"]["local"], dtype=torch.float64),
                                   torch.tensor(own[rank], dtype=torch.float64), rtol=1e-6, atol=0)
        assert r["ddp_num_items_local"]["losses"] == r["ddp_num_items_local"]["local"]  # loss_report="local"
    assert ranks[0]["ddp_num_items_local"]["losses"] != ranks[1]["ddp_num_items_local"]["losses"]
    mean = ranks[0]["ddp_mean"]  # mean losses: the plain mean over the ranks
    for k in range(n):
        assert mean["losses"][k] == ranks[1]["ddp_mean"]["losses"][k]
        assert mean["losses"][k] == pytest.approx((mean["local"][k] + ranks[1]["ddp_mean"]["local"][k]) / 2, rel=1e-6)


def test_hf_iterable_resumes_from_its_state_without_replay(ranks):
    if ranks[0]["hf_resume"] is None:
        pytest.skip("datasets is not installed (pip install torchloom[hf])")
    rows = W.HF_ROWS // 2
    for rank, r in enumerate(ranks):
        h = r["hf_resume"]
        assert h["state_mode"], "a HF IterableDataset with num_workers=0 should resume from its state_dict()"
        assert len(h["full"]) == rows // W.HF_MICRO and h["full_reads"] == rows
        assert h["first"] == h["full"][:W.HF_STOP]
        assert h["rest"] == h["full"][W.HF_STOP:], f"rank {rank}: the resumed batches differ"
        # the join read the window ahead (6 batches) before the stop; the resume reads only what follows
        assert h["first_reads"] == 6 * W.HF_MICRO
        assert h["rest_reads"] == rows - W.HF_STOP * W.HF_MICRO, f"rank {rank} re-read rows: {h['rest_reads']}"
    # HF's state is relative to the rank's split (shard and row within *its* shards): equal shards give equal
    # states, which the checkpoint stores once (else per rank); each rank restored its own split above
    doc = ranks[0]["hf_resume"]
    saved = [doc["doc_dataloader"]] * 2 if doc["doc_per_rank"] is None else doc["doc_per_rank"]
    assert all(s["batches_yielded"] == W.HF_STOP and s["dataset_state"] for s in saved)
    assert {x for b in ranks[0]["hf_resume"]["full"] for x in b}.isdisjoint(
        {x for b in ranks[1]["hf_resume"]["full"] for x in b})  # per-rank shards
