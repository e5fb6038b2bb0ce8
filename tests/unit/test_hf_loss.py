"""``SumLoss.from_hf`` against transformers' own ``ForCausalLMLoss``, its output forms and
``num_items_in_batch``; ``TrainStep``'s ``loss_report`` and ``last_local_loss`` in one process (2 ranks:
tests/distributed/test_hf_loss_data.py)."""
from __future__ import annotations

import pytest
import torch
from transformers.loss.loss_utils import ForCausalLMLoss

import torchloom
from tests.cases._workers import C10_LENGTHS, c10_batch, c10_micro, record_grads, sgd
from tests.models import tiny_llama
from torchloom import SumLoss


@pytest.fixture(scope="module")
def model_out():
    torch.manual_seed(0)
    model = tiny_llama()
    batch = c10_batch()
    with torch.no_grad():
        out = model(**batch)
    return batch, out


def test_matches_transformers_for_causal_lm_loss(model_out):
    batch, out = model_out
    labels, V = batch["labels"], out.logits.shape[-1]
    s = SumLoss.from_hf(out, labels)
    assert s.count.dtype == torch.int64 and int(s.count) == sum(n - 1 for n in C10_LENGTHS)
    # HF's sum (num_items_in_batch=1) is the same computation: bitwise equal, in fp32 and from bf16 logits
    assert torch.equal(s.total, ForCausalLMLoss(out.logits, labels, V, num_items_in_batch=1))
    bf = out.logits.bfloat16()
    assert torch.equal(SumLoss.from_hf(bf, labels).total, ForCausalLMLoss(bf, labels, V, num_items_in_batch=1))
    assert SumLoss.from_hf(bf, labels).total.dtype == torch.float32
    # HF's mean (what model(..., labels=...).loss is): total / count, to fp32 rounding
    torch.testing.assert_close(s.total / s.count, out.loss, rtol=1e-6, atol=0)


def test_output_forms_and_shift(model_out):
    batch, out = model_out
    labels, ref = batch["labels"], SumLoss.from_hf(model_out[1], batch["labels"]).total
    for form in (out.logits, (out.loss, out.logits), (out.logits,), [out.logits], {"logits": out.logits}):
        assert torch.equal(SumLoss.from_hf(form, labels).total, ref)
    shifted = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]  # HF's shift_labels
    assert torch.equal(SumLoss.from_hf(out, shifted, shift=False).total, ref)
    masked = labels.masked_fill(labels == -100, 7)  # another ignore_index
    masked[:, :3] = 7
    s7 = SumLoss.from_hf(out, masked, ignore_index=7)
    assert int(s7.count) == int((masked[:, 1:] != 7).sum()) == int(s7.count)
    assert int(s7.count) < int(SumLoss.from_hf(out, labels).count)
    with pytest.raises(TypeError, match="no logits"):
        SumLoss.from_hf(object(), labels)
    with pytest.raises(ValueError, match="do not match labels"):
        SumLoss.from_hf(out.logits[:, :-1], labels)


def test_num_items_in_batch_does_not_normalise_again(model_out):
    batch, out = model_out
    plain = SumLoss.from_hf(out, batch["labels"])
    for n in (454, torch.tensor(454), 10**6):
        s = SumLoss.from_hf(out, batch["labels"], num_items_in_batch=n)
        assert torch.equal(s.total, plain.total) and torch.equal(s.count, plain.count)
    with pytest.raises(ValueError, match="smaller than this micro-batch"):
        SumLoss.from_hf(out, batch["labels"], num_items_in_batch=3)


def _step(loss_func, accum=8):
    model = tiny_llama()
    opt = sgd(model.parameters())
    step = torchloom.TrainStep(model=model, optimizer=opt, loss_func=loss_func, device=torch.device("cpu"),
                               grad_accum_steps=accum, model_input_format="unpack_dict")
    return step, record_grads(opt, model)


def test_accumulation_with_num_items_equals_whole_batch_mean_and_local_report():
    """8 micro-batches of 1 with HF's num_items_in_batch passed: the whole batch's token mean (a second
    division by num_items_in_batch would scale the gradient by 1/454). loss_report is validated."""
    model = tiny_llama()
    batch = c10_batch()
    ref = SumLoss.from_hf(model(**batch), batch["labels"])
    (ref.total / ref.count).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    step, grads = _step(lambda b, o: SumLoss.from_hf(o, b["labels"], num_items_in_batch=int(ref.count)))
    for i in range(len(C10_LENGTHS)):
        loss = step(c10_micro(batch, i, i + 1))
        assert loss is step.last_local_loss  # one process: the global loss is this rank's
    for n, g in grads[0].items():
        torch.testing.assert_close(g, want[n], rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="loss_report"):
        torchloom.TrainStep(model=model, optimizer=sgd(model.parameters()), loss_func=None,
                            device=torch.device("cpu"), loss_report="mean")
