"""A batch that does not fit the model's forward under ``model_input_format="unpack_dict"`` (or
``"unpack_sequence"``) is a TypeError naming the batch, the forward's parameters and the formats (issue [11]
item 13); a TypeError raised inside forward is left as it is. One process, in this one."""
import pytest
import torch
import torch.nn as nn

import torchloom
from torchloom.train_step import call_model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x, scale=1.0):
        return self.fc(x) * scale


class Broken(Net):
    def forward(self, x):
        return torch.cat(x, 1)  # a TypeError of the model's own (x is a tensor, not a sequence)


def _res(model, fmt="unpack_dict"):
    return torchloom.auto_accelerate(model, torch.optim.SGD, loss_func=lambda b, o: o.sum(), strategy=["ddp"],
                                     optim_args={"lr": 0.1}, model_input_format=fmt)


def test_unexpected_batch_keys_are_named_with_the_format():
    res = _res(Net())  # ddp over one rank: the check looks through DistributedDataParallel
    batch = {"x": torch.ones(2, 4), "labels": torch.zeros(2)}
    with pytest.raises(TypeError) as e:
        res.train_step(batch)
    msg = str(e.value)
    assert "model_input_format='unpack_dict' calls model(**batch) with the batch keys ['x', 'labels']" in msg
    assert "Net.forward takes ['x', 'scale']" in msg and "unexpected keys: ['labels']" in msg
    assert "model_input_format='unpack_sequence'" in msg and "None (model(batch))" in msg
    with pytest.raises(TypeError, match=r"batch keys \['scale'\].*missing a required argument: 'x'"):
        call_model(Net(), {"scale": 2.0}, "unpack_dict")
    assert torch.isfinite(res.train_step({"x": torch.ones(2, 4)}))  # a fitting batch trains


def test_too_many_sequence_items_are_named():
    with pytest.raises(TypeError, match=r"'unpack_sequence' calls model\(\*batch\) with 3 batch items, but "
                                        r"Net.forward takes \['x', 'scale'\]: too many positional arguments"):
        call_model(Net(), (torch.ones(2, 4), 1.0, 3), "unpack_sequence")


def test_a_type_error_inside_forward_is_not_rewritten():
    with pytest.raises(TypeError) as e:
        call_model(Broken(), {"x": torch.ones(2, 4)}, "unpack_dict")
    assert "model_input_format" not in str(e.value) and e.value.__cause__ is None


def test_the_analysis_of_strategy_auto_names_unexpected_batch_keys_too():
    """strategy='auto' traces the first batch before anything runs: a key forward has no parameter for is named
    there as train_step names it (batch keys, forward's parameters, formats), not as a value-dependent shape."""
    from torchloom.cost.analysis import analyze_model

    batch = {"x": torch.ones(1, 4), "idx": torch.tensor([0])}
    with pytest.raises(ValueError) as e:
        analyze_model(Net(), seq_len=1, sample_input=batch, input_format="unpack_dict", loss_func=lambda b, o: o.sum())
    msg = str(e.value)
    assert "the sample batch does not fit its forward" in msg and "shapes do not depend" not in msg, msg
    assert "model(**batch) with the batch keys ['x', 'idx']" in msg and "unexpected keys: ['idx']" in msg
    assert "Net.forward takes ['x', 'scale']" in msg and "model_input_format='unpack_sequence'" in msg
    with pytest.raises(ValueError, match=r"3 batch items, but Net.forward takes \['x', 'scale'\]"):
        analyze_model(Net(), seq_len=1, sample_input=(torch.ones(1, 4), 1.0, 3), input_format="unpack_sequence",
                      loss_func=lambda b, o: o.sum())
