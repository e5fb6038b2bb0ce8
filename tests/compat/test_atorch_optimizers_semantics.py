"""torchloom.compat.atorch.optimizers: ATorch's semantics where the native optimizers differ (AGD's clip and
in-place L2 decay, WeightedSAM's per-pass clipping and world averaging), ATorch's exceptions, checkpoints in
ATorch's format, the README's two-step loop, and the names not provided. References: float64, written from
the formulas (tests/compat/_atorch_optim_reference.py)."""
import copy
import warnings

import pytest
import torch

from tests.compat._atorch_optim_reference import (agd_reference, initial_linear, regression_batch, wsam_reference,
                                                  wsam_two_step_ddp)
from torchloom.compat.atorch.optimizers import AGD, WeightedSAM
from torchloom.compat.atorch.optimizers.agd import AGD as AGDByModulePath
from torchloom.compat.atorch.optimizers.utils import disable_running_stats, enable_running_stats
from torchloom.compat.atorch.optimizers.wsam import WeightedSAM as WeightedSAMByModulePath
from torchloom.optim import AGD as NativeAGD
from torchloom.optim import WSAM as NativeWSAM

STEPS = 6


def _quadratic_grad(target):
    """Gradient of 0.5 * ||3 p - target||^2 * (1 + t/10): changes every step."""
    return lambda p, t: 3.0 * (3.0 * p - target) * (1.0 + t / 10.0)


def _run_agd(cls, p0, grad_fn, steps, **kw):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], **kw)
    out, left = [], []
    for t in range(1, steps + 1):
        p.grad = grad_fn(p.detach(), t).clone()
        opt.step()
        out.append(p.detach().clone())
        left.append(p.grad.clone())
    return out, left, opt


def _data():
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(4, 5, generator=gen, dtype=torch.float64),
            torch.randn(4, 5, generator=gen, dtype=torch.float64))


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("kw", [
    dict(),
    dict(clip=0.5),  # binds in every step; ATorch's clip is on the not bias-corrected quantity
    dict(clip=0.5, amsgrad=True, delta=1e-14),
    dict(weight_decay=0.1, weight_decouple=False),  # L2: ATorch adds it to p.grad in place
    dict(weight_decay=0.1, weight_decouple=False, clip=0.7, amsgrad=True),
    dict(weight_decay=0.05, fixed_decay=True, lr=1e-2),
], ids=["default", "clip", "clip_amsgrad", "l2", "l2_clip_amsgrad", "fixed_decay"])
def test_agd_matches_atorch_formulas(kw, foreach):
    p0, target = _data()
    grad_fn = _quadratic_grad(target)
    ref, ref_left = agd_reference(p0, grad_fn, STEPS, **kw)
    # foreach: the native foreach path (the compat class overrides both update paths)
    cls = (lambda params, **k: _with_foreach(AGD(params, **k))) if foreach else AGD
    out, left, _ = _run_agd(cls, p0, grad_fn, STEPS, **kw)
    for t in range(STEPS):
        torch.testing.assert_close(out[t], ref[t], rtol=1e-12, atol=1e-14, msg=lambda m: f"step {t + 1}: {m}")
        torch.testing.assert_close(left[t], ref_left[t], rtol=1e-12, atol=1e-14)


def _with_foreach(opt):
    for g in opt.param_groups:
        g["foreach"] = True
    return opt


def test_agd_clip_and_l2_differ_from_native():
    """The two semantics are distinguishable, so the test above tells them apart."""
    p0, target = _data()
    grad_fn = _quadratic_grad(target)
    compat, _, _ = _run_agd(AGD, p0, grad_fn, STEPS, clip=0.5)
    native, _, _ = _run_agd(NativeAGD, p0, grad_fn, STEPS, clip=0.5)
    assert (compat[-1] - native[-1]).abs().max() > 1e-4
    _, compat_left, _ = _run_agd(AGD, p0, grad_fn, 2, weight_decay=0.1, weight_decouple=False)
    _, native_left, _ = _run_agd(NativeAGD, p0, grad_fn, 2, weight_decay=0.1, weight_decouple=False)
    assert not torch.equal(compat_left[0], native_left[0])
    torch.testing.assert_close(native_left[0], grad_fn(p0, 1))  # native: p.grad unchanged


