"""torchloom.search.measure: step time and peak memory of a training step, against hand-computed bytes.

One process (auto_accelerate makes a single-rank gloo group). Memory is the MemTracker peak of live tensor
bytes during one extra optimizer step after the timed ones (fp32, 4 bytes an element).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import torchloom
from torchloom.search import measure as measure_mod
from torchloom.search.measure import StepMeasurement, measure_steps, model_state_bytes


def _accelerate(model, batch_size, micro=None, foreach=False):
    args = {"batch_size": batch_size} if micro is None else {"batch_size": batch_size, "micro_batch_size": micro}
    return torchloom.auto_accelerate(model, torch.optim.AdamW, None, lambda b, o: o.pow(2).mean(), strategy=None,
                                     optim_args={"lr": 1e-3, "foreach": foreach}, dataloader_args=args)


def test_peak_memory_activation_dominated_mlp_matches_hand_computed_bytes():
    # L x (Linear(h, h, no bias) -> ReLU), loss = mean(out^2). Each ReLU output (B x h fp32 = A bytes) is
    # saved (by the ReLU and as the next Linear's input): L * A activation bytes at the peak, which is at the
    # start of backward; on top of it params P, Adam state 2P (+4 bytes of `step` per tensor, from the
    # earlier steps) and the backward's transients: pow's backward (x.pow(1), *2, *grad) and the first
    # threshold_backward, at most 4 A.
    torch.manual_seed(0)
    L, h, B = 6, 64, 2048
    model = nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(h, h, bias=False), nn.ReLU())])
    res = _accelerate(model, B)
    m = measure_steps(res, [torch.randn(B, h)], steps=2, warmup=1)
    P, A = sum(p.numel() for p in model.parameters()) * 4, B * h * 4
    adam = 2 * P + 4 * L
    assert m.memory["params"] == P
    assert m.memory["optimizer"] == adam
    assert L * A <= m.memory["activations"] <= L * A + 64  # + the loss scalar and other 0-dim tensors
    low = P + adam + L * A
    # a tracker that missed the activations would read ~3P (0.3 MiB): far below `low` (3.4 MiB)
    assert low <= m.peak_memory_bytes <= low + 4 * A + 64, (m.peak_memory_bytes, low, A)
    assert sum(m.memory.values()) == m.peak_memory_bytes
    assert m.memory_method == "memtracker" and m.memory_error == ""


def test_peak_memory_state_dominated_model_is_params_grads_adam_and_update_temporaries():
    # batch 2: activations are negligible; the peak is in AdamW's (single-tensor) update of the largest
    # parameter: params P + grads P + exp_avg/exp_avg_sq 2P (+4-byte steps) + sqrt and divide temporaries of
    # the largest parameter (2 x 512 x 512 x 4 bytes). Tolerance 1% (the loss and 0-dim scalars).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 256), nn.Linear(256, 8))
    res = _accelerate(model, 2)
    m = measure_steps(res, [torch.randn(2, 512)], steps=2, warmup=1)
    n_tensors = len(list(model.parameters()))
    P = sum(p.numel() for p in model.parameters()) * 4
    expected = 4 * P + 4 * n_tensors + 2 * 512 * 512 * 4
    # a measure that forgot the gradients (3P + temps) would be 16% low; one without the temporaries 25% low
    assert abs(m.peak_memory_bytes - expected) <= 0.01 * expected, (m.peak_memory_bytes, expected)
    assert m.memory["params"] == P and m.memory["grads"] == P
    # after a step: gradients freed (set_to_none), Adam state kept
    assert m.state_bytes == {"params": P, "grads": 0, "optimizer": 2 * P + 4 * n_tensors}


def test_step_count_timed_steps_and_accumulation():
    # global batch 8 in micro-batches of 2: 4 train_step calls per optimizer step; warmup + steps timed or
    # untimed steps plus the one tracked step
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    res = _accelerate(model, 8, micro=2)
    assert res.grad_accum_steps == 4
    calls = []
    m = measure_steps(res, lambda i: calls.append(i) or torch.randn(2, 16), steps=3, warmup=2)
    assert calls == list(range(4 * (2 + 3 + 1)))
    assert res.train_step.optimizer_steps == 2 + 3 + 1
    assert len(m.step_times) == 3 and m.step_time_s == sorted(m.step_times)[1]
    assert all(t > 0 for t in m.step_times)
    assert (m.world_size, m.steps, m.warmup) == (1, 3, 2)
    assert StepMeasurement.from_dict(m.to_dict()) == m


def test_no_memory_tracking_runs_no_extra_step():
    model = nn.Linear(8, 8)
    res = _accelerate(model, 4)
    m = measure_steps(res, [torch.randn(4, 8)], steps=2, warmup=0, track_memory=False)
    assert res.train_step.optimizer_steps == 2
    assert m.peak_memory_bytes == -1 and m.memory == {}


def test_max_over_ranks(monkeypatch):
    # the slowest rank sets each step's time; the largest rank sets the peak and its breakdown
    res = _accelerate(nn.Linear(8, 8), 4)
    rows = [{"times": [0.1, 0.5, 0.2], "peak": 100, "categories": {"params": 100}, "state": {"params": 1}, "error": ""},
            {"times": [0.3, 0.1, 0.1], "peak": 300, "categories": {"params": 200, "activations": 100},
             "state": {"params": 2}, "error": ""}]
    monkeypatch.setattr(measure_mod, "_gather", lambda obj: rows)
    m = measure_steps(res, [torch.randn(4, 8)], steps=3, warmup=0)
    assert m.step_times == [0.3, 0.5, 0.2] and m.step_time_s == 0.3
    assert m.peak_memory_bytes == 300 and m.memory == {"params": 200, "activations": 100}
    assert m.rank_peak_bytes == [100, 300] and m.world_size == 2 and m.state_bytes == {"params": 2}


@pytest.mark.parametrize("kw,match", [({"steps": 0}, "steps"), ({"warmup": -1}, "warmup")])
def test_bad_arguments(kw, match):
    res = _accelerate(nn.Linear(4, 4), 2)
    with pytest.raises(ValueError, match=match):
        measure_steps(res, [torch.randn(2, 4)], **{"steps": 1, "warmup": 0, **kw})
    with pytest.raises(ValueError, match="empty"):
        measure_steps(res, [], steps=1, warmup=0)


def test_model_state_bytes_counts_shared_storage_once():
    lin = nn.Linear(4, 4, bias=False)
    model = nn.Sequential(lin, nn.ReLU(), lin)  # the same weight twice (tied)

    class R:
        pass

    r = R()
    r.model, r.optimizer = model, torch.optim.SGD(model.parameters(), lr=0.1)
    assert model_state_bytes(r) == {"params": 64, "grads": 0, "optimizer": 0}


def test_ddp_gradient_buckets_are_counted_from_the_start_of_the_step():
    # DDP (gradient_as_bucket_view) keeps its gradient buckets (P bytes, allocated in C++ before the tracked
    # step) between steps; MemTracker sees a bucket only when the first gradient lands in it, after this
    # model's peak (start of backward). The DDP peak is the plain peak + P exactly; uncorrected it would
    # equal the plain peak.
    def peak(strategy):
        torch.manual_seed(0)
        L, h, B = 6, 64, 2048
        model = nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(h, h, bias=False), nn.ReLU())])
        res = torchloom.auto_accelerate(model, torch.optim.AdamW, None, lambda b, o: o.pow(2).mean(),
                                        strategy=strategy, optim_args={"lr": 1e-3, "foreach": False},
                                        dataloader_args={"batch_size": B})
        P = sum(p.numel() for p in model.parameters()) * 4
        return measure_steps(res, [torch.randn(B, h)], steps=1, warmup=1), P

    plain, P = peak(None)
    ddp, _ = peak(["ddp"])
    assert ddp.peak_memory_bytes == plain.peak_memory_bytes + P
    assert ddp.memory["grads"] == P + plain.memory.get("grads", 0)
    assert ddp.memory_method == "memtracker+ddp_buckets"


def test_tracker_accepts_a_root_module_run_twice_in_one_step():
    # a pipeline stage runs forward once per micro-batch within one train_step; PyTorch's MemTracker
    # raises NotImplementedError for the second call of a root module, measure's tracker restarts its stats.
    # Two micro-batches of B x 256 fp32 (A bytes each) kept for backward at once: peak >= 2 A + weights.
    from torch.distributed._tools.mem_tracker import MemTracker

    def step(tracker_cls):
        torch.manual_seed(0)
        model = nn.Linear(256, 256, bias=False)
        x = [torch.randn(512, 256), torch.randn(512, 256)]
        t = tracker_cls()
        t.track_external(model)
        with t:
            losses = [model(xi).relu().sum() for xi in x]
            sum(losses).backward()
        return max(v["Total"] for v in t.get_tracker_snapshot("peak").values())

    with pytest.raises(NotImplementedError, match="multiple iterative calls"):
        step(MemTracker)
    A, W = 512 * 256 * 4, 256 * 256 * 4
    assert step(measure_mod._repeatable_tracker_class()) >= 2 * A + W


def test_fsdp_model_uses_the_fsdp_tracker_and_maps_its_categories():
    # one-rank FSDP2 (nothing sharded away): FSDPMemTracker's "Sharded Param"/"OptState"/"Activation" map to
    # params P, optimizer 2P (+4-byte steps) and the L saved ReLU outputs (A bytes each), as without FSDP
    torch.manual_seed(0)
    L, h, B = 4, 64, 1024
    model = nn.Sequential(*[m for _ in range(L) for m in (nn.Linear(h, h, bias=False), nn.ReLU())])
    res = torchloom.auto_accelerate(model, torch.optim.AdamW, None, lambda b, o: o.pow(2).mean(), strategy=["fsdp"],
                                    optim_args={"lr": 1e-3, "foreach": False}, dataloader_args={"batch_size": B})
    m = measure_steps(res, [torch.randn(B, h)], steps=1, warmup=1)
    P, A = L * h * h * 4, B * h * 4
    assert m.memory_method == "fsdp_memtracker"
    assert m.memory["params"] == P and m.memory["optimizer"] == 2 * P + 4 * L
    assert L * A <= m.memory["activations"] <= L * A + 64
    assert sum(m.memory.values()) == m.peak_memory_bytes


def test_model_with_frozen_parameters_is_measured():
    """torch 2.13's MemTracker registers a gradient hook on every parameter, which raises for a frozen one
    (found by a user test: every trial of a model with frozen embeddings lost its memory reading). Frozen
    parameters count as parameters and get no gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    res = _accelerate(model, 4)
    m = measure_steps(res, [torch.randn(4, 8)], steps=1, warmup=1)
    assert m.memory_error == "" and m.peak_memory_bytes > 0, m.memory_error
    assert m.memory["params"] == 2 * (64 + 8) * 4
    assert m.memory["grads"] == (64 + 8) * 4  # the trainable layer only
