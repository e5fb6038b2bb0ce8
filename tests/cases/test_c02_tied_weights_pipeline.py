"""C02 — tied weights split across pipeline stages [NVIDIA/Megatron-LM 299].

Tied GPT-2 (``transformer.wte`` is ``lm_head``'s weight) in 2 pipeline stages: the embedding on the first,
the head on the last rank. Each stage holds its own copy; at every optimizer step both copies get the summed
gradient (the gradient of the one shared weight), so they stay bitwise identical and training equals the
unsplit tied model. Also: Llama with tied embeddings under ZB-V, where stage 0 and the last stage sit on the
same rank (both copies local), and GPT-2 under interleaved 1F1B (4 stages on 2 ranks).

Checks: the two copies are bitwise equal after 3 SGD+momentum steps; the last step's gradient of each copy
equals the reference shared gradient (atol 1e-6: a sum of the same two fp32 contributions in another order);
losses rtol 1e-5, parameters atol 2e-5 (tests/distributed/test_pipeline_parallel.py explains the bound).
Control: with the gradient sum switched off the copies drift apart and the losses leave the reference, so
the test can fail.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _pp_workers as W
from torchloom.testing import run_ranks

TIES = {"gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "llama_tied": ("model.embed_tokens.weight", "lm_head.weight")}


@pytest.mark.distributed
def test_tied_copies_get_the_summed_gradient_and_stay_identical():
    data = W.token_data(3, 8, 4)
    pp = lambda **k: [("pipeline_parallel", {"size": 2, **k})]  # noqa: E731
    configs = {
        "gpt2_1f1b": dict(model="gpt2", strategy=pp()),
        "llama_tied_zbv": dict(model="llama_tied", strategy=pp(schedule="zbv", num_microbatches=2)),
        "gpt2_interleaved": dict(model="gpt2", strategy=pp(schedule="interleaved_1f1b", num_microbatches=2)),
        "control_no_sum": dict(model="gpt2", strategy=pp(), skip_tie_sum=True),
    }
    outs = run_ranks(W.pp_train_many, 2, [dict(tag=k, data=data, **v) for k, v in configs.items()], timeout=600)
    runs = {k: [o[i] for o in outs] for i, k in enumerate(configs)}
    assert [r["stages"] for r in runs["llama_tied_zbv"]] == [[0, 3], [1, 2]]  # both copies on rank 0
    for tag, cfg in configs.items():
        ref = W.reference(cfg["model"], data, 2)
        emb, head = TIES[cfg["model"]]
        params = W.merge_params(runs[tag])
        if tag == "control_no_sum":
            assert not torch.equal(params[emb], params[head]), "copies stayed equal without the gradient sum"
            assert abs(runs[tag][0]["losses"][-1] - ref["losses"][-1]) > 1e-4
            continue
        assert torch.equal(params[emb], params[head]), f"{tag}: tied copies differ"
        grads = W.merge_grads(runs[tag])
        for name in (emb, head):
            torch.testing.assert_close(grads[name], ref["grads"][name], atol=1e-6, rtol=0,
                                       msg=lambda m: f"{tag} {name}: {m}")
        torch.testing.assert_close(torch.tensor(runs[tag][0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
        for k, v in ref["params"].items():
            torch.testing.assert_close(params[k], v, atol=2e-5, rtol=0, msg=lambda m: f"{tag} {k}: {m}")
        assert any("tied weights across stages" in n for n in runs[tag][0]["notes"]), tag