def test_agd_per_group_clip_and_skipped_parameters():
    """Per-group options; a parameter without a gradient in some steps keeps its own step count (the clip
    translation uses each parameter's own t)."""
    p0, target = _data()
    grad_fn = _quadratic_grad(target)
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    opt = AGD([{"params": [a], "clip": 0.3}, {"params": [b]}], clip=0.6)
    for t in range(1, STEPS + 1):
        a.grad = grad_fn(a.detach(), t).clone()
        b.grad = grad_fn(b.detach(), t - 2).clone() if t > 2 else None  # b starts at step 3, its own t = 1
        opt.step()
    ref_a, _ = agd_reference(p0, grad_fn, STEPS, clip=0.3)
    ref_b, _ = agd_reference(p0, lambda p, t: grad_fn(p, t), STEPS - 2, clip=0.6)
    torch.testing.assert_close(a.detach(), ref_a[-1], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(b.detach(), ref_b[-1], rtol=1e-12, atol=1e-14)


def test_agd_positional_order_and_defaults_are_atorchs():
    p = torch.nn.Parameter(torch.zeros(2))
    opt = AGD([p], 1e-2, (0.8, 0.99), 1e-6, 0.1, False, True, True, False, 0.5)  # ATorch: win before clip
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["delta"], g["weight_decay"], g["weight_decouple"], g["fixed_decay"],
            g["amsgrad"], g["win"], g["clip"]) == (1e-2, (0.8, 0.99), 1e-6, 0.1, False, True, True, False, 0.5)
    d = AGD([p]).defaults
    assert {k: d[k] for k in ("lr", "betas", "delta", "weight_decay", "weight_decouple", "fixed_decay", "amsgrad",
                              "win", "clip")} == dict(lr=1e-3, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.0,
                                                      weight_decouple=True, fixed_decay=False, amsgrad=False,
                                                      win=False, clip=None)
    assert AGDByModulePath is AGD and WeightedSAMByModulePath is WeightedSAM
    assert isinstance(AGD([p]), NativeAGD) and issubclass(WeightedSAM, NativeWSAM)


@pytest.mark.parametrize("kw,message", [
    (dict(lr=0.0), "Invalid learning rate: 0.0"),
    (dict(lr=-1), "Invalid learning rate: -1"),
    (dict(delta=-1), "Invalid delta value: -1"),
    (dict(betas=(1.0, 0.999)), "Invalid beta parameter at index 0: 1.0"),
    (dict(betas=(0.9, -0.1)), "Invalid beta parameter at index 1: -0.1"),
    (dict(weight_decay=-1), "Invalid weight_decay value: -1"),
    (dict(delta=0.0), "delta=1e-14"),
    (dict(win=True), "win=True"),
    (dict(clip=0), "clip"),
])
def test_agd_invalid_arguments_raise_atorchs_value_error(kw, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.")):
        AGD(None, **kw)  # ATorch checks before looking at the parameters
    if "win" in kw:
        p = torch.nn.Parameter(torch.zeros(2))
        with pytest.raises(ValueError, match="win=True"):
            AGD([p]).add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))], "win": True})


def test_agd_loads_an_atorch_format_state_dict_and_continues():
    """ATorch's state: ``step`` a float32 tensor on the parameter's device, ``exp_avg``, ``exp_avg_sq``; its
    groups have no ``foreach``/``maximize``. Loading it after 3 reference steps continues the reference."""
    p0, target = _data()
    grad_fn = _quadratic_grad(target)
    kw = dict(clip=0.5, weight_decay=0.1, weight_decouple=False)
    out, _, opt = _run_agd(AGD, p0, grad_fn, 3, **kw)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        del g["foreach"], g["maximize"]
    sd["state"][0]["step"] = torch.tensor(3.0)
    p = torch.nn.Parameter(out[-1].clone())
    resumed = AGD([p], **kw)
    resumed.load_state_dict(sd)
    for t in range(4, STEPS + 1):
        p.grad = grad_fn(p.detach(), t).clone()
        resumed.step()
    ref, _ = agd_reference(p0, grad_fn, STEPS, **kw)
    torch.testing.assert_close(p.detach(), ref[-1], rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------------------------ WeightedSAM
def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)).double()


