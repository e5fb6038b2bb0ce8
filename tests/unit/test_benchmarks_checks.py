"""The silent-fallback checks of ``python -m benchmarks compare`` (benchmarks/compare/summary.py): a contender
that runs one process, keeps DDP when FSDP was asked for, leaves ZeRO parameters or optimizer state whole, or
trains something else, is flagged and left out of the headline ratios. Rows are built from synthetic launch
results (no processes, no peers installed)."""
from benchmarks.compare.summary import headlines, loss_checks, row

FULL = 1000 * 4 * 1024  # bytes of the full fp32 model
CFG = dict(model="tiny", global_batch=16, steps=2, warmup=1, threads=1)


def _launch(world=2, dist_world=None, own_world=None, wrapper="FSDPLlamaForCausalLM (3 FSDP units)",
            param_bytes=FULL // 2, optim=FULL, losses=(7.0, 6.9, 6.8), step_s=(1.0, 0.5, 0.5)):
    rank = {"step_s": list(step_s), "loss": list(losses), "setup_s": 1.0, "train_peak_rss": 5 << 20,
            "setup_peak_rss": 4 << 20, "param_bytes": param_bytes, "optim_state_bytes": optim,
            "optim_param_copy_bytes": 0, "full_param_bytes": FULL, "dist_world_size": dist_world or world,
            "contender_world_size": own_world or world, "wrapper": wrapper, "threads": 1, "notes": []}
    return {"ranks": [dict(rank) for _ in range(world)]}


def test_a_correct_sharded_run_has_no_checks():
    r = row("torch_native:torch_fsdp2_zero3", [_launch()], CFG, 2)
    assert r["checks"] == []


def test_one_process_instead_of_two_is_flagged():  # `accelerate launch --cpu --num_processes 2` ran one
    r = row("accelerate_:accel_ddp", [_launch(dist_world=1, own_world=1, wrapper="DistributedDataParallel",
                                               param_bytes=FULL, optim=2 * FULL)], CFG, 2)
    assert any("process group world size 1 != 2" in c for c in r["checks"]), r["checks"]
    assert any("contender reports world size 1" in c for c in r["checks"])


def test_fsdp_plugin_ignored_is_flagged():  # Accelerator(cpu=True) with the FSDP plugin gives DDP
    r = row("accelerate_:accel_fsdp2_zero3", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL,
                                                       optim=2 * FULL)], CFG, 2)
    assert any("wrapper" in c and "expected 'FSDP'" in c for c in r["checks"]), r["checks"]
    assert any(c.startswith("not sharded") for c in r["checks"])
    assert any(c.startswith("optimizer state not sharded") for c in r["checks"])


def test_optimizer_that_never_stepped_is_flagged():
    r = row("torch_native:torch_ddp", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL, optim=0)],
            CFG, 2)
    assert any("never stepped" in c for c in r["checks"])


def test_different_training_is_flagged_and_left_out_of_the_headlines():
    ref = row("torch_native:torch_ddp", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL,
                                                 optim=2 * FULL)], CFG, 2)
    off = row("loom:loom_ddp", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL, optim=2 * FULL,
                                        losses=(7.0, 6.0, 5.0))], CFG, 2)
    loss_checks([ref, off])
    assert ref["checks"] == []
    assert any("loss trajectory differs" in c for c in off["checks"]), off["checks"]
    (ov,) = headlines([ref, off])["overhead"]
    assert ov["valid"] is False


def test_overhead_ratio_is_loom_over_hand_written_median():
    ref = row("torch_native:torch_ddp", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL,
                                                 optim=2 * FULL, step_s=(9.0, 0.4, 0.4, 0.4))], CFG, 2)
    loom = row("loom:loom_ddp", [_launch(wrapper="DistributedDataParallel", param_bytes=FULL, optim=2 * FULL,
                                         step_s=(9.0, 0.5, 0.5, 0.5))], CFG, 2)
    loss_checks([ref, loom])
    (ov,) = headlines([ref, loom])["overhead"]
    assert ov["valid"] and abs(ov["ratio"] - 1.25) < 1e-9  # the warm-up step (9 s) is not timed


def test_diverged_replicas_are_flagged():  # each rank stepped on its own gradient (no all-reduce)
    la = _launch(wrapper="DistributedDataParallel", param_bytes=FULL, optim=2 * FULL)
    la["ranks"][0]["param_digest"], la["ranks"][1]["param_digest"] = "aa", "bb"
    r = row("accelerate_:accel_ddp", [la], CFG, 2)
    assert any(c.startswith("replicas diverged") for c in r["checks"]), r["checks"]
    same = _launch(wrapper="DistributedDataParallel", param_bytes=FULL, optim=2 * FULL)
    for rk in same["ranks"]:
        rk["param_digest"] = "aa"
    assert row("accelerate_:accel_ddp", [same], CFG, 2)["checks"] == []


def test_a_round_that_failed_invalidates_the_row():  # a crash in round 2 must not leave a "valid" row
    good = _launch()
    r = row("torch_native:torch_fsdp2_zero3", [good, {"error": "rank 1: RuntimeError: gloo timeout"}], CFG, 2)
    assert r["rounds_failed"] == 1
    assert any("failed in 1 of 2 rounds: rank 1: RuntimeError" in c for c in r["checks"]), r["checks"]


def test_bad_command_lines_are_clear_errors(capsys):
    import pytest

    from benchmarks.compare.cli import parse

    for argv, says in ((["--contenders", "torch_ddp,nope"], "unknown contender 'nope'; choose from"),
                       (["--worlds", "0"], "must be >= 1"), (["--models", "nosuch"], "unknown model 'nosuch'"),
                       (["--global-batch", "3", "--worlds", "2"], "not divisible by 2 processes")):
        with pytest.raises(SystemExit):
            parse(argv)
        assert says in capsys.readouterr().err, argv
    assert parse(["--smoke"]).contenders == "torch_native:torch_ddp,loom:loom_ddp"
