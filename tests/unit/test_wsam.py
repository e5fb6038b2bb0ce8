"""WSAM (torchloom.optim.WSAM) against an independent NumPy reference of the paper's formulas, SAM, the
base optimizer alone, and TrainStep's replay pattern. One process, CPU.

Tolerances:
- NumPy reference (float64 model): atol 1e-8, against moves of > 1e-3. WSAM's global norm is fp32
  (``global_grad_norm``), so the perturbation carries ~1e-7 relative error; measured ~2e-9 on the
  weights after 4 steps.
- WSAM(gamma=0.5, coupled) vs an independent SAM loop (float64): atol 1e-8 (same fp32-norm argument).
- TrainStep with accumulation vs the closure on the full batch (tiny Llama, fp32, SGD+momentum): atol
  2e-6; the only difference is the summation order of micro-batch gradients.
"""
from __future__ import annotations

import copy
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.models import lm_loss, tiny_llama, token_batches
from torchloom.optim import WSAM
from torchloom.train_step import SumLoss, TrainStep

D, H, N = 3, 5, 12


# ----------------------------------------------------------------------------------- NumPy reference
def np_grads(w, x, t):
    """Hand-written backprop of mean((W2 tanh(W1 x + b1) + b2 - t)^2) for w = [W1, b1, W2, b2]."""
    W1, b1, W2, b2 = w
    a = np.tanh(x @ W1.T + b1)
    y = a @ W2.T + b2
    dy = 2.0 * (y - t) / y.size
    dz = (dy @ W2) * (1.0 - a * a)
    return [dz.T @ x, dz.sum(0), dy.T @ a, dy.sum(0)]


def np_sgd(w, g, st, lr, momentum=0.0, weight_decay=0.0):
    """torch.optim.SGD's update (dampening 0, no Nesterov), one parameter at a time."""
    out = []
    for i in range(len(w)):
        d = g[i] + weight_decay * w[i]
        if momentum:
            st[i] = d.copy() if i not in st else momentum * st[i] + d
            d = st[i]
        out.append(w[i] - lr[i] * d)
    return out


def np_adamw(w, g, st, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """torch.optim.AdamW's update (decoupled weight decay, bias-corrected moments)."""
    b1, b2 = betas
    out = []
    for i in range(len(w)):
        m, v, k = st.get(i, (np.zeros_like(w[i]), np.zeros_like(w[i]), 0))
        k += 1
        m = b1 * m + (1 - b1) * g[i]
        v = b2 * v + (1 - b2) * g[i] * g[i]
        st[i] = (m, v, k)
        p = w[i] * (1 - lr[i] * weight_decay)
        denom = np.sqrt(v) / np.sqrt(1 - b2**k) + eps
        out.append(p - lr[i] / (1 - b1**k) * m / denom)
    return out


def np_wsam_step(w, x, t, base, st, lr, rho, gamma, adaptive, decouple, max_norm=None, sam_eps=1e-12):
    """One step of the paper's Algorithm 1 (decoupled) or of gradient descent on L + alpha * sharpness
    (coupled), written out per parameter. ``lr``/``rho``: per-parameter lists (parameter groups)."""
    g = np_grads(w, x, t)
    sq = 0.0
    for wi, gi in zip(w, g):
        s = np.abs(wi) * gi if adaptive else gi
        sq += float((s * s).sum())
    norm = np.sqrt(sq)
    e = [rho[i] * (w[i] * w[i] if adaptive else 1.0) * g[i] / (norm + sam_eps) for i in range(len(w))]
    g_pert = np_grads([w[i] + e[i] for i in range(len(w))], x, t)
    alpha = gamma / (1 - gamma)
    final = list(g) if decouple else [g[i] + alpha * (g_pert[i] - g[i]) for i in range(len(w))]
    if max_norm is not None:
        total = np.sqrt(sum(float((f * f).sum()) for f in final))
        coef = min(1.0, max_norm / (total + 1e-6))
        final = [f * coef for f in final]
    new = base(w, final, st, lr)
    if decouple:
        new = [new[i] - lr[i] * alpha * (g_pert[i] - g[i]) for i in range(len(w))]
    return new


def mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, 1)).double()


