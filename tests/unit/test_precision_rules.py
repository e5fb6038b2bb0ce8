"""Precision rules of ``half`` and ``amp`` in one process (docs/methods/half.md, amp.md): buffers keep their
dtype, BatchNorm-like layers stay fp32 under half, amp upcasts a model handed in as bf16/fp16, autocast
outputs come back fp32 through every container, and batches are moved without changing dtypes.
The multi-rank checks (FSDP mixed precision, replays) are in tests/distributed/test_precision.py."""
from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

import torchloom
from tests.cases._workers import TinyCNN, cnn_loss
from tests.models import lm_loss, tiny_llama, token_batches
from torchloom.methods.amp import DTYPES, _to_float
from torchloom.train_step import move_to_device

ROTARY = ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq")


def _accelerate(model, strategy, loss=lm_loss, **kw):
    return torchloom.auto_accelerate(model, torch.optim.SGD, None, loss, strategy=strategy, optim_args={"lr": 0.1, "momentum": 0.9},
                                     model_input_format="unpack_dict", **kw)


def test_half_keeps_rotary_buffers_fp32_and_exact():
    ref = dict(tiny_llama().named_buffers())
    res = _accelerate(tiny_llama(), ["half"])
    bufs = dict(res.model.named_buffers())
    for n in ROTARY:
        assert bufs[n].dtype == torch.float32 and torch.equal(bufs[n], ref[n]), n
    assert {p.dtype for p in res.model.parameters()} == {torch.bfloat16}
    assert any("buffers keep their dtype" in n for n in res.notes), res.notes
    x = token_batches(2)
    assert torch.isfinite(res.train_step({"input_ids": x, "labels": x}))
    # the opt-in old behaviour: everything floating is cast
    res = _accelerate(tiny_llama(), [("half", {"cast_buffers": True})])
    assert all(dict(res.model.named_buffers())[n].dtype == torch.bfloat16 for n in ROTARY)


def test_half_keeps_batchnorm_fp32_and_trains():
    """bf16 BatchNorm weights next to fp32 statistics cannot run ("expected scalar type BFloat16 but found
    Float"), so the whole layer stays fp32; convs and the head are bf16."""
    res = _accelerate(TinyCNN(), ["half"], loss=cnn_loss,
                      prepare_input=lambda b, d: {"x": b["x"].to(d, torch.bfloat16), "labels": b["labels"]})
    for name, p in res.model.named_parameters():
        assert p.dtype == (torch.float32 if ".bn." in name else torch.bfloat16), name
    for name, b in res.model.named_buffers():
        assert b.dtype == (torch.int64 if "num_batches" in name else torch.float32), name
    before = res.model.blocks[0].bn.running_var.clone()
    g = torch.Generator().manual_seed(0)
    res.train_step({"x": torch.randn(4, 3, 6, 6, generator=g), "labels": torch.randint(0, 10, (4,), generator=g)})
    var = res.model.blocks[0].bn.running_var
    assert var.dtype == torch.float32 and not torch.equal(var, before) and torch.isfinite(var).all()
    assert any("4 parameters of BatchNorm-like layers kept in fp32" in n for n in res.notes), res.notes
    # cast_buffers=True: the layer is cast as a whole (model.to), which also runs
    res = _accelerate(TinyCNN(), [("half", {"cast_buffers": True})], loss=cnn_loss)
    assert res.model.blocks[0].bn.running_mean.dtype == torch.bfloat16


def test_half_on_meta_device_keeps_buffer_dtypes():
    with torch.device("meta"):
        model = TinyCNN()
    from torchloom.parallel.precision import cast_for_half

    r = cast_for_half(model, torch.float16)
    assert (r.cast, r.kept, r.came_low, r.norm_upcast) == (6, 4, [], [])  # convs and head (weight, bias) cast; the BatchNorms' kept
    assert model.head.weight.dtype == torch.float16 and model.blocks[0].bn.weight.dtype == torch.float32


