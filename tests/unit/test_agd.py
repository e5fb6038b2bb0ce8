"""AGD (torchloom.optim.AGD) against an independent NumPy transcription of the paper's Algorithm 1
(Yue et al., NeurIPS 2023), plus its limiting case, foreach == per-tensor, state-dict round trip,
validation and use through auto_accelerate.

Tolerances: float64 runs match the float64 NumPy reference to rtol 1e-9 (the two compute the same
formulas in a different algebraic order); the float32 run to rtol 2e-4 (AGD divides by sqrt(b_hat), whose
s_t is a difference of close moments). foreach vs per-tensor and the state-dict round trip are exact.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

from tests.models import tiny_llama, token_batches
from torchloom.optim import AGD

STEPS = 6


# ----------------------------------------------------------------------------------- NumPy reference
def _grad_np(x: np.ndarray, a: np.ndarray, t: int) -> np.ndarray:
    """Gradient of a non-convex, step-dependent objective (so successive gradients differ)."""
    return a * x + np.sin(3.0 * x + t) + 0.1 * t


def _grad_torch(x: torch.Tensor, a: torch.Tensor, t: int) -> torch.Tensor:
    return a * x + torch.sin(3.0 * x + t) + 0.1 * t


def agd_numpy(x0: np.ndarray, a: np.ndarray, steps: int, lr: float, betas=(0.9, 0.999), delta=1e-5,
              weight_decay=0.0, weight_decouple=True, fixed_decay=False, amsgrad=False, clip=None,
              maximize=False):
    """Paper, Algorithm 1, one coordinate at a time, in float64. Returns (x_T, floors) where floors[t]
    counts the coordinates whose step t took the delta floor (momentum-SGD regime)."""
    beta1, beta2 = betas
    x = np.array(x0, dtype=np.float64).ravel().copy()
    a = np.asarray(a, dtype=np.float64).ravel()
    m = np.zeros_like(x)
    b = np.zeros_like(x)
    b_max = np.zeros_like(x)
    floors = []
    for t in range(1, steps + 1):
        g_all = _grad_np(x, a, t)
        n_floor = 0
        for i in range(x.size):
            g = -g_all[i] if maximize else g_all[i]
            if weight_decay and not weight_decouple:
                g = g + weight_decay * x[i]  # L2 regularisation
            if weight_decay and weight_decouple:  # AdamW-style decoupled decay
                x[i] = x[i] - (weight_decay if fixed_decay else lr * weight_decay) * x[i]
            m_prev = m[i]
            m[i] = beta1 * m[i] + (1 - beta1) * g
            if t == 1:
                s = m[i] / (1 - beta1)
            else:
                s = m[i] / (1 - beta1 ** t) - m_prev / (1 - beta1 ** (t - 1))
            b[i] = beta2 * b[i] + (1 - beta2) * s * s
            b_max[i] = max(b_max[i], b[i])
            b_used = b_max[i] if amsgrad else b[i]
            floor = delta * math.sqrt(1 - beta2 ** t)
            n_floor += math.sqrt(b_used) < floor
            if clip is None:  # the paper's form of the step
                step = lr * math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t) * m[i] / max(math.sqrt(b_used), floor)
            else:  # clip bounds the normalised direction m_hat / max(sqrt(b_hat), delta)
                direction = (m[i] / (1 - beta1 ** t)) / max(math.sqrt(b_used / (1 - beta2 ** t)), delta)
                step = lr * min(max(direction, -clip), clip)
            x[i] = x[i] - step
        floors.append(n_floor)
    return x.reshape(np.shape(x0)), floors


def _problem(seed: int, shapes=((6, 5), (7,))):
    rng = np.random.default_rng(seed)
    xs = [rng.normal(size=s) for s in shapes]
    scales = [rng.uniform(0.2, 2.0, size=s) for s in shapes]
    return xs, scales


def agd_torch(xs, scales, groups_options, steps, dtype=torch.float64, **options):
    """Run AGD on the same objective; ``groups_options[i]`` are the options of tensor i's group."""
    params = [torch.nn.Parameter(torch.tensor(x, dtype=dtype)) for x in xs]
    a = [torch.tensor(s, dtype=dtype) for s in scales]
    groups = [{"params": [p], **go} for p, go in zip(params, groups_options)]
    opt = AGD(groups, **options)
    for t in range(1, steps + 1):
        for p, s in zip(params, a):
            p.grad = _grad_torch(p.detach(), s, t)
        opt.step()
    return [p.detach().numpy().astype(np.float64) for p in params], opt