def data(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, D, generator=g, dtype=torch.float64), torch.randn(N, 1, generator=g, dtype=torch.float64)


def as_numpy(model):
    return [p.detach().numpy().copy() for p in model.parameters()]


CASES = {
    "sgd_decoupled": dict(base="sgd", decouple=True, adaptive=False),
    "sgd_coupled": dict(base="sgd", decouple=False, adaptive=False),
    "adamw_decoupled": dict(base="adamw", decouple=True, adaptive=False),
    "adamw_coupled_adaptive": dict(base="adamw", decouple=False, adaptive=True),
    "sgd_decoupled_adaptive": dict(base="sgd", decouple=True, adaptive=True),
    "sgd_coupled_clipped": dict(base="sgd", decouple=False, adaptive=False, max_norm=0.05),
    "adamw_decoupled_clipped": dict(base="adamw", decouple=True, adaptive=False, max_norm=0.05),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_numpy_reference(name):
    c = CASES[name]
    max_norm, gamma, rho = c.get("max_norm"), 0.9, 0.3
    model = mlp()
    w = as_numpy(model)
    x, t = data()
    # two parameter groups with their own lr and rho: the sharpness step must use each group's lr
    lrs, rhos = (0.05, 0.02), (rho, 0.5 * rho)
    groups = [{"params": list(model[0].parameters()), "lr": lrs[0], "rho": rhos[0]},
              {"params": list(model[2].parameters()), "lr": lrs[1], "rho": rhos[1]}]
    if c["base"] == "sgd":
        opt = WSAM(groups, torch.optim.SGD, lr=0.1, momentum=0.9, weight_decay=0.01, gamma=gamma,
                   adaptive=c["adaptive"], decouple=c["decouple"], max_norm=max_norm)
        base = functools.partial(np_sgd, momentum=0.9, weight_decay=0.01)
    else:
        opt = WSAM(groups, torch.optim.AdamW, lr=0.1, weight_decay=0.01, gamma=gamma,
                   adaptive=c["adaptive"], decouple=c["decouple"], max_norm=max_norm)
        base = functools.partial(np_adamw, weight_decay=0.01)
    lr, rho_p = [lrs[0]] * 2 + [lrs[1]] * 2, [rhos[0]] * 2 + [rhos[1]] * 2
    st = {}
    for _ in range(4):
        opt.step(lambda: F.mse_loss(model(x), t).backward())
        w = np_wsam_step(w, x.numpy(), t.numpy(), base, st, lr, rho_p, gamma, c["adaptive"], c["decouple"], max_norm)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(w, as_numpy(mlp())))
    assert moved > 1e-3, "the reference barely moved: the comparison would not test anything"
    for got, want in zip(as_numpy(model), w):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-8)
    if max_norm is not None:  # the clipping was active and its norm is reported
        assert opt.last_grad_norm is not None and float(opt.last_grad_norm) > max_norm


def test_first_step_second_step_equal_closure_step():
    x, t = data()
    a, b = mlp(), mlp()
    oa = WSAM(a.parameters(), torch.optim.AdamW, lr=0.01)
    ob = WSAM(b.parameters(), torch.optim.AdamW, lr=0.01)
    for _ in range(3):
        oa.step(lambda: F.mse_loss(a(x), t).backward())
        F.mse_loss(b(x), t).backward()
        ob.first_step(zero_grad=True)
        F.mse_loss(b(x), t).backward()
        ob.second_step(zero_grad=True)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def sam_reference(model, base, x, t, rho, steps):
    """Independent SAM (Foret et al., ICLR 2021): base optimizer on the gradient at w + rho g / ||g||."""
    params = list(model.parameters())
    for _ in range(steps):
        g = torch.autograd.grad(F.mse_loss(model(x), t), params)
        norm = torch.sqrt(sum((gi * gi).sum() for gi in g))
        with torch.no_grad():
            e = [rho * gi / (norm + 1e-12) for gi in g]
            for p, ei in zip(params, e):
                p.add_(ei)
        g_pert = torch.autograd.grad(F.mse_loss(model(x), t), params)
        with torch.no_grad():
            for p, ei, gp in zip(params, e, g_pert):
                p.sub_(ei)
                p.grad = gp.clone()
        base.step()


