"""The note `fsdp` leaves in ``res.notes`` says what it wrapped (issue [11] item 13): one process, in this one."""
import torch
import torch.nn as nn

import torchloom


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


class Stack(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _fsdp_note(model: nn.Module) -> str:
    res = torchloom.auto_accelerate(model, torch.optim.SGD, loss_func=lambda b, o: o.sum(), strategy=["fsdp"],
                                    optim_args={"lr": 0.1})
    assert torch.isfinite(res.train_step(torch.ones(2, 4)))  # the wrapped model trains
    (note,) = [n for n in res.notes if n.startswith("fsdp:")]
    return note


def test_a_model_without_repeated_blocks_is_named_one_unit():
    note = _fsdp_note(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)))
    assert "0 block units" not in note and "[]" not in note, note
    assert "no repeated blocks found" in note and "the whole model is one FSDP unit" in note
    assert "{'fsdp': {'wrap_cls': ['MyBlock']}}" in note


def test_repeated_blocks_are_counted():
    assert "3 block units of ['Block']" in _fsdp_note(Stack())
