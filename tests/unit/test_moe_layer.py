"""torchloom.moe: router variants, capacity dropping, aux losses against the formulas by hand, idle experts'
gradients, activation-checkpoint recomputation and per-expert load tracking (HF models too)."""
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from torchloom.moe import (GroupedExperts, MoE, MoEConfig, MoEConfigError, aux_loss_scale, aux_losses, dropped_load,
                           expert_load, is_experts_module, load_balancing_loss, router_z_loss, track_expert_load)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from models import tiny_moe, token_batches  # noqa: E402

TOL = 1e-5  # fp32 per-token loop vs the grouped layer; a wrong weight rule (unnormalised, wrong k) is off by > 1e-2

# fixed logits [T=4, E=4]: t0, t1 prefer e0 then e1; t2, t3 prefer e1 then e0
LOGITS = torch.tensor([[3.0, 2.0, 0.0, -1.0],
                       [2.5, 1.0, 0.0, -1.0],
                       [2.0, 3.0, 0.0, -1.0],
                       [1.0, 2.5, -1.0, 0.0]])


def fixed_logit_moe(**kw):
    """A MoE on D = E = 4 whose router gives LOGITS for x = I (logits[t, e] = W[e, t])."""
    m = MoE(MoEConfig(**{**dict(dim=4, hidden_dim=8, num_experts=4, top_k=2), **kw}))
    with torch.no_grad():
        m.router.weight.copy_(LOGITS.t())
    return m, torch.eye(4)


def expert_out(m, e, x):
    w = m.experts
    return w.w2[e] @ (F.silu(w.w1[e] @ x) * (w.w3[e] @ x))


def naive(m, x):
    """Per-token reference of MoEConfig's routing rules (python selection, no capacity)."""
    c, out = m.config, []
    for xt in x:
        logits = [float(v) for v in m.router.weight.detach() @ xt]
        order = sorted(range(c.num_experts), key=lambda e: -logits[e])[:c.top_k]
        if c.score_func == "sigmoid":
            s = [1 / (1 + math.exp(-logits[e])) for e in order]
            w = [v / sum(s) for v in s] if c.norm_topk_prob else s
        elif c.softmax_before_topk:
            z = sum(math.exp(v) for v in logits)
            s = [math.exp(logits[e]) / z for e in order]
            w = [v / sum(s) for v in s] if c.norm_topk_prob else s
        else:
            z = sum(math.exp(logits[e]) for e in order)
            w = [math.exp(logits[e]) / z for e in order]
        y = sum(wj * expert_out(m, e, xt) for wj, e in zip(w, order))
        if m.shared is not None:
            y = y + m.shared(xt)
        out.append(y)
    return torch.stack(out)


def test_aux_and_z_loss_equal_the_formulas_by_hand():
    probs = [[math.exp(v) / sum(math.exp(u) for u in row) for v in row] for row in LOGITS.tolist()]
    chosen = [sorted(range(4), key=lambda e: -row[e])[:2] for row in LOGITS.tolist()]  # [[0,1],[0,1],[1,0],[1,0]]
    f = [sum(e in c for c in chosen) / (4 * 2) for e in range(4)]  # 0.5, 0.5, 0, 0
    p = [sum(r[e] for r in probs) / 4 for e in range(4)]
    lb = 4 * sum(fe * pe for fe, pe in zip(f, p))
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in LOGITS.tolist()) / 4
    sel = torch.tensor(chosen)
    assert load_balancing_loss(torch.softmax(LOGITS, -1), sel, 4).item() == pytest.approx(lb, rel=1e-6)
    assert router_z_loss(LOGITS).item() == pytest.approx(z, rel=1e-6)
    # the layer records them weighted
    m, x = fixed_logit_moe(aux_loss_weight=0.3, z_loss_weight=0.01)
    m(x)
    assert m.last_aux["load_balance_loss"].item() == pytest.approx(0.3 * lb, rel=1e-6)
    assert m.last_aux["z_loss"].item() == pytest.approx(0.01 * z, rel=1e-6)
    m2, _ = fixed_logit_moe(aux_loss_weight=0.3, z_loss_weight=0.01)
    m2(x)
    assert aux_losses(nn.ModuleList([m, m2]))["z_loss"].item() == pytest.approx(0.02 * z, rel=1e-6)  # summed
    # Hugging Face's load_balancing_loss_func (counts / T, not / (T k)) is k times ours
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    assert load_balancing_loss_func((LOGITS,), 4, 2).item() == pytest.approx(2 * lb, rel=1e-6)
    # uniform routing gives 1 for every k
    uniform = torch.full((8, 4), 0.25)
    assert load_balancing_loss(uniform, torch.arange(8).reshape(4, 2) % 4, 4).item() == pytest.approx(1.0)


