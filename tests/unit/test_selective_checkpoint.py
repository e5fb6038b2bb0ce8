"""Selective activation checkpointing (``("checkpoint", {"mode": "selective"})``): the same gradients as
no checkpointing on a tiny Llama (one process, SGD step, max abs difference <= 1e-6 where a wrong
recomputation, e.g. a mismatched matmul choice between forward and recompute, differs by >1e-3 or raises),
fewer saved activations than no checkpointing and more than full checkpointing, and the cost model's
estimate in between as well."""
import torch

import torchloom
from torchloom.parallel.mesh import ParallelDims
from torchloom.search.candidate import Candidate, StepShape
from torchloom.cost.effects import Effects

from ..models import lm_loss, tiny_llama, token_batches


def _train_one_step(strategy):
    """One SGD step (loss, parameters after it) and the peak activation bytes of a second, tracked step."""
    from torchloom.search.measure import measure_steps

    res = torchloom.auto_accelerate(tiny_llama(layers=3), torch.optim.SGD, None, lm_loss, strategy=strategy,
                                    optim_args={"lr": 0.5}, model_input_format="unpack_dict")
    ids = token_batches(2, seq=32)
    loss = res.train_step({"input_ids": ids, "labels": ids})
    params = {n: p.detach().clone() for n, p in res.model.named_parameters()}
    m = measure_steps(res, [{"input_ids": ids, "labels": ids}], steps=1, warmup=0)
    return loss, params, m.memory["activations"]


def test_selective_checkpoint_trains_like_no_checkpoint_and_saves_in_between():
    ref_loss, ref, none_saved = _train_one_step([])
    sel_loss, sel, sel_saved = _train_one_step([("checkpoint", {"mode": "selective"})])
    _, full, full_saved = _train_one_step([("checkpoint", {})])
    assert torch.equal(ref_loss, sel_loss)
    worst = max((ref[n] - sel[n]).abs().max().item() for n in ref)
    assert worst <= 1e-6
    assert max((ref[n] - full[n]).abs().max().item() for n in ref) <= 1e-6
    # live activation bytes at the peak (MemTracker): the policy keeps more than full checkpointing, less
    # than none
    assert full_saved < sel_saved < none_saved


def test_selective_estimate_lies_between_none_and_full():
    from torchloom.methods.activation_checkpoint import ActivationCheckpoint, CheckpointConfig
    from torchloom.cost.analysis import analyze_model

    with torch.device("meta"):
        model = tiny_llama(layers=3)
    info = analyze_model(model, seq_len=32)
    dims = ParallelDims()
    cand = Candidate(dims, (("checkpoint", {}),), 2, 1, 32)
    step = StepShape.of(cand)
    full = ActivationCheckpoint(CheckpointConfig()).estimate(info, dims, None, step)
    sel = ActivationCheckpoint(CheckpointConfig(mode="selective")).estimate(info, dims, None, step)
    assert isinstance(sel, Effects)
    assert full.memory_scale["activations"] < sel.memory_scale["activations"] < 1.0
    assert full.recompute_matmul_share == 1.0 and 0.0 < sel.recompute_matmul_share < 1.0
