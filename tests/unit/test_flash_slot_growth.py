"""A flash save whose state grew (AdamW creates its moments at the first step) must not reallocate the slot the
saver is still persisting: reallocating zero-fills it, and the checkpoint on disk would hold zeros (a silent
wrong result). One process; the saver is held at the test gate so the persist is in flight deterministically."""
import threading
import time

import torch
import torch.nn as nn

from torchloom.checkpoint import FlashCheckpointer, load


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_growing_state_does_not_touch_the_slot_being_persisted(tmp_path, monkeypatch):
    gate = tmp_path / "gate"
    monkeypatch.setenv("TORCHLOOM_FLASH_TEST_GATE", str(gate))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    fc = FlashCheckpointer(tmp_path / "ckpt", model=model, optimizer=opt, shm_dir=tmp_path / "shm")
    try:
        at_step1 = _params(model)
        fc.save(1)  # parameters only: AdamW has no state yet; held at the gate
        model(torch.randn(4, 64)).sum().backward()
        opt.step()  # the moments appear: the state is ~3x larger
        fc.save(2, persist=False)  # into the other slot while step 1 is still being persisted
        gate.touch()
        fc.wait()
    finally:
        gate.touch()
        fc.finalize()
    fresh = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    info = load(tmp_path / "ckpt", model=fresh)
    assert info["step"] == 1
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, at_step1[k]), f"{k}: the persisted step 1 differs from the state saved"