CASES = {
    "defaults": dict(lr=0.05),
    "floor_inactive_transformer_delta": dict(lr=0.05, delta=1e-14),
    "floor_active_everywhere": dict(lr=0.05, delta=50.0),
    "floor_mixed": dict(lr=0.05, delta=0.4),
    "decoupled_weight_decay": dict(lr=0.05, weight_decay=0.3),
    "fixed_decay": dict(lr=0.05, weight_decay=0.01, fixed_decay=True),
    "l2_weight_decay": dict(lr=0.05, weight_decay=0.3, weight_decouple=False),
    "amsgrad": dict(lr=0.05, amsgrad=True, betas=(0.8, 0.9)),
    "clip": dict(lr=0.05, clip=0.3, delta=0.4),
    "maximize": dict(lr=0.05, maximize=True),
    "beta1_zero": dict(lr=0.05, betas=(0.0, 0.99)),
}


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_numpy_reference(case, foreach):
    opts = CASES[case]
    xs, scales = _problem(0)
    got, _ = agd_torch(xs, scales, [{}, {}], STEPS, foreach=foreach, **opts)
    for x, s, g in zip(xs, scales, got):
        want, floors = agd_numpy(x, s, STEPS, **opts)
        np.testing.assert_allclose(g, want, rtol=1e-9, atol=1e-12)
        assert not np.allclose(want, x), "the reference did not move"
        if case == "floor_active_everywhere":
            assert all(f == x.size for f in floors)
        if case == "floor_inactive_transformer_delta":
            assert not any(floors)
    if case in ("floor_mixed", "clip"):  # both regimes occur, so the switch itself is exercised
        floors = [f for x, s in zip(xs, scales) for f in agd_numpy(x, s, STEPS, **opts)[1]]
        total = sum(x.size for x in xs)
        assert 0 < sum(floors) < STEPS * total, floors


def test_several_param_groups_match_reference():
    xs, scales = _problem(1)
    group_opts = [dict(lr=0.02, betas=(0.8, 0.95), weight_decay=0.1),
                  dict(lr=0.1, delta=0.3, amsgrad=True, clip=0.5)]
    got, _ = agd_torch(xs, scales, group_opts, STEPS, foreach=True, lr=1.0)
    for x, s, g, o in zip(xs, scales, got, group_opts):
        np.testing.assert_allclose(g, agd_numpy(x, s, STEPS, **o)[0], rtol=1e-9, atol=1e-12)


def test_float32_matches_reference():
    xs, scales = _problem(2)
    got, opt = agd_torch(xs, scales, [{}, {}], STEPS, dtype=torch.float32, lr=0.05, weight_decay=0.1)
    for x, s, g in zip(xs, scales, got):
        np.testing.assert_allclose(g, agd_numpy(x, s, STEPS, lr=0.05, weight_decay=0.1)[0], rtol=2e-4, atol=1e-6)
    state = next(iter(opt.state.values()))
    assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].item() == STEPS
    assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.float32


# ----------------------------------------------------------------------------------- foreach == per-tensor
def _run(model, opt_kwargs, steps, seed=0, skip_grad_at=None):
    """Random gradients (fixed by seed) for every parameter; ``skip_grad_at[step]`` names a parameter left
    without gradient at that step (so parameters end with different step counts)."""
    opt = AGD(model.parameters(), **opt_kwargs)
    g = torch.Generator().manual_seed(seed)
    names = [n for n, _ in model.named_parameters()]
    for step in range(steps):
        for n, p in model.named_parameters():
            grad = torch.randn(p.shape, generator=g).to(p.dtype)
            p.grad = None if (skip_grad_at or {}).get(step) == n else grad
        opt.step()
    return opt, names


@pytest.mark.parametrize("opts", [
    dict(lr=1e-2),
    dict(lr=1e-2, delta=1.0, weight_decay=0.1, amsgrad=True, clip=0.5),
    dict(lr=1e-2, weight_decay=0.1, weight_decouple=False, maximize=True, betas=(0.5, 0.9)),
])
def test_foreach_equals_per_tensor(opts):
    base = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    base[2].to(torch.bfloat16)  # a second dtype: foreach batches by dtype
    skip = {1: "0.weight", 3: "1.bias"}
    models = [copy.deepcopy(base) for _ in range(2)]
    _run(models[0], {**opts, "foreach": False}, 5, skip_grad_at=skip)
    opt, _ = _run(models[1], {**opts, "foreach": True}, 5, skip_grad_at=skip)
    for (n, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(a, b), n
    steps = {int(s["step"]) for s in opt.state.values()}
    assert steps == {4, 5}, steps  # the skipped parameters took one step fewer


# ----------------------------------------------------------------------------------- limiting case
def test_huge_delta_is_momentum_sgd_with_bias_corrected_lr():
    """With sqrt(b_hat) < delta everywhere the step is lr/delta * m_t/(1 - beta1^t). torch's SGD with
    momentum beta1 and no dampening keeps buf_t = sum_k beta1^(t-k) g_k = m_t / (1 - beta1), so AGD equals
    SGD(momentum=beta1, dampening=0) with lr_t = lr * (1 - beta1) / (delta * (1 - beta1^t)).
    Tiny Llama, 5 steps, float32: parameters within atol 2e-6 (two different float32 recurrences)."""
    lr, delta, beta1 = 1e3, 1e4, 0.9
    data = token_batches(5 * 4)
    agd_model, sgd_model = tiny_llama(), tiny_llama()
    agd = AGD(agd_model.parameters(), lr=lr, delta=delta, betas=(beta1, 0.999))
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.0, momentum=beta1, dampening=0.0)
    for t in range(1, 6):
        x = data[(t - 1) * 4:t * 4]
        for model, opt in ((agd_model, agd), (sgd_model, sgd)):
            model(input_ids=x, labels=x).loss.backward()
            if opt is sgd:
                sgd.param_groups[0]["lr"] = lr * (1 - beta1) / (delta * (1 - beta1 ** t))
            opt.step()
            opt.zero_grad()
        for s in agd.state.values():  # the floor was active for every coordinate
            b_hat = s["exp_avg_sq"] / (1 - 0.999 ** t)
            assert b_hat.sqrt().max() < delta
    moved = 0.0
    for (n, a), b, p0 in zip(agd_model.named_parameters(), sgd_model.parameters(), tiny_llama().parameters()):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=0, msg=lambda m: f"{n}: {m}")
        moved = max(moved, (a - p0).abs().max().item())
    assert moved > 1e-3, moved


