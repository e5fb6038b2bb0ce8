"""Rank functions for tests/distributed/test_hf_trainer.py (imported by qualified name in spawned ranks)."""
from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

VOCAB, SEQ, N_TRAIN, N_EVAL = 128, 16, 32, 7
STRATEGY = ["fsdp", "amp", "checkpoint"]  # amp is bf16 on CPU
# 2 ranks x micro 2 x accumulation 2 = global batch 8: 4 steps an epoch; 6 steps cross an epoch, stop at 3 mid-epoch
MICRO, ACCUM, STEPS, STOP, WARMUP, LR, WD = 2, 2, 6, 3, 2, 1e-2, 0.01


# the world-size change: 2 ranks x micro 2 x accumulation 2 (global batch 8), fp32, no dropout, checkpoint at 4 of 8
ELASTIC_STEPS, ELASTIC_SAVE = 8, 4


def tiny_llama(dropout: float = 0.1):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_dropout=dropout)  # RNG must resume too
    return LlamaForCausalLM(cfg)


class Regressor(torch.nn.Module):
    """A plain module (no Hugging Face class): ``forward(x, labels) -> {"loss"}``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def forward(self, x, labels=None):
        out = self.body(x).squeeze(-1)
        return {"loss": ((out - labels) ** 2).mean(), "pred": out}


def regression_samples(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    return [{"x": row, "labels": row.sum()} for row in x]


def samples(n: int, seed: int) -> list[dict]:
    """Token windows whose labels end in -100 padding of random length (token-exact loss matters)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    lens = torch.randint(SEQ // 2, SEQ + 1, (n,), generator=g)
    out = []
    for row, n_valid in zip(ids, lens):
        labels = row.clone()
        labels[n_valid:] = -100
        out.append({"input_ids": row, "labels": labels})
    return out


def training_args(out: str, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=out, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
                max_steps=STEPS, learning_rate=LR, weight_decay=WD, warmup_steps=WARMUP, lr_scheduler_type="linear",
                optim="adamw_torch", max_grad_norm=1.0, logging_steps=1, save_strategy="steps", save_steps=STOP,
                report_to="none", disable_tqdm=True, seed=0, per_device_eval_batch_size=1, use_cpu=True)
    base.update(kw)
    return TrainingArguments(**base)


def stop_at(step: int):
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        """A real interruption: training ends after step ``step`` (its checkpoint was saved)."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= step:
                control.should_training_stop = True
            return control

    return StopAt()


class Crash(RuntimeError):
    pass


def crash_after_save(step: int):
    from transformers import TrainerCallback

    class CrashAfterSave(TrainerCallback):
        """The job dies right after the checkpoint of ``step`` (no orderly end of training)."""

        def on_save(self, args, state, control, **kwargs):
            if state.global_step >= step:
                raise Crash(f"killed after step {state.global_step}")

    return CrashAfterSave()


class Counter:
    """Counts the Trainer callbacks that fire (they must stay coherent with torchloom's stepping)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Count(TrainerCallback):
            def __init__(self):
                self.seen = {}

            def _hit(self, name, state):
                self.seen.setdefault(name, []).append(state.global_step)

            def on_step_begin(self, args, state, control, **kw):
                self._hit("step_begin", state)

            def on_step_end(self, args, state, control, **kw):
                self._hit("step_end", state)

            def on_substep_end(self, args, state, control, **kw):
                self._hit("substep_end", state)

            def on_pre_optimizer_step(self, args, state, control, **kw):
                self._hit("pre_optimizer_step", state)

            def on_optimizer_step(self, args, state, control, **kw):
                self._hit("optimizer_step", state)

        return _Count()


def full_params(model) -> dict:
    from torchloom.checkpoint.state import full_model_state

    return {k: v.detach().clone().cpu() for k, v in full_model_state(model).items()}


def trainer(out: str, callbacks=(), eval_set=None, **kw):
    from torchloom.hf import TorchloomTrainer

    tier = kw.pop("torchloom_checkpoint", "disk")
    return TorchloomTrainer(model=tiny_llama(), args=training_args(out, **kw), train_dataset=samples(N_TRAIN, 1),
                            eval_dataset=eval_set, callbacks=list(callbacks), torchloom_strategy=STRATEGY,
                            torchloom_checkpoint=tier)


def elastic_trainer(out: str, **kw):
    """fp32, no dropout, plain data parallel: runs on 2 ranks and on 1 agree up to the reduction order."""
    from torchloom.hf import TorchloomTrainer

    args = training_args(out, max_steps=ELASTIC_STEPS, save_steps=ELASTIC_SAVE, **kw)
    return TorchloomTrainer(model=tiny_llama(dropout=0.0), args=args, train_dataset=samples(N_TRAIN, 1),
                            torchloom_strategy=[])


def losses(t) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in t.state.log_history if "loss" in h}


def plain_loop() -> tuple[list[float], dict]:
    """The same auto_accelerate settings in a hand-written loop: the reference the Trainer must equal."""
    from transformers import default_data_collator, get_linear_schedule_with_warmup

    import torchloom

    model = tiny_llama()

    def adamw(params, **kw):  # the Trainer's groups: no decay for norms (Llama has no biases)
        names = {id(p): n for n, p in model.named_parameters()}
        no_decay = [p for p in params if "norm" in names[id(p)]]
        decay = [p for p in params if "norm" not in names[id(p)]]
        return torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                                 **kw)

    res = torchloom.auto_accelerate(
        model, adamw, samples(N_TRAIN, 1), lambda b, o: torchloom.SumLoss.from_hf(o, b["labels"]), STRATEGY,
        optim_args={"lr": LR, "betas": (0.9, 0.999), "eps": 1e-8},
        dataloader_args={"batch_size": MICRO * ACCUM * dist.get_world_size(), "micro_batch_size": MICRO, "seed": 0,
                         "drop_last": False, "collate_fn": default_data_collator},
        model_input_format="unpack_dict", max_grad_norm=1.0, seed=0,
        lr_scheduler_cls=functools.partial(get_linear_schedule_with_warmup, num_warmup_steps=WARMUP,
                                           num_training_steps=STEPS))
    logged, window = [], torch.zeros(2, dtype=torch.float64)
    while res.train_step.optimizer_steps < STEPS:
        for batch in res.dataloader:
            res.train_step(batch)
            window += res.train_step.last_loss_stat  # [loss sum, tokens] of the micro-batch over both ranks
            if res.train_step.micro_step % ACCUM == 0:  # the Trainer's logged loss: the window's token mean
                logged.append((torch.tensor(0.0) + (window[0] / window[1]).float()).item())
                window.zero_()
                if res.train_step.optimizer_steps == STEPS:
                    break
    return logged, full_params(res.model)