@pytest.mark.parametrize("base_name,decouple", [("adamw", False), ("sgd_momentum", False), ("sgd_plain", True)])
def test_gamma_half_is_sam(base_name, decouple):
    """gamma = 0.5 (alpha = 1): coupled WSAM is SAM for any base optimizer; decoupled WSAM equals SAM
    for plain SGD (g + (g~ - g) = g~ with a linear update)."""
    make = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=0.05),
            "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "sgd_plain": lambda ps: torch.optim.SGD(ps, lr=0.1)}[base_name]
    x, t = data()
    a, b = mlp(), mlp()
    opt = WSAM(a.parameters(), make, rho=0.2, gamma=0.5, decouple=decouple)
    for _ in range(4):
        opt.step(lambda: F.mse_loss(a(x), t).backward())
    sam_reference(b, make(list(b.parameters())), x, t, rho=0.2, steps=4)
    assert not torch.allclose(a[0].weight, mlp()[0].weight, atol=1e-3)
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-8)


def test_gamma_zero_is_the_base_optimizer():
    x, t = data()
    a, b = mlp(), mlp()
    opt = WSAM(a.parameters(), torch.optim.AdamW, lr=0.05, gamma=0.0)
    ref = torch.optim.AdamW(b.parameters(), lr=0.05)
    for _ in range(3):
        opt.step(lambda: F.mse_loss(a(x), t).backward())
        ref.zero_grad()
        F.mse_loss(b(x), t).backward()
        ref.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_state_dict_round_trip_resumes_exactly():
    """4 steps straight == 2 steps, state_dict into a fresh WSAM (new model copy), 2 more (bitwise)."""
    x, t = data()
    a = mlp()
    oa = WSAM(a.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    sched_a = torch.optim.lr_scheduler.StepLR(oa, 1, gamma=0.7)
    for _ in range(4):
        oa.step(lambda: F.mse_loss(a(x), t).backward())
        sched_a.step()

    b = mlp()
    ob = WSAM(b.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1)
    sched_b = torch.optim.lr_scheduler.StepLR(ob, 1, gamma=0.7)
    for _ in range(2):
        ob.step(lambda: F.mse_loss(b(x), t).backward())
        sched_b.step()
    sd, ssd, msd = copy.deepcopy(ob.state_dict()), sched_b.state_dict(), copy.deepcopy(b.state_dict())
    assert {"rho", "gamma", "sam_eps", "adaptive"} <= set(sd["param_groups"][0]) and sd["state"]

    c = mlp(seed=5)
    c.load_state_dict(msd)
    oc = WSAM(c.parameters(), torch.optim.AdamW, lr=0.05, weight_decay=0.1, rho=0.9)  # rho comes from the state
    sched_c = torch.optim.lr_scheduler.StepLR(oc, 1, gamma=0.7)
    oc.load_state_dict(sd)
    sched_c.load_state_dict(ssd)
    assert oc.param_groups is oc.base_optimizer.param_groups and oc.state is oc.base_optimizer.state
    assert oc.param_groups[0]["rho"] == 0.05
    for _ in range(2):
        oc.step(lambda: F.mse_loss(c(x), t).backward())
        sched_c.step()
    for p, q in zip(a.parameters(), c.parameters()):
        assert torch.equal(p, q)


def test_batchnorm_statistics_updated_once_per_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.Tanh(), nn.Linear(H, 1)).double()
    ref = copy.deepcopy(model)
    x, t = data()
    opt = WSAM(model, torch.optim.SGD, lr=0.1)  # the model as first argument (ATorch style)
    opt.step(lambda: F.mse_loss(model(x), t).backward())
    ref(x)  # one forward at the original weights
    bn, rbn = model[1], ref[1]
    assert int(bn.num_batches_tracked) == 1
    assert torch.equal(bn.running_mean, rbn.running_mean) and torch.equal(bn.running_var, rbn.running_var)


