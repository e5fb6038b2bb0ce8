"""One trainer-state path (issue [5] item 4): the disk tier (``checkpoint.save``) and the flash tier
(``FlashCheckpointer`` + its saver) write the same checkpoint of the same state, through the same encoder:
the same ``trainer_state.json`` document, the same RNG file bytes at the same name, the same DCP keys, and
both load back strictly. Single process (the flash saver is a real subprocess)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn as nn

from torchloom.checkpoint import FlashCheckpointer, load, save
from torchloom.checkpoint.state import capture_rng, read_metadata_safely, restore_rng


@pytest.fixture(autouse=True)
def _keep_rng():
    st = capture_rng()
    yield
    restore_rng(st)


class Cursor:
    def __init__(self):
        self.index = 0

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, st):
        self.index = st["index"]


def _objects(seed):
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW([{"params": [m[0].weight, m[0].bias, m[2].weight, m[2].bias]},
                             {"params": list(m[1].parameters()), "lr": 1e-3}], lr=1e-2)
    return m, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5), Cursor()


def _opt_state(opt):
    return [{k: v.clone() for k, v in opt.state[p].items()} if p in opt.state else None
            for g in opt.param_groups for p in g["params"]]


def test_disk_and_flash_tiers_write_the_same_checkpoint(tmp_path):
    m, opt, sched, cur = _objects(0)
    m[1].requires_grad_(False)  # the second group gets no gradient: no state when saved
    for _ in range(2):
        m(torch.randn(3, 4)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        cur.index += 1
    rng = capture_rng()
    a = save(tmp_path / "disk", step=2, model=m, optimizer=opt, lr_scheduler=sched, dataloader=cur, extra={"k": (1, 2)})
    restore_rng(rng)
    fc = FlashCheckpointer(tmp_path / "flash", model=m, optimizer=opt, lr_scheduler=sched, dataloader=cur,
                           shm_dir=tmp_path / "shm", saver_timeout_s=120.0)
    assert fc.save(2, extra={"k": (1, 2)})
    fc.finalize()
    b = tmp_path / "flash" / "step_00000002"
    doc_a, doc_b = (json.loads((d / "trainer_state.json").read_text()) for d in (a, b))
    assert doc_a == doc_b and doc_a["optimizer_encoding"] == 2
    assert (a / "rng" / "rank0.pt").read_bytes() == (b / "rng" / "rank0.pt").read_bytes()
    keys_a, keys_b = (set(read_metadata_safely(d / ".metadata").state_dict_metadata) for d in (a, b))
    assert keys_a == keys_b and not any("1.weight" in k and "optim.state" in k for k in keys_a)
    for d in (a, b):
        m2, opt2, sched2, cur2 = _objects(1)
        m2[1].requires_grad_(False)
        info = load(d, model=m2, optimizer=opt2, lr_scheduler=sched2, dataloader=cur2, strict=True)
        assert info["extra"] == {"k": (1, 2)} and cur2.index == 2 and sched2.state_dict() == sched.state_dict()
        want, got = _opt_state(opt), _opt_state(opt2)
        assert [w is None for w in want] == [g is None for g in got]
        for w, g in zip(want, got):
            assert w is None or all(torch.equal(w[k], g[k]) for k in w)
        assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
