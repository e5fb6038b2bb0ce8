"""Data-parallel replicas never diverge silently (issue [5] item 1): parameters without a gradient under
DDP/FSDP, and the replica checksum (``check_replicas_every``). One 2-rank and one 4-rank launch.

Before the fix: DDP stepped on unreduced gradients at step 0 (BranchNet's body/head differed across ranks
after one step) and failed only at step 1 with PyTorch's "Expected to have finished reduction"; FSDP with a
branch taken on one rank only aborted in gloo ("Received data size doesn't match expected size").

Tolerances: SGD, fp32; distributed vs single-process parameters atol 1e-6 (BranchNet) / 2e-5 (tiny Llama,
as tests/distributed/test_methods_equivalence.py): differences come from the order of the gradient sums
only. A wrong run is far outside: an unsynchronised step, or the branch gradient of the rank that did not
take it counted as the other rank's, moves parameters by > 1e-3 (asserted below with the references).
"""
import functools

import pytest
import torch

import torchloom
from tests.distributed._consistency_workers import BranchNet, llama_reference, reference_branch_net, suite
from torchloom.testing import run_ranks

ATOL = 1e-6

UNUSED_2 = {
    # an output the loss ignores (aux): clear error before step 0's optimizer step
    "unused_output": dict(strategy=["ddp"], steps=3, rule="never", loss="head"),
    "unused_output_plain_loop": dict(strategy=["ddp"], steps=3, rule="never", loss="head", plain_loop=True),
    "unused_output_zero1_plain_loop": dict(strategy=["zero1"], steps=3, rule="never", loss="head", plain_loop=True),
    # static_graph: sound for a module skipped in forward at every step; for an output the loss ignores it
    # leaves step 1 unreduced on torch 2.13 (pytorch/pytorch issue 97030): stopped there
    "skipped_branch_static_graph": dict(strategy=[("ddp", {"static_graph": True})], steps=3, rule="never",
                                        loss="both"),
    "unused_output_static_graph": dict(strategy=[("ddp", {"static_graph": True})], steps=3, rule="never",
                                       loss="head"),
    # a branch used on even steps only: error at step 1; find_unused_parameters trains it
    "branch_some_steps": dict(strategy=["ddp"], steps=3, rule="even_steps", loss="both"),
    "branch_some_steps_static_graph": dict(strategy=[("ddp", {"static_graph": True})], steps=3, rule="even_steps",
                                           loss="both"),
    # skipped at step 0, used at step 1: DDP's static graph raises inside backward (explained)
    "branch_late_static_graph": dict(strategy=[("ddp", {"static_graph": True})], steps=3, rule="odd_steps",
                                     loss="both"),
    "branch_some_steps_find_unused": dict(strategy=[("ddp", {"find_unused_parameters": True})], steps=3,
                                          rule="even_steps", loss="both"),
    # a branch taken on rank 0 only
    "branch_rank0_find_unused": dict(strategy=[("ddp", {"find_unused_parameters": True})], steps=3, rule="rank0",
                                     loss="both"),
    "branch_rank0_zero3": dict(strategy=["fsdp"], steps=3, rule="rank0", loss="both"),
    "branch_rank0_zero2": dict(strategy=["zero2"], steps=3, rule="rank0", loss="both"),
    "branch_rank0_zero3_older_torch": dict(strategy=["fsdp"], steps=3, rule="rank0", loss="both",
                                           older_torch_fsdp=True),
    # requires_grad changed after DDP was built (DDP fixed its parameter list then)
    "freeze_after_wrap": dict(strategy=["ddp"], steps=4, rule="always", loss="both", freeze_at=2),
    "freeze_after_wrap_find_unused": dict(strategy=[("ddp", {"find_unused_parameters": True})], steps=4,
                                          rule="always", loss="both", freeze_at=2),
    "unfreeze_after_wrap": dict(strategy=["ddp"], steps=3, rule="always", loss="both", unfreeze_aux_at=1),
    # accumulation (no_sync): the branch runs on micro-batch 0 of each window, not on the last (1)
    "branch_not_on_last_micro_batch": dict(strategy=["ddp"], steps=4, rule="even_steps", loss="both", accum=2),
    # a plain loop, backward on every micro-batch without no_sync: micro-batch 0 leaves the branch unreduced
    "branch_not_on_first_micro_batch_plain_loop": dict(strategy=["ddp"], steps=4, rule="odd_steps", loss="both",
                                                       accum=2, plain_loop=True),
}