def test_atorch_style_built_base_optimizer():
    x, t = data()
    a, b = mlp(), mlp()
    base = torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9)
    oa = WSAM(a, base, 0.05, 0.9)  # ATorch: WeightedSAM(model, base_optimizer, rho, gamma, ...)
    ob = WSAM(b.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    for _ in range(2):
        oa.step(lambda: F.mse_loss(a(x), t).backward())
        ob.step(lambda: F.mse_loss(b(x), t).backward())
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_zero_gradient_step_initialises_state_without_closure():
    """torch.distributed.checkpoint initialises optimizer state with step() on zero gradients."""
    model = mlp()
    opt = WSAM(model.parameters(), torch.optim.AdamW, lr=0.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert len(opt.state) == 4 and all("exp_avg" in s for s in opt.state.values())


def test_errors():
    model = mlp()
    with pytest.raises(ValueError, match="gamma"):
        WSAM(model.parameters(), torch.optim.SGD, lr=0.1, gamma=1.0)
    with pytest.raises(ValueError, match="rho"):
        WSAM(model.parameters(), torch.optim.SGD, lr=0.1, rho=-1)
    with pytest.raises(ValueError, match="max_norm"):
        WSAM(model.parameters(), torch.optim.SGD, lr=0.1, max_norm=0)
    with pytest.raises(TypeError, match="built base optimizer"):
        WSAM(model, torch.optim.SGD(model.parameters(), lr=0.1), lr=0.1)
    with pytest.raises(TypeError, match="base_optimizer"):
        WSAM(model.parameters(), "sgd")
    with pytest.raises(ValueError, match="differ"):
        WSAM(list(model[0].parameters()), torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="two-pass"):
        WSAM(model.parameters(), lambda ps: WSAM(ps, torch.optim.SGD, lr=0.1))
    opt = WSAM(model.parameters(), torch.optim.SGD, lr=0.1)
    x, t = data()
    F.mse_loss(model(x), t).backward()
    with pytest.raises(ValueError, match="two forward/backward passes"):
        opt.step()
    with pytest.raises(RuntimeError, match="needs first_step"):
        opt.second_step()
    opt.first_step()
    with pytest.raises(RuntimeError, match="twice"):
        opt.first_step()
    with pytest.raises(RuntimeError, match="perturbed"):
        opt.state_dict()


# ----------------------------------------------------------------------------------- TrainStep
def _ids(step, k, micro, accum):
    data = token_batches(64, seq=16)
    per_step = micro * accum
    return data[step * per_step + k * micro: step * per_step + (k + 1) * micro]


def _sum_loss(batch, output):
    logits = output.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    total = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
    return SumLoss(total, labels.numel())


@pytest.mark.parametrize("mode", ["mean", "sum", "clip"])
def test_train_step_replay_equals_closure_on_full_batch(mode):
    steps, micro, accum = 3, 2, 3
    kw = dict(lr=0.1, momentum=0.9, rho=0.1, gamma=0.8)
    clip = 0.5 if mode == "clip" else None
    model = tiny_llama()
    opt = WSAM(model.parameters(), torch.optim.SGD, **kw)
    ts = TrainStep(model=model, optimizer=opt, loss_func=_sum_loss if mode == "sum" else lm_loss,
                   device=torch.device("cpu"), grad_accum_steps=accum, model_input_format="unpack_dict",
                   max_grad_norm=clip)
    ref = tiny_llama()
    ropt = WSAM(ref.parameters(), torch.optim.SGD, max_norm=clip, **kw)
    norms, ref_norms = [], []
    for s in range(steps):
        reports = [ts({"input_ids": _ids(s, k, micro, accum), "labels": _ids(s, k, micro, accum)})
                   for k in range(accum)]
        norms.append(ts.last_grad_norm)
        full = torch.cat([_ids(s, k, micro, accum) for k in range(accum)])

        def closure():
            out = ref(input_ids=full, labels=full).loss
            out.backward()
            return out

        loss = ropt.step(closure)
        ref_norms.append(ropt.last_grad_norm)
        torch.testing.assert_close(torch.stack(reports).mean(), loss.detach(), rtol=1e-5, atol=0)
    assert ts.optimizer_steps == steps and opt.state  # momentum buffers exist
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=2e-6, msg=lambda m: f"{n}: {m}")
    if clip is not None:
        assert all(float(n) > clip for n in norms), "the clipping must have been active"
        torch.testing.assert_close(torch.stack(norms), torch.stack(ref_norms), rtol=1e-5, atol=0)
    assert not torch.equal(model.model.embed_tokens.weight, tiny_llama().model.embed_tokens.weight)


def test_train_step_batchnorm_counts_each_micro_batch_once():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, H), nn.BatchNorm1d(H), nn.Tanh(), nn.Linear(H, 1)).double()
    ref = copy.deepcopy(model)
    x, t = data()
    opt = WSAM(model.parameters(), torch.optim.SGD, lr=0.1)
    ts = TrainStep(model=model, optimizer=opt, loss_func=lambda b, out: F.mse_loss(out, b.sum(1, keepdim=True)),
                   device=torch.device("cpu"), grad_accum_steps=2)
    ts(x[:6])
    ts(x[6:])
    assert ts.optimizer_steps == 1 and int(model[1].num_batches_tracked) == 2
    ref(x[:6])
    ref(x[6:])
    assert torch.equal(model[1].running_mean, ref[1].running_mean)
    assert torch.equal(model[1].running_var, ref[1].running_var)