def _batch():
    gen = torch.Generator().manual_seed(3)
    return torch.randn(6, 5, generator=gen, dtype=torch.float64), torch.randn(6, 1, generator=gen,
                                                                            dtype=torch.float64)


def _grad_fn(model, x, y):
    """The gradient list of the MSE loss at weights ``ws`` (a copy of ``model``)."""
    def fn(ws):
        m = copy.deepcopy(model)
        for p, w in zip(m.parameters(), ws):
            p.data.copy_(w)
        torch.nn.functional.mse_loss(m(x), y).backward()
        return [p.grad.detach().clone() for p in m.parameters()]
    return fn


@pytest.mark.parametrize("decouple", [True, False])
@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("max_norm", [None, 0.05])  # 0.05 binds for both passes here
def test_wsam_matches_atorch_semantics(decouple, adaptive, max_norm):
    model = _mlp()
    x, y = _batch()
    w0 = [p.detach().clone() for p in model.parameters()]
    ref = wsam_reference(w0, _grad_fn(model, x, y), 4, lr=0.1, momentum=0.9, rho=0.1, gamma=0.8,
                         decouple=decouple, adaptive=adaptive, max_norm=max_norm)
    opt = WeightedSAM(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rho=0.1, gamma=0.8,
                      adaptive=adaptive, decouple=decouple, max_norm=max_norm)

    def closure():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    for _ in range(4):
        opt.step(closure)
        opt.zero_grad()
    for p, r in zip(model.parameters(), ref):
        torch.testing.assert_close(p.detach(), r, rtol=1e-11, atol=1e-13)
    if max_norm is None:
        assert opt.last_grad_norm is None
    else:  # the second pass's norm before clipping (max_norm binds here)
        assert opt.last_grad_norm is not None and float(opt.last_grad_norm) > max_norm


def test_wsam_clipping_differs_from_native():
    """ATorch clips each pass's gradient; the native class clips the gradient the base optimizer steps on."""
    x, y = _batch()
    finals = []
    for cls in (WeightedSAM, NativeWSAM):
        model = _mlp()
        opt = cls(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), rho=0.1, gamma=0.8,
                  max_norm=0.05)
        for _ in range(3):
            opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
        finals.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert (finals[0] - finals[1]).abs().max() > 1e-6
    assert opt.max_norm == 0.05


