"""``torchloom.hf.TorchloomTrainer``: ``transformers.Trainer.train()`` with ``["fsdp", "amp", "checkpoint"]`` on 2 gloo
ranks (a tiny Llama with dropout), stopped at step 3 (mid-epoch) and resumed by a new Trainer through the disk and the
flash tier, against the uninterrupted run and a plain torchloom loop (all bitwise); evaluate() and save_model(); and
the argument checks (one process, nothing distributed: they raise before the Trainer is built)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _hf_trainer_workers as w
from torchloom.testing import run_ranks

transformers = pytest.importorskip("transformers")


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_trainer_train_stop_resume_equals_uninterrupted_and_plain_loop(tmp_path):
    r0, r1 = run_ranks(w.train_stop_resume, 2, str(tmp_path), timeout=300,
                       env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    # batch arithmetic: micro 2 x accumulation 2 (torchloom's) x dp 2 = global 8, what the Trainer reports too
    assert r0["batch"] == (w.MICRO, w.ACCUM, 8, 2, 8)
    full = r0["full_losses"]
    assert sorted(full) == list(range(1, w.STEPS + 1))
    assert r0["full_state"] == (w.STEPS, 1.5, w.STEPS)  # 4 steps an epoch
    # every Trainer callback fires once per optimizer step (substeps: the other micro-batch of each window)
    steps = list(range(w.STEPS))
    assert r0["callbacks"] == {"step_begin": steps, "substep_end": steps, "pre_optimizer_step": steps,
                               "optimizer_step": steps, "step_end": [s + 1 for s in steps]}
    assert r0["lrs"] == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025])  # linear, 2 warmup steps
    for tier in ("disk", "flash"):
        assert r0[f"{tier}_stopped_at"] == w.STOP
        assert r0[f"{tier}_state"] == (w.STEPS, 1.5)
        assert r0[f"{tier}_losses"] == full, f"{tier}: logged losses differ from the uninterrupted run"
        assert _same(r0[f"{tier}_params"], r0["full_params"]), f"{tier}: resumed parameters differ"
    assert r0["disk_layout"] == ["checkpoint-3/torchloom", "checkpoint-3/trainer_state.json"]
    assert (r0["disk_source"], r0["flash_source"]) == ("disk", "memory")  # flash: the crashed job's memory snapshot
    assert r0["flash_layout"] == ["checkpoint-3/trainer_state.json", "torchloom_flash/step_00000003"]
    # the plain torchloom loop with the same settings: the same losses and parameters, bitwise
    assert r0["plain_losses"] == [full[s] for s in sorted(full)]
    assert _same(r0["plain_params"], r0["full_params"])
    # evaluate(): each of the 7 samples once (a filler batch on rank 1 is not counted), equal to per-sample losses
    for r in (r0, r1):
        assert r["eval"] == pytest.approx(r["eval_ref"], rel=1e-12, abs=0)
        assert r["log_has_eval"]
    assert "IterableDataset and dp=2" in r0.get("iterable_refused", "")
    assert r0["forward_got_labels"] == [False]  # one cross-entropy per micro-batch: the loss's own
    assert r0["config_file"] == (True, "FSDPLlamaForCausalLM", 8)  # torchloom_strategy=None: the file's [fsdp]
    assert r0["saved"] is True  # save_model -> torchloom.hf.save_pretrained -> from_pretrained: the same weights


def _args(tmp_path, **kw):
    return transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, **kw)


@pytest.mark.parametrize("field, value, hint", [
    ("fsdp", "full_shard", "put 'fsdp'"),
    ("bf16", True, "('amp', {'dtype': 'bfloat16'})"),
    ("gradient_checkpointing", True, "add 'checkpoint'"),
    ("torch_compile", True, "add 'compile'"),
    ("deepspeed", "ds_config.json", "DeepSpeed would wrap the model again"),
    ("load_best_model_at_end", True, "not supported"),
    ("ignore_data_skip", True, "exact next micro-batch"),
])
def test_training_arguments_that_would_wrap_again_are_refused(tmp_path, field, value, hint):
    from torchloom.hf import TorchloomTrainer

    args = _args(tmp_path)
    setattr(args, field, value)  # set after construction: TrainingArguments would otherwise load DeepSpeed etc.
    with pytest.raises(ValueError, match="TorchloomTrainer") as e:
        TorchloomTrainer(model=torch.nn.Linear(2, 2), args=args, torchloom_strategy=["fsdp"])
    assert f"TrainingArguments.{field}=" in str(e.value) and hint in str(e.value)


def test_trainer_arguments_torchloom_cannot_honour_are_refused(tmp_path):
    from torchloom.hf import TorchloomTrainer

    model, args = torch.nn.Linear(2, 2), _args(tmp_path)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cases = [
        (dict(optimizers=(opt, None)), ValueError, "optimizer_cls_and_kwargs"),
        (dict(torchloom_strategy="auto"), NotImplementedError, "strategy it chose"),
        (dict(compute_loss_func=lambda *a: 0), NotImplementedError, "torchloom_loss_func"),
        (dict(torchloom_checkpoint="s3"), ValueError, "'disk', 'flash'"),
        (dict(torchloom_args={"optim_args": {"lr": 1}}), ValueError, "TrainingArguments"),
        (dict(model_init=lambda: model), ValueError, "model_init"),
    ]
    for kwargs, error, hint in cases:
        kwargs = {"model": None if "model_init" in kwargs else model, "args": args, **kwargs}
        with pytest.raises(error, match="TorchloomTrainer") as e:
            TorchloomTrainer(**kwargs)
        assert hint in str(e.value), (kwargs, str(e.value))
    with pytest.raises(ValueError, match="train_sampling_strategy='group_by_length'"):
        TorchloomTrainer(model=model, args=_args(tmp_path, train_sampling_strategy="group_by_length"))

    class OwnLoss(TorchloomTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 0

    with pytest.raises(NotImplementedError, match="torchloom_loss_func"):
        OwnLoss(model=model, args=args)


def _checkpoint(root, n, trainer_state=True, tier=None):
    """``checkpoint-N`` (with a trainer_state.json) and its torchloom state committed in ``tier``: "disk"
    (checkpoint-N/torchloom/step_N), "flash" (torchloom_flash/step_N) or None (never committed)."""
    from torchloom.checkpoint import commit

    d = root / f"checkpoint-{n}"
    d.mkdir()
    if trainer_state:
        (d / "trainer_state.json").write_text("{}")
    if tier is not None:
        state = (d / "torchloom" if tier == "disk" else root / "torchloom_flash") / commit.step_dirname(n)
        state.mkdir(parents=True)
        (state / "rank0.bin").write_bytes(b"x")
        commit.write_marker(state, step=n, world_size=1)  # the commit point: COMPLETE, written last


def test_resume_true_picks_the_newest_committed_checkpoint(tmp_path):
    from torchloom.hf.trainer import newest_checkpoint

    assert newest_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 3, tier="disk")
    _checkpoint(tmp_path, 10, tier="flash")
    _checkpoint(tmp_path, 12, trainer_state=False, tier="disk")  # interrupted before its trainer_state.json
    _checkpoint(tmp_path, 15)  # flash: trainer_state.json written, the background save never committed (node lost)
    assert newest_checkpoint(tmp_path) == str(tmp_path / "checkpoint-10")  # 10 > 3 numerically
    assert newest_checkpoint(tmp_path, in_memory=[15]) == str(tmp_path / "checkpoint-15")  # same node: memory


def test_rotation_keeps_committed_checkpoints_until_a_newer_one_commits(tmp_path):
    from torchloom.hf.trainer_args import stale_checkpoints

    _checkpoint(tmp_path, 3, tier="flash")
    _checkpoint(tmp_path, 6)  # its flash save is still in the background
    assert stale_checkpoints(tmp_path, 1) == []  # checkpoint-3 is the only resumable one
    from torchloom.checkpoint import commit

    state = tmp_path / "torchloom_flash" / commit.step_dirname(6)
    state.mkdir()
    commit.write_marker(state, step=6, world_size=1)  # step 6 commits
    assert stale_checkpoints(tmp_path, 1) == [tmp_path / "checkpoint-3", tmp_path / "torchloom_flash" / "step_00000003"]
    # the best checkpoint (save_strategy="best") keeps its flash state; at most save_total_limit in all
    _checkpoint(tmp_path, 9, tier="flash")
    assert stale_checkpoints(tmp_path, 2, best=tmp_path / "checkpoint-3") == [
        tmp_path / "checkpoint-6", tmp_path / "torchloom_flash" / "step_00000006"]
    assert stale_checkpoints(tmp_path, None) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_multi_process_cpu_job_without_use_cpu_is_refused(tmp_path, monkeypatch):
    from torchloom.hf import TorchloomTrainer

    monkeypatch.setenv("WORLD_SIZE", "2")  # as the launcher sets it; Accelerate ignores it on CPU without use_cpu
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=False)
    with pytest.raises(ValueError, match=r"2 processes were launched.*TrainingArguments\(use_cpu=True\)"):
        TorchloomTrainer(model=torch.nn.Linear(2, 2), args=args)