def test_train_step_refuses_fp16_loss_scaling():
    from torchloom.parallel.loss_scaler import DynamicLossScaler

    model = mlp()
    opt = WSAM(model.parameters(), torch.optim.SGD, lr=0.1)
    with pytest.raises(NotImplementedError, match="bfloat16"):
        TrainStep(model=model, optimizer=opt, loss_func=None, device=torch.device("cpu"),
                  loss_scaler=DynamicLossScaler())


class _MinimalSAM(torch.optim.SGD):
    """A SAM-like optimizer with only ``first_step``/``second_step`` (davda54/sam's interface), for
    TrainStep's generic two-pass path."""

    def __init__(self, params, lr, rho):
        super().__init__(params, lr=lr)
        self.rho, self._e = rho, {}

    @torch.no_grad()
    def first_step(self, zero_grad=False):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.sqrt(sum((p.grad ** 2).sum() for p in ps))
        for p in ps:
            self._e[p] = self.rho * p.grad / norm
            p.add_(self._e[p])
        if zero_grad:
            self.zero_grad()

    @torch.no_grad()
    def second_step(self, zero_grad=False):
        for p, e in self._e.items():
            p.sub_(e)
        self._e = {}
        super().step()
        if zero_grad:
            self.zero_grad()


def test_train_step_drives_a_generic_sam_like_optimizer():
    """TrainStep with accumulation 2 == the same optimizer's two-call loop on the full batch (atol 1e-12,
    float64; only the gradient summation order differs)."""
    x, t = data()
    a, b = mlp(), mlp()
    oa, ob = _MinimalSAM(a.parameters(), 0.1, 0.2), _MinimalSAM(b.parameters(), 0.1, 0.2)
    ts = TrainStep(model=a, optimizer=oa, loss_func=lambda batch, out: F.mse_loss(out, batch.sum(1, keepdim=True)),
                   device=torch.device("cpu"), grad_accum_steps=2)
    target = x.sum(1, keepdim=True)
    for _ in range(3):
        ts(x[:6])
        ts(x[6:])
        F.mse_loss(b(x), target).backward()
        ob.first_step(zero_grad=True)
        F.mse_loss(b(x), target).backward()
        ob.second_step(zero_grad=True)
    assert ts.optimizer_steps == 3
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


def test_zero1_refuses_two_pass_optimizers():
    """ZeroRedundancyOptimizer rebuilds the optimizer from its class; WSAM needs its base optimizer: refused
    with the alternative named (not an obscure TypeError)."""
    import functools

    import torchloom
    from tests.models import tiny_llama
    from torchloom.optim import WSAM

    with pytest.raises(NotImplementedError, match="zero1 cannot shard WSAM.*fsdp"):
        torchloom.auto_accelerate(tiny_llama(), functools.partial(WSAM, base_optimizer=torch.optim.SGD),
                                  strategy=["zero1"], optim_args={"lr": 0.1})