def test_wsam_defaults_and_arguments_are_atorchs():
    model = _mlp()
    opt = WeightedSAM(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = opt.param_groups[0]
    assert (g["rho"], g["gamma"], g["sam_eps"], g["adaptive"]) == (0.05, 0.9, 1e-12, False)
    assert opt.decouple is True and opt.max_norm is None and opt.model is model


def test_wsam_invalid_arguments_raise_atorchs_types():
    model = _mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(AssertionError, match="Invalid rho, should be non-negative: -0.5"):
        WeightedSAM(model, base, rho=-0.5)
    with pytest.raises(ZeroDivisionError, match="gamma=1"):
        WeightedSAM(model, base, gamma=1.0)
    for bad in (dict(gamma=1.5), dict(gamma=-0.1), dict(sam_eps=-1.0), dict(max_norm=0.0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            WeightedSAM(model, base, **bad)
    with pytest.raises(TypeError, match="nn.Module"):
        WeightedSAM(list(model.parameters()), base)
    with pytest.raises(TypeError, match="lr"):
        WeightedSAM(model, base, lr=0.5)  # ATorch ignores it silently
    opt = WeightedSAM(model, base)
    x, y = _batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    with pytest.raises(AssertionError, match="requires closure"):
        opt.step()


def test_wsam_readme_two_step_loop_equals_closure_form():
    """ATorch README's loop (utils' running-stats helpers, first_step/second_step with zero_grad) and
    step(closure) give the same weights; BatchNorm running statistics count the batch once."""
    x, y = _batch()
    results = []
    for form in ("two_step", "closure"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1)).double()
        opt = WeightedSAM(model, torch.optim.SGD(model.parameters(), lr=0.1), rho=0.1, max_norm=1.0)
        for _ in range(3):
            if form == "two_step":
                enable_running_stats(model)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.first_step(zero_grad=True)
                disable_running_stats(model)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.second_step(zero_grad=True)
            else:
                opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
                opt.zero_grad()
        enable_running_stats(model)
        assert model[1].momentum == 0.1
        results.append([t.detach().clone() for t in list(model.parameters()) + [model[1].running_mean]])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


def test_not_provided_optimizers_raise_import_error():
    with pytest.raises(ImportError, match="AdamL is not provided.*AdamW"):
        from torchloom.compat.atorch.optimizers import AdamL  # noqa: F401
    with pytest.raises(ImportError, match="BF16Optimizer is not provided.*amp"):
        from torchloom.compat.atorch.optimizers import BF16Optimizer  # noqa: F401
    with pytest.raises(AttributeError):
        from torchloom.compat.atorch import optimizers
        optimizers.NoSuchName  # noqa: B018


@pytest.mark.distributed
@pytest.mark.parametrize("max_norm", [None, 0.05])
def test_wsam_two_step_ddp_perturbs_per_replica_and_averages_2ranks(max_norm):
    """ATorch's README loop on 2 gloo ranks: the first backward under ``no_sync``; first_step averages the
    gradients over the world after the perturbation (each replica's e from its own half of the batch)."""
    from torchloom.testing import run_ranks

    outs = run_ranks(wsam_two_step_ddp, 2, 3, max_norm, timeout=240)
    w, b = initial_linear()
    lin = torch.nn.Linear(3, 2).double()

    def half_grad(rank):
        x, y = regression_batch(rank)

        def fn(ws):
            m = copy.deepcopy(lin)
            m.weight.data.copy_(ws[0])
            m.bias.data.copy_(ws[1])
            torch.nn.functional.mse_loss(m(x), y).backward()
            return [m.weight.grad.clone(), m.bias.grad.clone()]
        return fn

    kw = dict(lr=0.1, momentum=0.9, rho=0.2, gamma=0.8, decouple=True, adaptive=False, max_norm=max_norm)
    per_replica = wsam_reference([w, b], None, 3, replica_grad_fns=[half_grad(0), half_grad(1)], **kw)
    full_x = torch.cat([regression_batch(0)[0], regression_batch(1)[0]])
    full_y = torch.cat([regression_batch(0)[1], regression_batch(1)[1]])
    averaged = wsam_reference([w, b], _grad_fn(lin, full_x, full_y), 3, **kw)
    assert max(float((a - c).abs().max()) for a, c in zip(per_replica, averaged)) > 1e-6
    for rank_out in outs:
        for got, want in zip(rank_out, per_replica):
            torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-13)


def _wsam_run(model, base, steps, x, y, **kw):
    opt = WeightedSAM(model, base, rho=0.1, gamma=0.8, **kw)
    for _ in range(steps):
        opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())
        opt.zero_grad()
    return opt


def _atorch_groups(sd):
    """A state dict's groups as ATorch writes them: ``alpha = gamma / (1 - gamma)`` instead of ``gamma``."""
    sd = copy.deepcopy(sd)
    for g in sd["param_groups"]:
        gamma = g.pop("gamma")
        g["alpha"] = gamma / (1.0 - gamma)
    return sd


def test_wsam_resumes_from_atorch_base_optimizer_checkpoint():
    """ATorch's examples save ``base_optimizer.state_dict()`` (its groups carry WSAM's keys, with ``alpha``).
    Loaded into the base optimizer before or after WeightedSAM is built, the run continues as uninterrupted."""
    x, y = _batch()
    model = _mlp()
    _wsam_run(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 4, x, y)
    want = [p.detach().clone() for p in model.parameters()]
    for order in ("before", "after"):
        model = _mlp()
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _wsam_run(model, base, 2, x, y)
        sd = _atorch_groups(base.state_dict())
        assert "gamma" not in sd["param_groups"][0] and sd["param_groups"][0]["alpha"] == pytest.approx(4.0)
        resumed_model = copy.deepcopy(model)
        new_base = torch.optim.SGD(resumed_model.parameters(), lr=0.5, momentum=0.9)
        if order == "before":
            new_base.load_state_dict(sd)
            opt = WeightedSAM(resumed_model, new_base, rho=0.1, gamma=0.3)  # the checkpoint's alpha wins (ATorch)
        else:
            opt = WeightedSAM(resumed_model, new_base, rho=0.1, gamma=0.8)
            new_base.load_state_dict(sd)  # replaces the base's groups and state
        for _ in range(2):
            opt.step(lambda: torch.nn.functional.mse_loss(resumed_model(x), y).backward())
            opt.zero_grad()
        assert opt.param_groups is new_base.param_groups and "alpha" not in opt.param_groups[0]
        for p, w in zip(resumed_model.parameters(), want):
            torch.testing.assert_close(p.detach(), w, rtol=1e-12, atol=1e-14, msg=lambda m: f"{order}: {m}")