def train_stop_resume(tmp: str) -> dict:
    """Uninterrupted Trainer run; the same stopped at step 3 and resumed by a new Trainer (disk tier, then flash);
    the plain torchloom loop; evaluate() and save_model()."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    out: dict = {"seconds": {}}
    tmp = Path(tmp)
    clock = [time.perf_counter()]

    def lap(name):  # phase wall times (reported, not asserted)
        now = time.perf_counter()
        out["seconds"][name], clock[0] = round(now - clock[0], 2), now

    count = Counter()
    full = trainer(str(tmp / "full"), callbacks=[count], save_strategy="no")  # saving changes nothing
    res = full.torchloom
    out["batch"] = (res.micro_batch_size, res.grad_accum_steps, res.global_batch_size, res.mesh.dp_size,
                    full.get_total_train_batch_size(full.args))
    forward_got_labels = []  # the default causal-LM loss holds the labels back from the model's forward
    hook = res.model.register_forward_pre_hook(lambda m, a, kw: forward_got_labels.append("labels" in kw),
                                               with_kwargs=True)
    full.train()
    hook.remove()
    out["forward_got_labels"] = sorted(set(forward_got_labels))
    out["full_losses"], out["full_params"] = losses(full), full_params(res.model)
    out["full_state"] = (full.state.global_step, full.state.epoch, full.state.max_steps)
    out["callbacks"] = {k: list(v) for k, v in count.seen.items()}
    out["lrs"] = [h["learning_rate"] for h in full.state.log_history if "learning_rate" in h]
    lap("uninterrupted")

    # eval: every one of the 7 samples once (batch 1 per rank: the last step has a filler on rank 1)
    eval_set = samples(N_EVAL, 2)
    full.eval_dataset = eval_set
    seen = []

    def metrics(pred):  # compute_metrics: the predictions of every sample once, in dataset order
        seen.append((pred.predictions, pred.label_ids))
        return {"samples": len(pred.label_ids)}

    full.compute_metrics = metrics
    got = full.evaluate()
    out["eval"], out["eval_samples"] = got["eval_loss"], got.get("eval_samples")
    with torch.no_grad():
        res.model.eval()
        ref = [res.train_step.eval_output({k: v[None] for k, v in s.items()}) for s in eval_set]
        res.model.train()
    out["eval_ref"] = sum(loss.item() for loss, _ in ref) / len(ref)
    (preds, label_ids), = seen
    out["eval_predictions"] = (preds.shape, torch.equal(torch.from_numpy(label_ids),
                                                        torch.stack([s["labels"] for s in eval_set])),
                               max(float((torch.from_numpy(preds[i]).float() - o.logits[0].float()).abs().max())
                                   for i, (_, o) in enumerate(ref)))
    out["log_has_eval"] = any("eval_loss" in h for h in full.state.log_history)
    lap("evaluate")

    full.save_model(str(tmp / "export"))  # torchloom.hf.save_pretrained: collective
    if dist.get_rank() == 0:
        from transformers import LlamaForCausalLM

        sd = LlamaForCausalLM.from_pretrained(str(tmp / "export")).state_dict()
        out["saved"] = sorted(sd) == sorted(out["full_params"]) and all(
            torch.equal(sd[k], v) for k, v in out["full_params"].items())
    dist.barrier()
    lap("save_model")

    for tier in ("disk", "flash"):
        d = str(tmp / tier)
        first = trainer(d, callbacks=[stop_at(STOP) if tier == "disk" else crash_after_save(STOP)],
                        torchloom_checkpoint=tier)
        try:
            first.train()
        except Crash:  # flash: the job dies after its step-3 save; its savers finish, shared memory stays
            first._tl_flash.finalize(unlink=False)
        out[f"{tier}_stopped_at"] = first.state.global_step
        out[f"{tier}_ckpts"] = sorted(p.name for p in Path(d).glob("checkpoint-*"))
        out[f"{tier}_layout"] = sorted(str(p.relative_to(d)) for p in Path(d).glob("*/*") if "rank" not in p.name)
        second = trainer(d, torchloom_checkpoint=tier, save_strategy="no")  # (a saver start costs ~5 s)
        second.train(resume_from_checkpoint=True if tier == "disk" else str(Path(d) / f"checkpoint-{STOP}"))
        out[f"{tier}_losses"] = {**losses(first), **losses(second)}
        out[f"{tier}_params"] = full_params(second.torchloom.model)
        out[f"{tier}_state"] = (second.state.global_step, second.state.epoch)
        out[f"{tier}_source"] = second.torchloom_resumed_from["source"]
        del first, second
        lap(f"stop_resume_{tier}")

    out["plain_losses"], out["plain_params"] = plain_loop()
    lap("plain_loop")

    # the world-size change (checked on 1 process by the test): uninterrupted 8 steps, checkpoint-4 kept
    elastic = elastic_trainer(str(tmp / "elastic"))
    elastic.train()
    out["elastic_losses"], out["elastic_params"] = losses(elastic), full_params(elastic.torchloom.model)
    out["elastic_batch"] = (elastic.torchloom.global_batch_size, elastic.torchloom.grad_accum_steps)
    lap("elastic")

    # a plain nn.Module under FSDP: save_model writes its gathered state dict as model.safetensors
    from torchloom.hf import TorchloomTrainer

    plain = TorchloomTrainer(model=Regressor(), args=training_args(str(tmp / "plain"), max_steps=2,
                                                                  save_strategy="no", warmup_steps=0),
                             train_dataset=regression_samples(16), torchloom_strategy=["fsdp"])
    plain.train()
    want = full_params(plain.torchloom.model)
    plain.save_model(str(tmp / "plain_export"))
    if dist.get_rank() == 0:
        from safetensors.torch import load_file

        sd = load_file(str(tmp / "plain_export" / "model.safetensors"))
        out["plain_module_saved"] = (sorted(sd), sorted(want), all(torch.equal(sd[k], want[k]) for k in want),
                                     (tmp / "plain_export" / "training_args.bin").is_file())
    try:
        TorchloomTrainer(model=Regressor(), args=training_args(str(tmp / "avg"), average_tokens_across_devices=False),
                         train_dataset=regression_samples(16), torchloom_strategy=[])
    except ValueError as e:
        out["average_tokens_refused"] = str(e)
    lap("plain_module")

    class Stream(torch.utils.data.IterableDataset):  # the whole stream on every rank: would train on duplicates
        def __iter__(self):
            return iter(samples(N_TRAIN, 1))

    from torchloom.hf import TorchloomTrainer

    try:
        TorchloomTrainer(model=tiny_llama(), args=training_args(str(tmp / "stream")), train_dataset=Stream(),
                         torchloom_strategy=STRATEGY)
    except NotImplementedError as e:
        out["iterable_refused"] = str(e)

    # torchloom_strategy=None: the `loom config` file's strategy, for the batch arithmetic and the model alike
    cfg = tmp / "loom_config.yaml"
    if dist.get_rank() == 0:
        cfg.write_text("config_version: 1\nstrategy: [fsdp]\n")
    dist.barrier()
    os.environ["TORCHLOOM_CONFIG_FILE"] = str(cfg)
    try:
        from_file = TorchloomTrainer(model=tiny_llama(), args=training_args(str(tmp / "cfg")),
                                     train_dataset=samples(N_TRAIN, 1))
    finally:
        del os.environ["TORCHLOOM_CONFIG_FILE"]
    out["config_file"] = (str(cfg) in from_file.torchloom.notes[0], type(from_file.torchloom.model).__name__,
                          from_file.get_total_train_batch_size(from_file.args))
    if dist.get_rank():
        for k in [k for k in out if k.endswith("_params")]:
            out[k] = None  # rank 0's copy is enough (the full state is the same on every rank)
    return out
