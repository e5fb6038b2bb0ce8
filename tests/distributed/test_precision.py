"""amp and half on 2 gloo ranks: which dtypes actually ran, and the trained parameters against a single-process
replay of the same precision (``_precision_workers``: same micro-batches and shapes, hence the same
low-precision roundings).

Distances that make the tolerances meaningful (tiny Llama, 3 SGD steps, lr 0.1, momentum 0.9; measured with
the replays on this CPU build, max |param difference|):
- a distributed run against its replay: 0 (bitwise) for ddp+amp, fsdp+amp and ddp+half;
- bf16 autocast vs fp32: 1.1e-4; FSDP bf16 policy vs fp32: 1.4e-4; half vs fp32: 1.8e-3;
- an untrained run (lr=0) or a doubled gradient vs the right one: 1.7e-2 (in every precision).
PARAM_ATOL = 1e-5 is 10x below the nearest wrong answer (the fp32 run) and the test asserts that each replay
is further than 5x PARAM_ATOL from the fp32 one, so a run in the wrong precision fails. Losses are compared
at rtol 1e-6: bf16 vs fp32 loss differs by ~2e-5 relative, lr=0 by ~1e-3.
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _precision_workers as W
from torchloom.testing import run_ranks

PARAM_ATOL = 1e-5
LOSS_RTOL = 1e-6
BF16, FP32 = "torch.bfloat16", "torch.float32"


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), set(a) ^ set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in b)


@pytest.fixture(scope="module")
def llama_runs():
    return run_ranks(W.llama_precision_runs, 2, timeout=600)


@pytest.fixture(scope="module")
def replays():
    out = {m: W.replay_llama(m) for m in ("fp32", "autocast", "fsdp_mp", "half")}
    out["precast_autocast"] = W.replay_llama("autocast", precast=True)
    out["precast_fsdp_mp"] = W.replay_llama("fsdp_mp", precast=True)
    out["lr0"] = W.replay_llama("fp32", lr=0.0)
    out["double"] = W.replay_llama("fp32", grad_factor=2.0)
    return out


def test_replays_are_far_apart(replays):
    """The references themselves: each precision is further from fp32 than the tolerance, and a wrong run
    (no update, doubled gradient) is further still; otherwise the comparisons below prove nothing."""
    fp32 = replays["fp32"][1]
    for mode in ("autocast", "fsdp_mp", "half", "precast_autocast", "precast_fsdp_mp"):
        assert _max_diff(replays[mode][1], fp32) > 5 * PARAM_ATOL, mode
    for wrong in ("lr0", "double"):
        assert _max_diff(replays[wrong][1], fp32) > 1000 * PARAM_ATOL, wrong
    assert _max_diff(replays["half"][1], replays["autocast"][1]) > 5 * PARAM_ATOL


REPLAY_OF = {"ddp_amp": "autocast", "fsdp_amp": "fsdp_mp", "ddp_half": "half",
             "ddp_amp_precast": "precast_autocast", "fsdp_amp_precast": "precast_fsdp_mp"}


@pytest.mark.distributed
@pytest.mark.parametrize("tag", list(REPLAY_OF))
def test_llama_matches_replay_of_its_precision(tag, llama_runs, replays):
    for rank, runs in enumerate(llama_runs):
        got = runs[tag]
        ref_losses, ref_params = replays[REPLAY_OF[tag]]
        assert _max_diff(got["params"], ref_params) <= PARAM_ATOL, (tag, rank, _max_diff(got["params"], ref_params))
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref_losses), rtol=LOSS_RTOL, atol=0)
        # the wrong-precision neighbour is out of tolerance (fp32 for amp; amp's autocast for half)
        other = replays["autocast" if tag == "ddp_half" else "fp32"][1]
        assert _max_diff(got["params"], other) > 5 * PARAM_ATOL, tag


@pytest.mark.distributed
def test_amp_dtypes_that_ran(llama_runs):
    for runs in llama_runs:
        for tag in ("ddp_amp", "fsdp_amp", "ddp_amp_precast", "fsdp_amp_precast"):
            got = runs[tag]
            linears = {k: v for k, v in got["modules"].items() if k.endswith("_proj") or k == "lm_head"}
            assert len(linears) == 2 * 7 + 1, sorted(linears)
            for name, seen in linears.items():
                for x_dtype, out_dtype, w_dtype in seen:
                    assert out_dtype == BF16, (tag, name, seen)  # the matmuls ran in bf16
                    if tag.startswith("fsdp"):  # FSDP2 policy: the unsharded parameter and the input are bf16
                        assert (x_dtype, w_dtype) == (BF16, BF16), (tag, name, seen)
                    else:  # autocast casts inside F.linear: the module's own weight stays fp32
                        assert w_dtype == FP32, (tag, name, seen)
            # fp32 where the docs promise: outputs (logits, loss), master weights, gradients, optimizer state
            assert got["outputs"] == [(FP32, FP32)], (tag, got["outputs"])
            assert got["param_dtypes"] == [FP32] and got["grads"] == [FP32] and got["opt_state"] == [FP32], (tag, got)
            assert all(d == FP32 for n, (d, _) in got["buffers"].items()), (tag, got["buffers"])
            assert got["compute_dtype"] == "torch.bfloat16"
        for tag in ("ddp_amp_precast", "fsdp_amp_precast"):
            assert any("upcast to fp32" in w for w in runs[tag]["warnings"]), runs[tag]["warnings"]
            assert any("upcast to fp32" in n for n in runs[tag]["notes"])
        assert not any("upcast" in w for w in runs["ddp_amp"]["warnings"] + runs["fsdp_amp"]["warnings"])


@pytest.mark.distributed
def test_half_dtypes_that_ran_and_buffers_kept(llama_runs, replays):
    plain = W.tiny_llama()
    for runs in llama_runs:
        got = runs["ddp_half"]
        for name, seen in got["modules"].items():
            assert seen == [(BF16, BF16, BF16)], (name, seen)
        assert got["outputs"] == [(BF16, FP32)]  # bf16 logits; HF upcasts logits for its loss
        assert got["param_dtypes"] == [BF16] and got["grads"] == [BF16] and got["opt_state"] == [BF16]
        # rotary inverse frequencies are fp32 state: kept in dtype and value
        for n in ("model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"):
            dtype, value = got["buffers"][n]
            assert dtype == FP32 and torch.equal(value, dict(plain.named_buffers())[n]), n


# ------------------------------------------------------------------------------------------ fp16 scaler
FP16_STEPS, FP16_INIT, FP16_GROWTH = 8, 2.0**24, 2
FP16_ATOL = 1e-6  # measured: 0 against the GradScaler replay; fp16 vs fp32 (same skips) and lr=0: asserted


@pytest.mark.distributed
def test_fp16_scale_backs_off_and_grows_like_grad_scaler():
    """ddp + amp fp16 with growth_interval=2 against torch.amp.GradScaler on the replayed ranks: the scale
    after every step (halving on each overflow, doubling after 2 clean steps) and the skipped steps are
    identical, and the parameters agree within FP16_ATOL, while the fp32 run is > 5x FP16_ATOL away."""
    ref_scales, ref_skipped, ref_params = W.replay_fp16_scaler(FP16_STEPS, FP16_INIT, FP16_GROWTH)
    # the reference schedule exercises both directions: backoff, then growth past growth_interval
    # (five overflows halve 2**24 to 2**19, two clean steps double it, and 2**20 overflows again)
    assert ref_skipped == [True] * 5 + [False, False, True], ref_skipped
    assert ref_scales == [2.0**e for e in (23, 22, 21, 20, 19, 19, 20, 19)], ref_scales
    outs = run_ranks(W.fp16_scaler_run, 2, FP16_STEPS, FP16_INIT, FP16_GROWTH, timeout=600)
    fp32 = W.replay_llama("fp32", steps=FP16_STEPS, skip=frozenset(i for i, k in enumerate(ref_skipped) if k))[1]
    for got in outs:
        assert got["scales"] == ref_scales, (got["scales"], ref_scales)
        assert got["skipped"] == ref_skipped
        assert got["state"]["skipped_steps"] == sum(ref_skipped)
        assert _max_diff(got["params"], ref_params) <= FP16_ATOL
        for name, seen in got["modules"].items():
            assert all(out == "torch.float16" for _, out, _ in seen), (name, seen)
    # the fp32 run on the same (unskipped) batches is out of tolerance: the test sees fp16 rounding
    assert _max_diff(ref_params, fp32) > 5 * FP16_ATOL, _max_diff(ref_params, fp32)


# ------------------------------------------------------------------------------------ BatchNorm CNN
# (rtol, atol) per replay. fp32 master weights: the 2-way statistics average is a gloo all-reduce in another
# order (rtol 1e-5 / atol 1e-6). half: bf16 weights, and FSDP reduce-scatters bf16 gradients in another
# rounding than the replay's bf16 sum, so an element may land a bf16 step away after one step, and the steps
# compound: rtol 2**-6 (2 to 4 bf16 steps; one conv weight landed 3 steps away on an AVX2 AMD EPYC, where
# 2**-7 had held on the machine the test was written on). The fp32 replay stays outside it (asserted below).
CNN_TOL = {"fsdp_mp": (1e-5, 1e-6), "autocast": (1e-5, 1e-6), "half": (2.0**-6, 1e-6)}


def _close(a, b, tol) -> bool:
    return torch.allclose(a.float(), b.float(), rtol=tol[0], atol=tol[1])


@pytest.mark.distributed
def test_batchnorm_cnn_under_fsdp_amp_and_half():
    """A conv + BatchNorm CNN under fsdp+amp (also built on the meta device), fsdp+half, ddp+half and ddp+amp:
    it runs, the running
    statistics stay fp32 and equal a replay (per-rank updates averaged), BatchNorm computes with fp32
    weights while the convs ran in bf16, and the parameters match the replay within CNN_TOL; the fp32
    replay is outside CNN_TOL of every low-precision one (asserted), so a run in fp32 would fail."""
    outs = run_ranks(W.cnn_precision_runs, 2, timeout=600)
    replay = {m: W.replay_cnn(m) for m in ("fp32", "fsdp_mp", "half", "autocast")}
    want = {"fsdp_amp": "fsdp_mp", "fsdp_half": "half", "ddp_half": "half", "ddp_amp": "autocast",
            "fsdp_amp_meta": "fsdp_mp"}  # a meta-built model materialises to the CPU build (test_meta_init.py)
    for tag, mode in want.items():
        tol = CNN_TOL[mode]
        assert not all(_close(replay[mode][1][n], p, tol) for n, p in replay["fp32"][1].items()), mode
        for got in (o[tag] for o in outs):
            assert "error" not in got, (tag, got.get("error"))
            assert got["running"], tag
            for n, b in got["buffers"].items():
                assert b.dtype == replay[mode][0][n].dtype == (torch.int64 if "num_batches" in n else torch.float32)
                torch.testing.assert_close(b, replay[mode][0][n], rtol=tol[0], atol=tol[1],
                                           msg=lambda m: f"{tag} {n}: {m}")
            for n, p in replay[mode][1].items():
                torch.testing.assert_close(got["params"][n], p, rtol=tol[0], atol=tol[1],
                                           msg=lambda m: f"{tag} {n}: {m}")
            for name, seen in got["modules"].items():
                for x_dtype, out_dtype, w_dtype in seen:
                    if name.endswith(".bn"):
                        assert w_dtype == FP32 and out_dtype == BF16, (tag, name, seen)
                    else:
                        assert out_dtype == BF16, (tag, name, seen)
    fsdp_notes = " ".join(outs[0]["fsdp_amp"]["notes"])
    assert "2 BatchNorm-like units in fp32" in fsdp_notes, fsdp_notes


@pytest.mark.distributed
def test_input_cast_rule_for_containers():
    """docs/methods/amp.md "Inputs": under fsdp+amp FSDP casts every floating tensor in dicts, tuples, lists,
    namedtuples and dataclasses to bf16; ddp+amp (autocast) and half pass inputs through unchanged; integer
    and bool tensors are never cast."""
    outs = run_ranks(W.input_rule_runs, 2, timeout=600)
    for got in outs:
        for tag, seen in got.items():
            assert len(seen) == 12, (tag, seen)
            for path, dtype in seen.items():
                batch = W.container_batch()
                original = _lookup(batch, path)
                if original.is_floating_point() and tag == "fsdp_amp":
                    assert dtype == BF16, (tag, path, dtype)
                else:
                    assert dtype == str(original.dtype), (tag, path, dtype)


def _lookup(batch, path: str) -> torch.Tensor:
    import re

    v = batch
    for key, idx in re.findall(r"\.(\w+)|\[(\d+)\]", path[len("batch"):]):
        if idx:
            v = v[int(idx)]
        elif isinstance(v, dict):
            v = v[key]
        else:
            v = getattr(v, key)
    return v
