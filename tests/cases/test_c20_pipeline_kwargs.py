"""C20 — pipeline stages that need keyword inputs [pytorch/pytorch 130055].

``schedule.step(*args, **kwargs)`` of torch.distributed.pipelining gives keyword inputs to the stages of the
rank that passes them; a pipeline that fed ``position_ids``/``attention_mask`` to the first stage only would
run the later stages with default positions and no padding mask. 2-stage Llama, batches with padding
(attention mask, labels -100 on padding) and non-default position ids ``3 t + 5``. (A constant offset would not
do: rotary attention only sees position differences, so a stage ignoring an offset computes the same thing.)

Checks: the driver routed ``attention_mask`` and ``position_ids`` to both stages and ``labels`` to the loss on
the last stage; losses (rtol 1e-5), the last step's gradients (atol 1e-6) and parameters (atol 2e-5) equal
the single-process reference. Controls: the same run with ``position_ids`` (or ``attention_mask``) withheld
from stage 1 gives gradients more than 1e-4 (100x the tolerance) away, so the test detects a stage that did
not get its keyword input. (On this small random model a missing position input moves the loss by only ~1e-4;
the gradient is the sharper witness.)
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _pp_workers as W
from torchloom.testing import run_ranks


def _data(steps: int = 2, rows: int = 4, seq: int = 24) -> list[list[dict]]:
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(steps):
        x = torch.randint(1, 128, (rows, seq), generator=g)
        mask = torch.ones_like(x)
        mask[1, seq - 6:] = 0
        mask[3, seq - 14:] = 0
        x = x.masked_fill(mask == 0, 0)
        pos = (3 * torch.arange(seq) + 5).expand(rows, seq).clone()
        out.append([{"input_ids": x, "labels": x.masked_fill(mask == 0, -100), "attention_mask": mask,
                     "position_ids": pos}])
    return out


@pytest.mark.distributed
def test_keyword_inputs_reach_the_stage_that_uses_them():
    data = _data()
    strategy = [("pipeline_parallel", {"size": 2})]
    configs = [dict(tag="routed", strategy=strategy, data=data),
               dict(tag="no_position_ids", strategy=strategy, data=data, drop_kwarg_after_first="position_ids"),
               dict(tag="no_attention_mask", strategy=strategy, data=data, drop_kwarg_after_first="attention_mask")]
    outs = run_ranks(W.pp_train_many, 2, configs, timeout=600)
    ref = W.reference("llama", data, 2)
    routed = [o[0] for o in outs]
    assert routed[0]["routed"] == {0: ["attention_mask", "position_ids"]}
    assert routed[1]["routed"] == {1: ["attention_mask", "position_ids"]} and routed[1]["loss_inputs"] == ["labels"]
    torch.testing.assert_close(torch.tensor(routed[0]["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0)
    params, grads = W.merge_params(routed), W.merge_grads(routed)
    for k, v in ref["params"].items():
        torch.testing.assert_close(params[k], v, atol=2e-5, rtol=0, msg=lambda m: f"{k}: {m}")
    for k, v in ref["grads"].items():
        torch.testing.assert_close(grads[k], v, atol=1e-6, rtol=0, msg=lambda m: f"grad {k}: {m}")
    for i in (1, 2):
        ranks = [o[i] for o in outs]
        assert configs[i]["tag"].removeprefix("no_") not in ranks[1]["routed"][1]
        grads = W.merge_grads(ranks)
        gap = max((grads[k] - v).abs().max().item() for k, v in ref["grads"].items())
        assert gap > 1e-4, (configs[i]["tag"], gap)