def test_wsam_loads_atorch_weighted_sam_state_dict():
    """ATorch's ``WeightedSAM.state_dict()``: state ``e_w``/``grad``/``sharpness`` (last step's values, dropped)
    and groups with ``alpha``; the base optimizer's moments come from its own state dict, as in ATorch."""
    x, y = _batch()
    model = _mlp()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = _wsam_run(model, base, 2, x, y)
    base_sd = copy.deepcopy(base.state_dict())  # state_dict() holds the live buffers
    atorch_sd = _atorch_groups(opt.state_dict())
    atorch_sd["state"] = {i: {"e_w": torch.ones(3), "grad": torch.ones(3), "sharpness": torch.ones(3)}
                          for i in atorch_sd["state"]}
    resumed_model = copy.deepcopy(model)
    new_base = torch.optim.SGD(resumed_model.parameters(), lr=0.1, momentum=0.9)
    new_base.load_state_dict(copy.deepcopy(base_sd))
    resumed = WeightedSAM(resumed_model, new_base, rho=0.1, gamma=0.5)
    resumed.load_state_dict(atorch_sd)
    assert resumed.param_groups[0]["gamma"] == pytest.approx(0.8)
    assert all("e_w" not in s for s in resumed.state.values())
    assert resumed.state == {} and new_base.state == {}  # ATorch's WeightedSAM state dict has no moments
    new_base.load_state_dict(copy.deepcopy(base_sd))  # the moments, as ATorch users load them
    for o, m in ((opt, model), (resumed, resumed_model)):
        for _ in range(2):
            o.step(lambda m=m: torch.nn.functional.mse_loss(m(x), y).backward())
            o.zero_grad()
    for p, q in zip(model.parameters(), resumed_model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-12, atol=1e-14)


def test_wsam_group_alpha_set_during_training_is_used():
    """ATorch reads ``group["alpha"]`` at every step; setting it (e.g. a schedule on alpha) takes effect."""
    x, y = _batch()
    finals = []
    for how in ("alpha", "gamma"):
        model = _mlp()
        opt = _wsam_run(model, torch.optim.SGD(model.parameters(), lr=0.1), 1, x, y)
        if how == "alpha":
            opt.param_groups[0]["alpha"] = 1.0
        else:
            opt.param_groups[0]["gamma"] = 0.5
        _ = [opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward()) for _ in range(2)]
        finals.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*finals):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="alpha=-1"):
        opt.param_groups[0]["alpha"] = -1.0
        opt.step(lambda: torch.nn.functional.mse_loss(model(x), y).backward())


def test_wsam_warns_once_about_gradients_present_before_step_closure():
    """ATorch's README computes a backward() right before step(closure); ATorch adds that gradient to the
    first pass's, torchloom clears it (and says so, once)."""
    x, y = _batch()
    model = _mlp()
    opt = WeightedSAM(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def closure():
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    closure()
    with pytest.warns(UserWarning, match="clears the gradients present"):
        opt.step(closure)
    closure()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step(closure)  # checked once only
    model2 = _mlp()
    other = WeightedSAM(model2, torch.optim.SGD(model2.parameters(), lr=0.1))
    closure2 = lambda: torch.nn.functional.mse_loss(model2(x), y).backward()  # noqa: E731
    closure2()
    other.zero_grad()  # as the warning advises
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        other.step(closure2)