REPLICA_2 = {
    "ddp": dict(strategy=["ddp"], perturb="layers.0.mlp.up_proj", perturb_rank=1),
    "zero1": dict(strategy=["zero1"]),
    "fsdp_no_replicas": dict(strategy=["fsdp"]),
}

REPLICA_4 = {
    "hsdp": dict(strategy=[("parallel_mode", {"dp_replicate": 2, "dp_shard": 2}), "fsdp"],
                 perturb="layers.1.self_attn.q_proj", perturb_rank=3),
    "tp_dp_replicate": dict(strategy=[("parallel_mode", {"tp": 2}), "tensor_parallel"],
                            perturb="layers.0.self_attn.o_proj", perturb_rank=3),
    "ddp4": dict(strategy=["ddp"], perturb="embed_tokens", perturb_rank=2),
    # 2 stages x dp 2: stage 0 is ranks 0, 1; stage 1 (ranks 2, 3) does not hold embed_tokens
    "pp_dp": dict(strategy=[("pipeline_parallel", {"size": 2})], perturb="embed_tokens", perturb_rank=1),
}

UNUSED_4 = {
    "unused_output": dict(strategy=["ddp"], steps=2, rule="never", loss="head"),
    "branch_rank0_zero3": dict(strategy=["fsdp"], steps=3, rule="rank0", loss="both"),
}


@functools.lru_cache(maxsize=None)
def _launch(world: int):
    """Every case of one world size in one launch: ``{rank: ({unused case: out}, {replica case: out})}``."""
    unused, replica = (UNUSED_2, REPLICA_2) if world == 2 else (UNUSED_4, REPLICA_4)
    outs = run_ranks(suite, world, list(unused.values()), list(replica.values()), timeout=900)
    return {r: (dict(zip(unused, o[0])), dict(zip(replica, o[1]))) for r, o in enumerate(outs)}


def _close(got, want, atol=ATOL, what=""):
    assert set(got) == set(want), set(got) ^ set(want)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v.float(), atol=atol, rtol=0, msg=lambda m: f"{what} {k}: {m}")


def _same_on_all_ranks(outs, case, kind=0):
    p0 = outs[0][kind][case]["params"]
    for r in outs:
        for k, v in p0.items():
            assert torch.equal(v, outs[r][kind][case]["params"][k]), f"{case}: {k} differs on rank {r}"