# ----------------------------------------------------------------------------------- state dict
@pytest.mark.parametrize("foreach", [False, True])
def test_state_dict_round_trip_continues_identically(foreach):
    opts = dict(lr=1e-2, amsgrad=True, weight_decay=0.1, foreach=foreach)
    data = token_batches(6 * 2)
    model = tiny_llama()
    opt = AGD(model.parameters(), **opts)

    def train(model, opt, steps):
        for s in steps:
            x = data[s * 2:(s + 1) * 2]
            model(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

    train(model, opt, range(3))
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, range(3, 6))

    resumed = tiny_llama(seed=7)
    resumed.load_state_dict(saved_model)
    fresh = AGD(resumed.parameters(), lr=0.5)  # the loaded param_groups replace these options
    fresh.load_state_dict(saved_opt)
    assert fresh.param_groups[0]["lr"] == 1e-2 and fresh.param_groups[0]["amsgrad"]
    step = next(iter(fresh.state.values()))["step"]
    assert step.dtype == torch.float32 and step.dim() == 0 and step.item() == 3
    train(resumed, fresh, range(3, 6))
    for (n, a), b in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), n


# ----------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, name", [
    (dict(lr=-1e-3), "lr"), (dict(lr=float("nan")), "lr"), (dict(betas=(1.0, 0.999)), "betas"),
    (dict(betas=(0.9, -0.1)), "betas"), (dict(betas=(0.9,)), "betas"), (dict(delta=0.0), "delta"),
    (dict(delta=-1e-5), "delta"), (dict(weight_decay=-0.1), "weight_decay"), (dict(clip=0), "clip"),
    (dict(clip=-5.0), "clip"), (dict(foreach="yes"), "foreach"), (dict(win=True), "win"),
])
def test_invalid_options_name_the_option(kwargs, name):
    with pytest.raises(ValueError, match=f"{name}="):
        AGD([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_invalid_group_option_is_rejected():
    opt = AGD([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match="delta="):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))], "delta": 0})


def test_sparse_gradients_are_rejected():
    emb = torch.nn.Embedding(4, 2, sparse=True)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        AGD(emb.parameters()).step()


def test_closure_loss_is_returned():
    p = torch.nn.Parameter(torch.ones(3))
    opt = AGD([p], lr=0.1)

    def closure():
        opt.zero_grad()
        loss = (p ** 2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == 3.0
    assert torch.all(p < 1.0)


# ----------------------------------------------------------------------------------- auto_accelerate
def test_auto_accelerate_single_process_matches_plain_loop():
    """AGD as optim_func: the same parameters as a plain loop (atol 1e-6; same float32 operations except
    the loss reduction path)."""
    import torchloom
    from tests.models import lm_loss

    kw = dict(lr=1e-3, delta=1e-14, weight_decay=0.01)
    data = token_batches(3 * 4)
    res = torchloom.auto_accelerate(tiny_llama(), AGD, None, lm_loss, optim_args=kw,
                                    dataloader_args={"batch_size": 4}, model_input_format="unpack_dict")
    assert isinstance(res.optimizer, AGD)
    model = tiny_llama()
    opt = AGD(model.parameters(), **kw)
    for s in range(3):
        x = data[s * 4:(s + 1) * 4]
        res.train_step({"input_ids": x, "labels": x})
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
    got = dict(res.model.named_parameters())
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p, atol=1e-6, rtol=0, msg=lambda m: f"{n}: {m}")
