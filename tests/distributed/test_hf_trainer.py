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


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """The one 2-rank launch: ``(tmp dir, rank 0's result, rank 1's result)``."""
    tmp = tmp_path_factory.mktemp("hf_trainer")
    r0, r1 = run_ranks(w.train_stop_resume, 2, str(tmp), timeout=300,
                       env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"})
    return tmp, r0, r1


@pytest.mark.distributed
def test_trainer_train_stop_resume_equals_uninterrupted_and_plain_loop(two_ranks):
    _tmp, r0, r1 = two_ranks
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
        # compute_metrics: the 7 samples' logits and labels once each, in dataset order (no filler, no repeat)
        shape, labels_in_order, logits_diff = r["eval_predictions"]
        assert (tuple(shape), labels_in_order, r["eval_samples"]) == ((w.N_EVAL, w.SEQ, w.VOCAB), True, w.N_EVAL)
        assert logits_diff <= 1e-6
    assert "IterableDataset and dp=2" in r0.get("iterable_refused", "")
    assert r0["forward_got_labels"] == [False]  # one cross-entropy per micro-batch: the loss's own
    assert r0["config_file"] == (True, "FSDPLlamaForCausalLM", 8)  # torchloom_strategy=None: the file's [fsdp]
    assert r0["saved"] is True  # save_model -> torchloom.hf.save_pretrained -> from_pretrained: the same weights
    # a plain nn.Module under FSDP: save_model writes the gathered state dict as model.safetensors (as the Trainer)
    keys, want, equal, args_saved = r0["plain_module_saved"]
    assert keys == want == ["body.0.bias", "body.0.weight", "body.2.bias", "body.2.weight"] and equal and args_saved
    assert "average_tokens_across_devices=False is not supported with dp=2" in r0["average_tokens_refused"]


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
    ("bf16_full_eval", True, "evaluation runs in the strategy's precision"),
    ("ddp_find_unused_parameters", True, "('ddp', {'find_unused_parameters': True})"),
    ("ddp_static_graph", True, "('ddp', {'static_graph': True})"),
    ("batch_eval_metrics", True, "calls compute_metrics once"),
    ("include_for_metrics", ["inputs"], "the predictions and label_ids only"),
    ("eval_use_gather_object", True, "gathers tensors"),
    ("dataloader_in_order", False, "needs them in order"),
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
    with pytest.raises(ValueError, match="accelerator_config.split_batches=True is not supported"):
        TorchloomTrainer(model=model, args=_args(tmp_path, accelerator_config={"split_batches": True}))

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


# ---------------------------------------------------------------------------------------------- one process
# In the test process itself (a single-rank gloo group, as auto_accelerate makes without a launcher): no launch.

@pytest.mark.distributed
def test_resume_on_one_process_keeps_the_global_batch_and_reaches_max_steps(two_ranks, caplog):
    """checkpoint-4 of the 2-rank run (micro 2 x accumulation 2 x dp 2 = global batch 8) resumed on 1 process:
    accumulation 2 -> 4 keeps the global batch, training reaches max_steps, and the losses and parameters are
    those of the uninterrupted 2-rank run up to the reduction order (fp32, no dropout: rtol 1e-5)."""
    import logging

    tmp, r0, _ = two_ranks
    out, ckpt = tmp / "elastic", str(tmp / "elastic" / f"checkpoint-{w.ELASTIC_SAVE}")
    assert r0["elastic_batch"] == (8, 2)
    # impossible on this layout: refused before any step, naming the sizes that work
    bad = w.elastic_trainer(str(out), per_device_train_batch_size=3, save_strategy="no")
    with pytest.raises(ValueError, match=r"global batch of 8 samples .*per_device_train_batch_size=3 x dp=1 = 3 "
                                         r"does not divide.*Use per_device_train_batch_size 1, 2, 4 or 8 "
                                         r"\(gradient_accumulation_steps is then derived: 8, 4, 2 or 1\)"):
        bad.train(resume_from_checkpoint=ckpt)
    assert (bad.state.global_step, bad.torchloom.train_step.micro_step) == (0, 0)
    del bad

    t = w.elastic_trainer(str(out), save_strategy="no")
    with caplog.at_level(logging.WARNING, logger="torchloom.hf.trainer"):
        t.train(resume_from_checkpoint=ckpt)
    assert ("gradient_accumulation_steps 2 -> 4 keeps the checkpoint's global batch of 8 samples on dp=1"
            in caplog.text)
    res = t.torchloom
    assert (res.global_batch_size, res.grad_accum_steps, t.args.gradient_accumulation_steps) == (8, 4, 4)
    assert (t.state.global_step, t.state.epoch) == (w.ELASTIC_STEPS, 2.0)  # 4 steps of 8 samples an epoch
    want = r0["elastic_losses"]
    got = w.losses(t)
    assert sorted(got) == sorted(want) == list(range(1, w.ELASTIC_STEPS + 1))
    for step in range(w.ELASTIC_SAVE + 1, w.ELASTIC_STEPS + 1):
        assert got[step] == pytest.approx(want[step], rel=1e-5), step
    params = w.full_params(res.model)
    assert params.keys() == r0["elastic_params"].keys()
    for k, v in r0["elastic_params"].items():
        torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.distributed
def test_logged_loss_and_compute_metrics_match_the_plain_trainer(tmp_path):
    """The same data (labels padded to random lengths), order, accumulation and optimizer through a plain
    ``transformers.Trainer`` and a TorchloomTrainer on 1 process: the logged ``loss`` (the Trainer's token-weighted
    mean over each accumulation window) and ``evaluate()`` with ``compute_metrics`` agree (fp32: rtol 1e-5)."""
    from transformers import Trainer

    from torchloom.hf import TorchloomTrainer

    def token_accuracy(pred):
        hit = (pred.predictions[:, :-1].argmax(-1) == pred.label_ids[:, 1:]) & (pred.label_ids[:, 1:] != -100)
        return {"token_accuracy": hit.sum() / (pred.label_ids[:, 1:] != -100).sum(), "rows": len(pred.label_ids)}

    kw = dict(max_steps=4, train_sampling_strategy="sequential", save_strategy="no", warmup_steps=0)
    data, evals = w.samples(16, 5), w.samples(5, 6)
    ours = TorchloomTrainer(model=w.tiny_llama(0.0), args=w.training_args(str(tmp_path / "tl"), **kw),
                            train_dataset=data, eval_dataset=evals, compute_metrics=token_accuracy,
                            torchloom_strategy=[])
    ours.train()
    ref = Trainer(model=w.tiny_llama(0.0), args=w.training_args(str(tmp_path / "hf"), **kw), train_dataset=data,
                  eval_dataset=evals, compute_metrics=token_accuracy)
    ref.train()
    mine, theirs = w.losses(ours), w.losses(ref)
    assert sorted(mine) == sorted(theirs) == [1, 2, 3, 4]
    for step in mine:
        assert mine[step] == pytest.approx(theirs[step], rel=1e-5), (step, mine, theirs)
    a, b = ours.evaluate(), ref.evaluate()
    assert a["eval_rows"] == b["eval_rows"] == 5
    assert a["eval_loss"] == pytest.approx(b["eval_loss"], rel=1e-5)
    assert a["eval_token_accuracy"] == pytest.approx(b["eval_token_accuracy"], abs=1e-9)
    pred = ours.predict(evals)
    assert pred.predictions.shape == (5, w.SEQ, w.VOCAB) and pred.metrics["test_rows"] == 5


@pytest.mark.distributed
def test_lora_checkpoints_hold_the_adapter_only_and_resume_bitwise(tmp_path):
    """A PeftModel's checkpoint-N holds the adapter (trainable parameters) only, as the Trainer's; resuming from it
    on the same frozen base continues bitwise."""
    peft = pytest.importorskip("peft")
    from torch.distributed.checkpoint import FileSystemReader

    from torchloom.hf import TorchloomTrainer

    def lora():
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(w.tiny_llama(0.0), cfg)

    def trainer(**kw):
        return TorchloomTrainer(model=lora(), args=w.training_args(str(tmp_path), max_steps=4, save_steps=2,
                                                                   warmup_steps=0, **kw),
                                train_dataset=w.samples(16, 1), torchloom_strategy=[])

    full = trainer()
    full.train()
    state = tmp_path / "checkpoint-2" / "torchloom" / "step_00000002"
    saved = {k: v.size for k, v in FileSystemReader(str(state)).read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    adapter = {f"model.{n}": p.shape for n, p in lora().named_parameters() if p.requires_grad}
    assert saved == adapter and all("lora_" in k for k in saved), sorted(saved)  # no frozen base weight
    resumed = trainer(save_strategy="no")
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert w.losses(resumed) == w.losses(full)
    a, b = w.full_params(full.torchloom.model), w.full_params(resumed.torchloom.model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
def test_refusals_advise_what_a_trainer_user_can_do(tmp_path):
    """save_model into a folder holding another model, and a resume whose adapters differ from the checkpoint's, are
    refused with advice a TorchloomTrainer user can follow: save_model takes no overwrite=True and train() no
    strict=False, so neither is offered as the fix."""
    peft = pytest.importorskip("peft")
    from torchloom.errors import CheckpointError
    from torchloom.hf import TorchloomTrainer, save_pretrained

    def trainer(targets, **kw):
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0)
        args = w.training_args(str(tmp_path / "run"), max_steps=2, save_steps=2, warmup_steps=0, **kw)
        return TorchloomTrainer(model=peft.get_peft_model(w.tiny_llama(0.0), cfg), args=args,
                                train_dataset=w.samples(8, 1), torchloom_strategy=[])

    t = trainer(["q_proj", "v_proj"])
    t.train()
    other = tmp_path / "other"
    save_pretrained(w.tiny_llama(0.0), other)  # a full model where the adapter would go
    before = sorted(p.name for p in other.iterdir())
    with pytest.raises(CheckpointError) as e:
        t.save_model(str(other))
    msg = str(e.value)
    assert "holds a full model" in msg and "nothing was written" in msg and "Pass overwrite=True" not in msg, msg
    assert "another TrainingArguments.output_dir" in msg and f"move that model's files out of {other}" in msg
    assert f"torchloom.hf.save_pretrained(trainer.torchloom.model, '{other}', overwrite=True)" in msg
    assert sorted(p.name for p in other.iterdir()) == before  # no adapter, no training_args.bin

    resumed = trainer(["q_proj", "k_proj", "v_proj"], save_strategy="no")
    with pytest.raises(CheckpointError) as e:
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    msg = str(e.value)
    assert "trainable in the model but not in the checkpoint" in msg and "strict=False" not in msg, msg
    assert "TorchloomTrainer resumes strictly" in msg and "train without resume_from_checkpoint" in msg
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-2"]  # nothing trained


@pytest.mark.distributed
def test_reduce_lr_on_plateau_is_stepped_by_evaluation_not_every_step(tmp_path):
    """A metric-driven scheduler is stepped by the Trainer after each evaluation (train_step would call it
    without the metric at the first optimizer step)."""
    from torchloom.hf import TorchloomTrainer

    args = w.training_args(str(tmp_path), max_steps=3, save_strategy="no", warmup_steps=0, eval_strategy="steps",
                           eval_steps=1, lr_scheduler_type="reduce_lr_on_plateau")
    t = TorchloomTrainer(model=w.Regressor(), args=args, train_dataset=w.regression_samples(16),
                         eval_dataset=w.regression_samples(4), torchloom_strategy=[])
    t.train()
    assert t.state.global_step == 3
    assert isinstance(t.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
    assert t.lr_scheduler.last_epoch == 3  # once per evaluation