def _far(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_unused_output_stops_before_the_first_step(world):
    outs = _launch(world)
    init = {k: v.detach().clone() for k, v in BranchNet().state_dict().items()}
    cases = ["unused_output"] + (["unused_output_plain_loop", "unused_output_zero1_plain_loop"] if world == 2 else [])
    for case in cases:
        for r in outs:
            o = outs[r][0][case]
            assert o["steps"] == 0, (case, o)
            kind, msg = o["error"]
            assert kind == "GradientSyncError", (case, o["error"])
            assert "optimizer step 0" in msg and "4 of 8 trainable parameters" in msg, msg
            assert "branch.weight, branch.bias, aux.weight, aux.bias" in msg and "static_graph" in msg and "find_unused_parameters" in msg, msg
            # stopped before any update: the parameters are still the initial ones, bitwise, on every rank
            for k, v in init.items():
                assert torch.equal(o["params"][k], v), (case, k)
    # what the old behaviour did: one unsynchronised step moved body/head away from the synchronised step
    assert _far(reference_branch_net(1, world, "never", "head"), init) > 1e-3


@pytest.mark.distributed
def test_static_graph_with_parameters_unused_at_every_step():
    outs = _launch(2)
    o = outs[0][0]["skipped_branch_static_graph"]
    assert o["error"] is None and o["steps"] == 3, o["error"]
    _close(o["params"], reference_branch_net(3, 2, "never", "both"), what="static_graph")
    _same_on_all_ranks(outs, "skipped_branch_static_graph")
    for r in outs:
        o = outs[r][0]["unused_output_static_graph"]
        assert o["steps"] == 1 and o["error"][0] == "GradientSyncError", o["error"]
        assert "aux.weight, aux.bias" in o["error"][1] and "97030" in o["error"][1], o["error"]
        _close(o["params"], reference_branch_net(1, 2, "never", "head"), what="static_graph step 0")
    _same_on_all_ranks(outs, "unused_output_static_graph")


@pytest.mark.distributed
def test_branch_used_on_some_steps():
    outs = _launch(2)
    after_one = reference_branch_net(1, 2, "even_steps", "both")
    for case, advice in [("branch_some_steps", "changes from step to step"),
                         ("branch_some_steps_static_graph", "static_graph: true needs the same parameters")]:
        for r in outs:
            o = outs[r][0][case]
            assert o["steps"] == 1, (case, o["error"])  # step 0 used every parameter and was synchronised
            kind, msg = o["error"]
            assert kind == "GradientSyncError" and "optimizer step 1" in msg, (case, o["error"])
            assert "branch.weight, branch.bias" in msg and advice in msg and "find_unused_parameters" in msg, msg
            _close(o["params"], after_one, what=case)
        _same_on_all_ranks(outs, case)
    for r in outs:
        o = outs[r][0]["branch_late_static_graph"]
        assert o["steps"] == 1 and o["error"][0] == "RuntimeError", o["error"]
        assert "graph has changed" in o["error"][1] and "[torchloom] static_graph: true needs" in o["error"][1]
        _close(o["params"], reference_branch_net(1, 2, "odd_steps", "both"), what="late branch")
    _same_on_all_ranks(outs, "branch_late_static_graph")
    o = outs[0][0]["branch_some_steps_find_unused"]
    assert o["error"] is None
    _close(o["params"], reference_branch_net(3, 2, "even_steps", "both"), what="find_unused")
    _same_on_all_ranks(outs, "branch_some_steps_find_unused")


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_branch_taken_on_one_rank_only(world):
    outs = _launch(world)
    ref = reference_branch_net(3, world, "rank0", "both")
    wrong = reference_branch_net(3, world, "always", "both")  # rank 0's branch gradient counted for all
    assert _far(ref, wrong) > 1e-3
    cases = ["branch_rank0_zero3"] + (["branch_rank0_find_unused", "branch_rank0_zero2",
                                       "branch_rank0_zero3_older_torch"] if world == 2 else [])
    for case in cases:
        o = outs[0][0][case]
        assert o["error"] is None and o["steps"] == 3, (case, o["error"])
        _close(o["params"], ref, what=case)
        _same_on_all_ranks(outs, case)


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 4])
def test_replica_check_passes_correct_runs_and_names_a_perturbed_parameter(world):
    outs = _launch(world)
    ref = llama_reference()
    table = REPLICA_2 if world == 2 else REPLICA_4
    for case, cfg in table.items():
        o = outs[0][1][case]
        # correct run: the monitor ran after steps 1, 2, 3 without a false positive, and training is exact
        assert o["monitor_checks"] == 3, (case, o)
        merged = {}  # every rank's (stage's) parameters; replicas must agree bitwise
        for r in outs:
            for k, v in outs[r][1][case]["params"].items():
                assert k not in merged or torch.equal(merged[k], v), f"{case}: {k} differs on rank {r}"
                merged[k] = v
        _close(merged, ref, atol=2e-5, what=case)
        if case == "fsdp_no_replicas":
            assert o["compared"] == 0  # every rank holds a different shard: nothing to compare
            continue
        assert o["compared"] > 0, case
        if "perturb" not in cfg:
            continue
        named = 0
        for r in outs:
            p = outs[r][1][case]
            assert not p["ok"], (case, r)  # every rank stops, also those whose own group agrees
            kind, msg = p["monitor_error"]
            assert kind == "ReplicaDivergenceError" and "after optimizer step 4" in msg, p["monitor_error"]
            if not p["diverged"]:
                assert "another rank's group" in p["message"] and "another rank's group" in msg, (case, r, msg)
                continue
            named += 1
            name = p["perturbed"]
            assert f"parameter {name!r} differs" in p["message"] and f"parameter {name!r}" in msg, p["message"]
            assert p["diverged"][0][0] == name and p["diverged"][0][1] == [cfg["perturb_rank"]], p["diverged"]
        assert named >= 2, case  # at least the perturbed rank and its reference replica name the parameter