class NormNet(nn.Module):
    """Linear + BatchNorm with a deliberately bf16 buffer (``scale``) that the forward uses."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.full((4,), 0.5, dtype=torch.bfloat16))

    def forward(self, x):
        return {"loss": (self.bn(self.lin(x)) * self.scale).float().pow(2).mean()}


def _norm_net_run(model, strategy, dtype=None):
    """Two SGD-with-momentum steps (AdamW's eps=1e-8 is 0 in fp16); returns the result and the BatchNorm
    running variance before training."""
    cast = (lambda b, d: {"x": b["x"].to(d, dtype)}) if dtype else None
    res = torchloom.auto_accelerate(model, torch.optim.SGD, None, lambda b, o: o["loss"], strategy=strategy,
                                    optim_args={"lr": 0.1, "momentum": 0.9}, model_input_format="unpack_dict",
                                    prepare_input=cast)
    before = res.model.bn.running_var.clone()
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        assert torch.isfinite(res.train_step({"x": torch.randn(4, 4, generator=g)}))
    return res, before


@pytest.mark.parametrize("came, target", [(torch.bfloat16, "bf16"), (torch.bfloat16, "fp16"),
                                          (torch.float16, "bf16"), (torch.float64, "bf16")])
def test_half_rule_holds_whatever_dtype_the_model_comes_in(came, target, recwarn):
    """Parameters -> the half dtype, BatchNorm-like layers (parameters and running statistics) -> fp32,
    other buffers untouched, from any input dtype. Before the fix a model cast to bf16 by the user kept bf16
    BatchNorm weights and statistics silently, and ('half', {'dtype': 'fp16'}) on it failed in the first
    forward with "RuntimeError: mixed dtype (CPU)"."""
    dtype = DTYPES[target]
    model = NormNet().to(came)
    model.scale = torch.full((4,), 0.5, dtype=torch.bfloat16)  # the deliberate buffer, whatever the cast
    res, before = _norm_net_run(model, [("half", {"dtype": target})], dtype)
    m = res.model
    assert m.lin.weight.dtype == m.lin.bias.dtype == dtype
    assert {m.bn.weight.dtype, m.bn.bias.dtype, m.bn.running_mean.dtype, m.bn.running_var.dtype} == {torch.float32}
    assert m.scale.dtype == torch.bfloat16 and m.bn.num_batches_tracked.dtype == torch.int64
    assert not torch.equal(m.bn.running_var, before)  # the statistics train, in fp32
    state = {v.dtype for st in res.optimizer.state.values() for v in st.values() if v.dim()}
    assert state == {dtype, torch.float32}
    warned = [str(w.message) for w in recwarn if "already in low precision" in str(w.message)]
    if came in (torch.bfloat16, torch.float16):
        assert len(warned) == 1 and "set back to fp32" in warned[0], warned
    else:
        assert not warned


def test_half_and_amp_on_an_fp32_model_keep_a_deliberate_low_buffer(recwarn):
    """A bf16 buffer next to fp32 parameters was chosen so: neither half nor amp casts it, and neither warns
    (before the fix amp upcast it to fp32 with a warning, although amp.md says buffers are never cast)."""
    for strategy, dtype in ((["half"], torch.bfloat16), (["amp"], None)):
        res, _ = _norm_net_run(NormNet(), strategy, dtype)
        assert res.model.scale.dtype == torch.bfloat16, strategy
        assert res.model.bn.running_var.dtype == torch.float32
    assert not [w for w in recwarn if "upcast" in str(w.message) or "low precision" in str(w.message)]
    assert any("buffers next to fp32 parameters keep their dtype" in n for n in res.notes), res.notes


def test_amp_upcasts_low_precision_batchnorm_statistics_of_an_fp32_model():
    """BatchNorm statistics must match the fp32 weights, so amp upcasts them even when the parameters are fp32
    (with the warning) while the model's other bf16 buffer stays bf16."""
    model = NormNet()
    model.bn.running_var = model.bn.running_var.bfloat16()
    with pytest.warns(UserWarning, match=r"bn\.running_var.*upcast to fp32"):
        res, _ = _norm_net_run(model, ["amp"])
    assert res.model.bn.running_var.dtype == torch.float32 and res.model.scale.dtype == torch.bfloat16


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_amp_upcasts_a_low_precision_model_with_a_warning(low):
    """A model handed to amp already cast (``model.to(bf16)``) gets fp32 master weights, gradients and
    optimizer state (before: all bf16, training silently in low precision)."""
    model = tiny_llama(tie=True).to(low)
    with pytest.warns(UserWarning, match="upcast to fp32"):
        res = _accelerate(model, [("amp", {"dtype": "bfloat16"})])
    assert res.model.lm_head.weight is res.model.model.embed_tokens.weight  # ties survive the upcast
    assert {p.dtype for p in res.model.parameters()} == {torch.float32}
    assert {b.dtype for b in res.model.buffers()} == {torch.float32}
    grads = set()
    res.optimizer.register_step_pre_hook(lambda o, a, k: grads.update(p.grad.dtype for p in res.model.parameters()))
    outs = []
    res.model.lm_head.register_forward_hook(lambda m, a, o: outs.append(o.dtype))
    x = token_batches(2)
    res.train_step({"input_ids": x, "labels": x})
    assert grads == {torch.float32} and outs == [torch.bfloat16]
    state = [v for st in res.optimizer.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    assert state and {v.dtype for v in state} == {torch.float32}


def test_amp_fp32_model_gets_no_warning(recwarn):
    _accelerate(tiny_llama(), ["amp"])
    assert not [w for w in recwarn if "upcast" in str(w.message)]


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    ids: torch.Tensor
    extra: list


def test_autocast_outputs_are_fp32_through_containers():
    """Every floating tensor the autocast forward returns is fp32, in any container; integers untouched and
    container types kept (namedtuples and dataclasses were returned in bf16 before)."""
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            ids = torch.arange(3)
            return {"d": y, "nt": Pair(y, ids), "dc": Out(y, ids, [y, (y, ids)]), "t": (y,), "l": [y]}

    res = torchloom.auto_accelerate(M(), torch.optim.SGD, None, lambda b, o: o["d"].sum(), strategy=["amp"],
                                    optim_args={"lr": 0.1})
    with torch.no_grad():
        out = res.model(torch.randn(2, 4))
    assert isinstance(out["nt"], Pair) and isinstance(out["dc"], Out)
    leaves = [out["d"], out["nt"].a, out["dc"].logits, out["dc"].extra[0], out["dc"].extra[1][0], out["t"][0], out["l"][0]]
    assert all(t.dtype == torch.float32 for t in leaves)
    assert out["nt"].b.dtype == out["dc"].ids.dtype == out["dc"].extra[1][1].dtype == torch.int64
    # the forward itself ran in bf16 (the fp32 values are upcast bf16 values)
    assert torch.equal(out["d"], out["d"].bfloat16().float())
    assert _to_float(3) == 3 and _to_float(None) is None


def test_move_to_device_follows_every_container_and_keeps_dtypes():
    @dataclasses.dataclass
    class Batch:
        x: torch.Tensor
        meta: dict

    b = {"dc": Batch(torch.ones(2), {"ids": torch.arange(2)}), "nt": Pair(torch.ones(1, dtype=torch.bfloat16), 3),
         "t": (torch.zeros(1),), "l": [torch.ones(1, dtype=torch.int32)], "s": "keep"}
    moved = move_to_device(b, torch.device("meta"))
    assert isinstance(moved["dc"], Batch) and moved["dc"].x.is_meta and moved["dc"].meta["ids"].is_meta
    assert isinstance(moved["nt"], Pair) and moved["nt"].a.is_meta and moved["nt"].a.dtype == torch.bfloat16
    assert moved["t"][0].is_meta and moved["l"][0].dtype == torch.int32 and moved["s"] == "keep"
