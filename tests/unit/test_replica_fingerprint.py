"""The parameter fingerprint behind the replica check (torchloom.parallel.consistency): exact, independent
of how the tensor is chunked, and changed by a one-ulp difference in any dtype."""
import pytest
import torch

from torchloom.parallel import consistency
from torchloom.parallel.consistency import fingerprint
from torchloom.parallel.unused_params import clean_name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_ulp_changes_the_fingerprint(dtype):
    t = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert torch.equal(fingerprint(t), fingerprint(t.clone()))
    u = t.clone()
    u[417] = torch.nextafter(u[417].float(), torch.tensor(float("inf"))).to(dtype) if dtype != torch.float64 \
        else torch.nextafter(u[417], torch.tensor(float("inf"), dtype=dtype))
    if torch.equal(u, t):  # the fp32 neighbour rounded back: step the raw bits instead
        u.view(torch.int16 if t.element_size() == 2 else torch.int64)[417] += 1
    assert not torch.equal(u, t)
    assert not torch.equal(fingerprint(u)[:2], fingerprint(t)[:2])


def test_fingerprint_does_not_depend_on_chunking(monkeypatch):
    t = torch.randn(4097, 3, generator=torch.Generator().manual_seed(1))
    whole = fingerprint(t)
    monkeypatch.setattr(consistency, "_CHUNK", 100)
    assert torch.equal(fingerprint(t)[:2], whole[:2])  # integer sums wrap exactly in any order
    assert fingerprint(t)[2:].view(torch.float64).item() == pytest.approx(t.double().sum().item(), rel=1e-12)
    # a non-contiguous view hashes its values, not its storage
    assert torch.equal(fingerprint(t.t()), fingerprint(t.t().contiguous()))


def test_clean_name_drops_wrapper_components():
    assert clean_name("module.model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"
    assert clean_name("_orig_mod.module.lm_head.weight") == "lm_head.weight"
