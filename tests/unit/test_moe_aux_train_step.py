"""TrainStep with torchloom.moe layers: the aux losses get exactly the factor the main loss gets (1/accum,
the fp16 loss scale, the SumLoss token weighting), and their values are reported separately."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchloom.moe import MoE, MoEConfig, aux_loss_scale
from torchloom.parallel.loss_scaler import DynamicLossScaler
from torchloom.train_step import SumLoss, TrainStep

VOCAB, DIM = 32, 16
TOL = 1e-6  # fp32 SGD(lr=1) parameters after one step; a wrongly scaled aux moves them by > 1e-3 (asserted)


class TinyMoELM(nn.Module):
    def __init__(self, **moe):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, DIM)
        cfg = dict(dim=DIM, hidden_dim=24, num_experts=4, top_k=2, aux_loss_weight=0.5, z_loss_weight=0.1)
        self.moe1 = MoE(MoEConfig(**{**cfg, **moe}))
        self.moe2 = MoE(MoEConfig(**{**cfg, **moe}))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        nn.init.normal_(self.moe1.router.weight, std=0.5)  # decisive, non-uniform routing: a large aux grad
        nn.init.normal_(self.moe2.router.weight, std=0.5)

    def forward(self, tokens):
        h = self.emb(tokens)
        h = h + self.moe1(h)
        h = h + self.moe2(h)
        return self.head(h)


def batches(n=2, rows=2, seq=6):
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (rows, seq), generator=g) for _ in range(n)]


def mean_loss(batch, logits):
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), batch[:, 1:].reshape(-1))


def sum_loss(batch, logits):
    labels = batch[:, 1:].clone()
    labels[0, :2] = -100  # uneven valid-token counts per micro-batch
    total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels.reshape(-1), reduction="sum",
                            ignore_index=-100)
    return SumLoss(total, (labels != -100).sum())


def hand_aux(model):
    """sum over layers of the weighted aux losses, recomputed by hand from the layers' last routing (with grad)."""
    return sum(m.last_aux_graph for m in (model.moe1, model.moe2))


def capture_aux(model):
    """Keep each layer's weighted aux loss *with* its graph, summed, to build the reference loss by hand."""
    def hook(mod, args, out):
        h = args[0].reshape(-1, DIM)
        r = mod.router.route(h)
        c = mod.config
        from torchloom.moe import load_balancing_loss, router_z_loss
        mod.last_aux_graph = (c.aux_loss_weight * load_balancing_loss(r.probs, r.selected, c.num_experts)
                              + c.z_loss_weight * router_z_loss(r.logits))
    for m in (model.moe1, model.moe2):
        m.register_forward_hook(hook)


def reference_step(model, data, loss_func, accum, aux_factor=None):
    """By hand: backward (main / accum + aux / accum) per micro-batch, aux factor 0 in the layers' own
    autoscaler (so only the hand-built aux counts), SGD lr=1. SumLoss: (sum totals + sum count*aux) / N."""
    capture_aux(model)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    n_total = None
    outs = []
    with aux_loss_scale(0.0):
        for b in data:
            out = loss_func(b, model(b))
            outs.append((out, hand_aux(model)))
        if isinstance(outs[0][0], SumLoss):
            n_total = sum(float(o.count) for o, _ in outs)
            loss = sum(o.total + float(o.count) * a for o, a in outs) / n_total
        else:
            f = (1.0 / accum) if aux_factor is None else aux_factor
            loss = sum(o / accum + f * a for o, a in outs)
        loss.backward()
    opt.step()
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def train_step_params(model, data, loss_func, accum, **kw):
    step = TrainStep(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), loss_func=loss_func,
                     device=torch.device("cpu"), grad_accum_steps=accum, **kw)
    reports = [step(b) for b in data]
    return step, reports, {k: v.detach().clone() for k, v in model.named_parameters()}


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("loss_func", [mean_loss, sum_loss], ids=["mean", "SumLoss"])
def test_grad_accum_aux_factor_matches_hand_loss(loss_func):
    model = TinyMoELM()
    ref = reference_step(copy.deepcopy(model), batches(), loss_func, accum=2)
    step, reports, got = train_step_params(copy.deepcopy(model), batches(), loss_func, accum=2)
    assert max_diff(got, ref) < TOL
    if loss_func is mean_loss:  # a run whose aux got factor 1 (not 1/accum) is far off
        wrong = reference_step(copy.deepcopy(model), batches(), loss_func, accum=2, aux_factor=1.0)
        assert max_diff(wrong, ref) > 1e3 * TOL
    # the reported loss is the main loss only
    with aux_loss_scale(0.0), torch.no_grad():
        m0 = copy.deepcopy(model)
        main = [loss_func(b, m0(b)) for b in batches()]
    main = [(o.total / float(o.count)) if isinstance(o, SumLoss) else o for o in main]
    for r, m in zip(reports, main):
        assert torch.allclose(r, m.float(), atol=1e-6)


def test_fp16_loss_scale_applies_to_aux():
    model = TinyMoELM()
    ref = reference_step(copy.deepcopy(model), batches(), mean_loss, accum=2)
    _, _, got = train_step_params(copy.deepcopy(model), batches(), mean_loss, accum=2,
                                  loss_scaler=DynamicLossScaler(init_scale=1024.0))
    assert max_diff(got, ref) < 1e-5  # fp32 math scaled by 1024 and back: ~1e-7 relative


def test_last_moe_metrics_average_the_window():
    model = TinyMoELM()
    expected = {"load_balance_loss": 0.0, "z_loss": 0.0}
    m0 = copy.deepcopy(model)
    with torch.no_grad():
        for b in batches():
            m0(b)
            for layer in (m0.moe1, m0.moe2):
                for k in expected:
                    expected[k] += float(layer.last_aux[k]) / 2
    step, _, _ = train_step_params(model, batches(), mean_loss, accum=2)
    got = step.last_moe_metrics
    for k, v in expected.items():
        assert got[k] == pytest.approx(v, rel=1e-5)
    assert got["aux_loss"] == pytest.approx(sum(expected.values()), rel=1e-5)
    assert got["dropped_fraction"] == 0.0
    load = step.last_expert_load
    assert load.shape == (2, 4) and load.sum(dim=1).tolist() == [2 * 12 * 2] * 2  # 2 mbs x 12 tokens x k=2


def test_capacity_drops_reported():
    step, _, _ = train_step_params(TinyMoELM(capacity_factor=0.5), batches(), mean_loss, accum=1)
    assert 0.0 < step.last_moe_metrics["dropped_fraction"] < 1.0


def test_no_moe_no_metrics():
    model = nn.Sequential(nn.Embedding(VOCAB, DIM), nn.Linear(DIM, VOCAB))
    step, _, _ = train_step_params(model, batches(), mean_loss, accum=2)
    assert step.last_moe_metrics is None and step.last_expert_load is None
