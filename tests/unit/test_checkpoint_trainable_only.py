"""Trainable-only checkpoints in one process: size, what is kept (trainable parameters, buffers), and the
refusals (frozen parameters with optimizer state, another base). The 2-rank FSDP/DDP/flash resume and the
trainable-set errors are in tests/distributed/test_checkpoint_trainable_only.py."""
from __future__ import annotations

import json
import warnings

import pytest
import torch
import torch.nn as nn

import torchloom.checkpoint as ckpt
from torchloom.checkpoint.state import capture_rng, read_metadata_safely, restore_rng
from torchloom.errors import CheckpointError
from torchloom.train.config import ConfigError, TrainConfig


@pytest.fixture(autouse=True)
def keep_rng():
    """``load`` restores the checkpoint's RNG into this process; put ours back afterwards."""
    st = capture_rng()
    yield
    restore_rng(st)


def peft_llama(seed: int = 0):
    from peft import LoraConfig, get_peft_model

    from tests.models import tiny_llama

    base = tiny_llama(seed=seed, vocab=512)
    torch.manual_seed(seed + 1000)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))


def adamw_step(model) -> torch.optim.Optimizer:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # frozen parameters in the groups, as users do
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(3))
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def tensor_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


def test_lora_checkpoint_is_about_the_adapters_and_their_adamw_state(tmp_path):
    model = peft_llama()
    opt = adamw_step(model)
    full = ckpt.save(tmp_path / "full", step=1, model=model, optimizer=opt)
    part = ckpt.save(tmp_path / "part", step=1, model=model, optimizer=opt, trainable_only=True)
    trainable = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    entries = len(read_metadata_safely(part / ".metadata").state_dict_metadata)
    # adapters + AdamW's exp_avg and exp_avg_sq; DCP adds < 2 KiB per entry (measured 1.3-1.6 KiB)
    assert 3 * trainable <= tensor_bytes(part) <= 3 * trainable + 2048 * entries
    assert tensor_bytes(full) >= everything + 2 * trainable
    # measured 680 kB against 89 kB (of which 43 kB adapters + moments); grows with the base
    assert tensor_bytes(full) > 6 * tensor_bytes(part), (tensor_bytes(full), tensor_bytes(part))
    doc = json.loads((part / "trainer_state.json").read_text())
    rec = doc["trainable_only"]
    assert rec["params"] == sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert rec["frozen"]["count"] == sum(1 for p in model.parameters() if not p.requires_grad)
    assert json.loads((full / "trainer_state.json").read_text())["trainable_only"] is None

    fresh = peft_llama()  # the base rebuilt from the same seed; the adapters re-initialised
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    ckpt.load(part, model=fresh, optimizer=fresh_opt)
    for (n, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), n
    assert {id(p) for p in fresh_opt.state} == {id(p) for p in fresh.parameters() if p.requires_grad}


class FrozenBN(nn.Module):
    """A frozen layer + BatchNorm under a trainable head: the BatchNorm's running stats change in training."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)
        self.body.requires_grad_(False)
        self.norm.requires_grad_(False)

    def forward(self, x):
        return self.head(self.norm(self.body(x)))


def test_buffers_are_kept_and_frozen_weights_left_as_they_are(tmp_path):
    model = FrozenBN()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    path = ckpt.save(tmp_path, step=1, model=model, optimizer=opt, trainable_only=True)
    fresh = FrozenBN()
    ckpt.load(path, model=fresh, optimizer=torch.optim.SGD([p for p in fresh.parameters() if p.requires_grad], lr=0.1))
    assert torch.equal(fresh.norm.running_mean, model.norm.running_mean)  # changed by training: kept
    assert int(fresh.norm.num_batches_tracked) == 1
    assert torch.equal(fresh.head.weight, model.head.weight)
    assert torch.equal(fresh.body.weight, FrozenBN().body.weight)  # the base's own value


def test_frozen_parameter_with_optimizer_state_is_refused(tmp_path):
    model = FrozenBN()
    opt = torch.optim.AdamW(model.head.parameters(), lr=0.1)
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
    model.head.requires_grad_(False)  # trained, then frozen: its trained value is not in the base
    model.body.bias.requires_grad_(True)  # something else trains now
    with pytest.raises(CheckpointError, match=r"frozen parameter 'head.weight' has optimizer state"):
        ckpt.save(tmp_path, step=1, model=model, optimizer=opt, trainable_only=True)
    model.requires_grad_(False)
    with pytest.raises(CheckpointError, match="no parameter with requires_grad=True"):
        ckpt.save(tmp_path, step=1, model=model, trainable_only=True)
    with pytest.raises(CheckpointError, match="trainable_only must be a bool"):
        ckpt.save(tmp_path, step=1, model=model, trainable_only="yes")
    assert not list(tmp_path.glob("step_*"))


def test_another_base_is_refused_or_warned(tmp_path):
    model = FrozenBN()
    path = ckpt.save(tmp_path, step=1, model=model, trainable_only=True)
    other = FrozenBN()
    with torch.no_grad():
        other.body.weight[0, 0] += 1e-3  # one value of the frozen base differs
    with pytest.raises(CheckpointError, match=r"1 frozen parameters hold other values.*'body.weight'"):
        ckpt.load(path, model=other)
    with pytest.warns(UserWarning, match="hold other values"):
        ckpt.load(path, model=other, strict=False)
    assert torch.equal(other.head.weight, model.head.weight)  # the overlap was loaded

    renamed = FrozenBN()
    renamed.body.requires_grad_(True)  # trainable now: not in the checkpoint, would keep its value
    with pytest.raises(CheckpointError, match=r"trainable in the model but not in the checkpoint \['body.bias', "
                                              r"'body.weight'\]"):
        ckpt.load(path, model=renamed)


def test_offline_export_refuses_a_trainable_only_checkpoint(tmp_path):
    path = ckpt.save(tmp_path / "ckpt", step=1, model=FrozenBN(), trainable_only=True)
    with pytest.raises(CheckpointError, match="is trainable-only.*no model file can be written"):
        ckpt.export_from_dcp(path, tmp_path / "model.safetensors")
    assert not (tmp_path / "model.safetensors").exists()
    everything_trains = nn.Linear(2, 2)  # loom train's case: nothing frozen, the checkpoint is a whole model
    path = ckpt.save(tmp_path / "all", step=1, model=everything_trains, trainable_only=True)
    ckpt.load_safetensors(nn.Linear(2, 2), ckpt.export_from_dcp(path, tmp_path / "all.safetensors"))


def test_loom_train_key_is_validated():
    assert TrainConfig().checkpoint.trainable_only is False
    assert TrainConfig.load(None, ["checkpoint.trainable_only=true"]).checkpoint.trainable_only is True
    with pytest.raises(ConfigError, match=r"checkpoint.trainable_only expects bool"):
        TrainConfig.load(None, ["checkpoint.trainable_only=sometimes"])