def test_aux_gradient_is_weight_times_formula_and_follows_the_scale():
    def grads(scale, by_hand):
        m, x = fixed_logit_moe(aux_loss_weight=0.3, z_loss_weight=0.01)
        x = x + 0.1 * torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        with aux_loss_scale(0.0 if by_hand else scale):
            y = m(x)
            loss = y.square().sum()
            if by_hand:
                r = m.router.route(x)
                aux = 0.3 * load_balancing_loss(r.probs, r.selected, 4) + 0.01 * router_z_loss(r.logits)
                loss = loss + scale * aux
            loss.backward()
        return m.router.weight.grad.clone()

    for scale in (1.0, 0.5):
        assert torch.allclose(grads(scale, by_hand=False), grads(scale, by_hand=True), atol=1e-7)
    assert (grads(1.0, False) - grads(0.0, False)).abs().max() > 1e-3  # the aux term is not negligible here


def test_capacity_drops_second_choices_first_then_later_tokens():
    # C = ceil(cf * T * k / E): cf 1.0 -> 2 slots, cf 1.5 -> 3 slots per expert
    m, x = fixed_logit_moe(capacity_factor=1.0)
    w, idx, logits = m.router(x)
    # expert 0 is full with t0, t1's first choices, so t2, t3's second choices (e0) drop; expert 1 takes t2, t3's
    # first choices and drops t0, t1's second choices (token order alone would have kept t0, t1 and dropped t2, t3)
    assert idx.tolist() == [[0, 4], [0, 4], [1, 4], [1, 4]]
    assert (w[:, 1] == 0).all() and (w[:, 0] > 0).all()
    y = m(x)
    for t in range(4):
        assert torch.allclose(y[t], w[t, 0] * expert_out(m, idx[t, 0].item(), x[t]), atol=1e-6)
    assert expert_load(m).tolist() == [[4, 4, 0, 0]] and dropped_load(m).tolist() == [[2, 2, 0, 0]]

    m, x = fixed_logit_moe(capacity_factor=1.5)
    _, idx, _ = m.router(x)
    assert idx.tolist() == [[0, 1], [0, 4], [1, 0], [1, 4]]  # third slot: the earliest token's second choice
    m(x)
    assert dropped_load(m).tolist() == [[1, 1, 0, 0]]

    m, x = fixed_logit_moe(capacity_factor=None)  # dropless
    _, idx, _ = m.router(x)
    assert idx.tolist() == [[0, 1], [0, 1], [1, 0], [1, 0]]
    m(x)
    assert dropped_load(m).tolist() == [[0, 0, 0, 0]]


@pytest.mark.parametrize("kw", [
    dict(top_k=1), dict(top_k=2), dict(top_k=4), dict(top_k=2, norm_topk_prob=False),
    dict(top_k=2, softmax_before_topk=False), dict(top_k=1, softmax_before_topk=False),
    dict(top_k=2, score_func="sigmoid"), dict(top_k=2, score_func="sigmoid", norm_topk_prob=False),
    dict(top_k=2, num_shared_experts=2),
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_routing_variants_match_a_per_token_loop(kw):
    torch.manual_seed(1)
    m = MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=4, init_std=0.5, **kw))
    x = torch.randn(3, 5, 8)
    y = m(x)
    assert y.shape == x.shape
    with torch.no_grad():
        assert torch.allclose(y.reshape(-1, 8), naive(m, x.reshape(-1, 8)), atol=TOL)
    w, idx, logits = m.router(x.reshape(-1, 8))
    assert w.shape == idx.shape == (15, kw["top_k"]) and idx.dtype == torch.int64 and logits.shape == (15, 4)
    assert torch.equal(m(x), y)  # deterministic