def test_check_replicas_every_off_is_0_or_none_in_both_apis():
    """auto_accelerate and loom train agree: 0 and None mean off, a bool / negative / non-int is rejected.
    Before the fix auto_accelerate rejected 0 and loom train rejected null (one process, no launch)."""
    from torchloom.train.config import ConfigError, TrainConfig

    def accelerate(every):
        return torchloom.auto_accelerate(torch.nn.Linear(2, 2), torch.optim.SGD, None, optim_args={"lr": 0.1},
                                         check_replicas_every=every)

    for off in (0, None):
        res = accelerate(off)
        assert res.replica_monitor is None and not any("replica check" in n for n in res.notes), (off, res.notes)
        assert TrainConfig.load(None, [f"train.check_replicas_every={'null' if off is None else 0}"]) \
            .train.check_replicas_every in (0, None)
    assert accelerate(3).replica_monitor.every == 3
    for bad in (True, -1, 1.5, "5"):
        with pytest.raises((ValueError, TypeError), match="check_replicas_every"):
            accelerate(bad)
    for bad in ("true", "-1"):
        with pytest.raises(ConfigError, match="check_replicas_every"):
            TrainConfig.load(None, [f"train.check_replicas_every={bad}"])


@pytest.mark.distributed
def test_requires_grad_changed_after_ddp_was_built_is_named():
    """Freezing (or unfreezing) a parameter after auto_accelerate under DDP. Before the fix, freezing ``body``
    before step 2 raised "2 of 6 trainable parameters got no gradient on rank 0 (branch.weight, branch.bias)
    ... the set of used parameters changes", naming the wrong (used) parameters and not the cause, and
    unfreezing ``aux`` stepped it on each rank's own gradient, silently (DDP never reduces it)."""
    outs = _launch(2)
    for r in outs:
        o = outs[r][0]["freeze_after_wrap"]
        assert o["steps"] == 2 and o["error"][0] == "GradientSyncError", o["error"]
        msg = o["error"][1]
        assert "requires_grad=True when DDP was built" in msg and "(body.weight, body.bias)" in msg, msg
        assert "before auto_accelerate" in msg and "fsdp" in msg and "find_unused_parameters" in msg, msg
        assert "branch" not in msg, msg
        _close(o["params"], reference_branch_net(2, 2, "always", "both"), what="freeze_after_wrap")
        o = outs[r][0]["unfreeze_after_wrap"]
        assert o["steps"] == 1 and o["error"][0] == "GradientSyncError", o["error"]
        assert "requires_grad=False when DDP was built" in o["error"][1] and "(aux.weight, aux.bias)" in o["error"][1]
    # find_unused_parameters: DDP skips the frozen body; the run matches the reference frozen at step 2
    # (atol 1e-6; training body on through steps 2-3 moves it by > 1e-3, asserted)
    o = outs[0][0]["freeze_after_wrap_find_unused"]
    assert o["error"] is None and o["steps"] == 4, o["error"]
    want = reference_branch_net(4, 2, "always", "both", freeze_at=2)
    _close(o["params"], want, what="find_unused freeze")
    assert _far(reference_branch_net(4, 2, "always", "both"), want) > 1e-3
    _same_on_all_ranks(outs, "freeze_after_wrap_find_unused")


@pytest.mark.distributed
def test_parameter_unused_on_the_last_micro_batch_of_a_window():
    """Accumulation under no_sync: only the last micro-batch's backward is reduced. ``branch`` trains on
    micro-batch 0 but not on micro-batch 1; before the fix the message said it "got no gradient" and
    suggested freezing it."""
    outs = _launch(2)
    init = {k: v.detach().clone() for k, v in BranchNet().state_dict().items()}
    for r in outs:
        o = outs[r][0]["branch_not_on_last_micro_batch"]
        assert o["steps"] == 1 and o["error"][0] == "GradientSyncError", o["error"]
        msg = o["error"][1]
        assert "earlier micro-batch" in msg and "(branch.weight, branch.bias)" in msg, msg
        assert "only the last micro-batch's backward runs outside no_sync" in msg and "find_unused_parameters" in msg, msg
        assert "got no gradient" not in msg, msg
        for k, v in init.items():
            assert torch.equal(o["params"][k], v), k
    # a plain loop: DDP's next forward would raise "Expected to have finished reduction in the prior
    # iteration ... Parameter indices which did not receive grad for rank 0: 2 3"; named before it
    for r in outs:
        o = outs[r][0]["branch_not_on_first_micro_batch_plain_loop"]
        assert o["steps"] == 1 and o["error"][0] == "GradientSyncError", o["error"]
        assert "(branch.weight, branch.bias)" in o["error"][1] and "find_unused_parameters" in o["error"][1], o
        for k, v in init.items():
            assert torch.equal(o["params"][k], v), k