def test_idle_and_dropped_experts_get_zero_not_none_gradients():
    m, x = fixed_logit_moe(num_experts=4)  # experts 2, 3 receive no token
    m(x).sum().backward()
    g = m.experts.w1.grad
    assert g is not None and (g[2:] == 0).all() and (g[:2] != 0).any()
    ex = GroupedExperts(4, 8, 16)
    h = torch.randn(5, 8, requires_grad=True)
    out = ex(h, torch.full((5, 2), 4), torch.ones(5, 2))  # every assignment dropped
    assert (out == 0).all()
    out.sum().backward()
    assert all(p.grad is not None and (p.grad == 0).all() for p in ex.parameters())
    empty = ex(torch.zeros(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, 8)


class TwoLayer(nn.Module):
    def __init__(self, ckpt=None, **kw):
        super().__init__()
        torch.manual_seed(0)
        cfg = MoEConfig(dim=8, hidden_dim=12, num_experts=4, top_k=2, z_loss_weight=0.01, init_std=0.3, **kw)
        self.layers = nn.ModuleList([MoE(cfg), MoE(cfg)])
        self.ckpt = ckpt

    def forward(self, x):
        for m in self.layers:
            x = x + (checkpoint(m, x, use_reentrant=self.ckpt == "reentrant") if self.ckpt else m(x))
        return x


@pytest.mark.parametrize("ckpt", ["non_reentrant", "reentrant"])
@pytest.mark.parametrize("cf", [None, 1.0])
def test_activation_checkpointing_recomputes_the_same_routing(ckpt, cf):
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3), requires_grad=True)
    ref, got = TwoLayer(capacity_factor=cf), TwoLayer(ckpt, capacity_factor=cf)
    tr_ref, tr_got = track_expert_load(ref), track_expert_load(got)
    ref(x).square().sum().backward()
    got(x).square().sum().backward()
    for (n, a), b in zip(ref.named_parameters(), got.parameters()):
        assert torch.equal(a.grad, b.grad), n  # recomputation is deterministic: bit-equal
    assert torch.equal(tr_ref.counts(), tr_got.counts())  # recomputation not counted twice
    assert all(m.window_forwards == 1 for m in got.layers)
    assert torch.equal(expert_load(ref), expert_load(got))


def test_router_math_in_fp32_under_autocast():
    torch.manual_seed(0)
    m = MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=4))
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w, idx, logits = m.router(x)
        y = m(x)
    assert logits.dtype == torch.float32 and w.dtype == torch.bfloat16 and y.dtype == torch.bfloat16
    assert torch.allclose(logits, x.float() @ m.router.weight.t(), atol=1e-6)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_track_expert_load_on_hugging_face_models(family):
    model = tiny_moe(family, experts=4, top_k=2, layers=2)
    routed = []
    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):  # the HF router returns (logits, scores, indices)
            mod.register_forward_hook(lambda mod, a, out: routed.append(out[2]))
    tracker = track_expert_load(model)
    tokens = token_batches(3, seq=8)
    model(tokens)
    expected = torch.stack([torch.bincount(i.reshape(-1), minlength=4) for i in routed])
    assert tracker.counts().tolist() == expected.tolist() and int(expected.sum()) == 2 * 3 * 8 * 2
    model(tokens)
    assert tracker.counts().tolist() == (2 * expected).tolist()
    tracker.reset()
    assert tracker.counts().sum() == 0
    tracker.remove()
    model(tokens)
    assert tracker.counts().sum() == 0


def test_protocol_and_config_errors():
    m = MoE(MoEConfig(dim=8, hidden_dim=12, num_experts=4))
    assert is_experts_module(m.experts) and not is_experts_module(m.router)
    for bad, word in [(dict(top_k=5), "top_k"), (dict(score_func="relu"), "score_func"),
                      (dict(capacity_factor=0), "capacity_factor"), (dict(aux_loss_weight=-1), "aux_loss_weight"),
                      (dict(score_func="sigmoid", softmax_before_topk=False), "softmax_before_topk"),
                      (dict(num_shared_experts=-1), "num_shared_experts"),
                      (dict(router_dtype=torch.int32), "router_dtype"),
                      (dict(num_experts=0), "num_experts")]:
        with pytest.raises(MoEConfigError, match=word):
            MoEConfig(**{**dict(dim=8, hidden_dim=12, num_experts=4), **bad})
    with pytest.raises(ValueError, match="no experts module"):
        track_expert_load(nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"\[\.\.\., 8\]"):
        m(torch.randn(2, 7))


def test_meta_device_build_materialises_to_the_plain_build():
    from torchloom.parallel.materialize import materialize_meta_model

    cfg = MoEConfig(dim=8, hidden_dim=12, num_experts=4, num_shared_experts=1)
    torch.manual_seed(0)
    plain = MoE(cfg)
    with torch.device("meta"):
        meta = MoE(cfg)
    torch.manual_seed(0)
    materialize_meta_model(meta, torch.device("cpu"))
    for (n, a), b in zip(plain.named_parameters(), meta.parameters()):
        assert torch.equal(a, b), n  # every initialiser replays in the plain build's order
