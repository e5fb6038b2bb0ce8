"""The reference job behind `loom train`: a LLaMA-style model trained on Shakespeare with torchloom.

Run under the launcher (``loom train`` = ``loom run --nproc 2 -m torchloom.train.job ...``) or as one
process (``loom train --no-launch``). Every process ends through
:func:`torchloom.elastic.shutdown.clean_exit`: exit code 0 after a correct run, 1 with a traceback on an
error (a checkpoint that cannot be loaded or saved: 1 with a message, no traceback), 2 for an invalid config
(or an output dir holding a run of another model). See ``docs/train.md``.
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..errors import CheckpointError
from .config import ConfigError, TrainConfig
from .dataset import TokenWindows

_PREFIX = "[loom]"


# ------------------------------------------------------------------------------------ recipe parts
def build_model(mc, vocab_size: int, eos_id: int, seed: int):
    """The job's model from ``mc`` (a :class:`ModelConfig`), initialised from ``seed``, in fp32:
    ``LlamaForCausalLM``, or with ``mc.moe.num_experts > 0`` its Mixture-of-Experts variant
    ``MixtralForCausalLM`` (the same sizes; every MLP becomes ``num_experts`` SwiGLU experts of width
    ``intermediate_size`` plus a router, ``output_router_logits=True`` so the output carries ``aux_loss``)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    common = dict(
        vocab_size=vocab_size, hidden_size=mc.hidden_size, intermediate_size=mc.intermediate_size,
        num_hidden_layers=mc.num_layers, num_attention_heads=mc.num_heads, num_key_value_heads=mc.num_kv_heads,
        max_position_embeddings=mc.seq_len, tie_word_embeddings=mc.tie_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": mc.rope_theta},
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id, use_cache=False,
    )
    if mc.is_moe:
        moe = mc.moe
        config, cls = MixtralConfig(
            **common, num_local_experts=moe.num_experts, num_experts_per_tok=moe.top_k,
            router_aux_loss_coef=moe.aux_loss_weight, router_jitter_noise=moe.router_jitter_noise,
            output_router_logits=True, sliding_window=None), MixtralForCausalLM
    else:
        config, cls = LlamaConfig(**common), LlamaForCausalLM
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return cls(config)


def causal_lm_loss(batch: dict[str, torch.Tensor], output: Any):
    """Summed next-token cross-entropy and the number of predicted tokens (labels != -100), as
    :class:`torchloom.SumLoss`, so gradient accumulation and data parallelism normalise exactly."""
    from torchloom import SumLoss

    from torchloom.hf.loss import causal_lm_logits, causal_lm_sum

    # (causal_lm_sum does not shift labels a sequence split already shifted over the whole sequence)
    total, count = causal_lm_sum(causal_lm_logits(output), batch["labels"], ignore_index=-100)
    return SumLoss(total, count)


class CausalLMLoss:
    """The job's ``loss_func``: :func:`causal_lm_loss` plus, for a Mixture-of-Experts model, its load-balancing
    loss with the model's coefficient, exactly once.

    The model's ``output.aux_loss`` (Hugging Face ``load_balancing_loss_func``: Switch Transformer eq. 4, over
    this micro-batch's tokens, averaged over layers) is a mean per token, so it enters the summed loss as
    ``aux_loss_weight * aux_loss * count``: after ``train_step`` divides by the global token count the
    objective is the mean cross-entropy plus ``aux_loss_weight`` times the token-weighted mean of the
    micro-batches' aux losses, for any split of the global batch (each rank's micro-batch computes its own
    aux loss, as Hugging Face and Megatron do). ``output.loss`` (which Hugging Face already adds the aux to)
    is not used. The aux term is added only when gradients are on (training): the held-out loss stays the
    plain cross-entropy, comparable with the dense model's.

    ``take()`` returns the ``(cross-entropy per token, aux loss)`` of every training call since the last
    ``take()`` (floats; aux None without experts), so the job reports the cross-entropy as ``loss`` and the
    aux loss separately.
    """

    def __init__(self, aux_loss_weight: float = 0.0):
        self.aux_loss_weight = float(aux_loss_weight)
        self._calls: list[tuple[torch.Tensor, torch.Tensor | None]] = []

    def __call__(self, batch: dict[str, torch.Tensor], output: Any):
        out = causal_lm_loss(batch, output)
        aux = getattr(output, "aux_loss", None)
        if aux is None or not torch.is_grad_enabled():
            return out
        ce = out.total.detach() / out.count.clamp(min=1)
        self._calls.append((ce, aux.detach().float()))
        return type(out)(out.total + self.aux_loss_weight * aux.float() * out.count, out.count)

    def take(self) -> list[tuple[float, float | None]]:
        calls, self._calls = self._calls, []
        return [(float(ce), None if aux is None else float(aux)) for ce, aux in calls]


def adamw(params, *, lr: float, weight_decay: float, betas: tuple[float, float], split_decay: bool = True,
          optimizer: str = "adamw", agd_delta: float = 1e-14, wsam_rho: float = 0.05, wsam_gamma: float = 0.9):
    """The job's optimizer (``optimizer``: adamw, agd or wsam around AdamW); with ``split_decay`` 1-D
    parameters (norm weights, biases) get no weight decay."""
    params = list(params)
    if split_decay:
        decay = [p for p in params if p.ndim >= 2]
        rest = [p for p in params if p.ndim < 2]
        groups = [g for g in ({"params": decay, "weight_decay": weight_decay},
                              {"params": rest, "weight_decay": 0.0}) if g["params"]]
        kw = {}
    else:
        groups, kw = params, {"weight_decay": weight_decay}
    if optimizer == "agd":
        from torchloom.optim import AGD

        return AGD(groups, lr=lr, betas=betas, delta=agd_delta, **kw)
    if optimizer == "wsam":
        from torchloom.optim import WSAM

        return WSAM(groups, torch.optim.AdamW, rho=wsam_rho, gamma=wsam_gamma, lr=lr, betas=betas, **kw)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, **kw)


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warmup over ``warmup`` steps, then cosine decay to ``min_ratio`` at ``total``."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return f


class RecordingWindows(TokenWindows):
    """:class:`TokenWindows` that remembers the indices it was asked for (``log.sample_ids``); in-process
    loading only (``num_workers: 0``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: list[int] = []

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        self.seen.append(int(i))
        return super().__getitem__(i)

    def take(self) -> list[int]:
        """The indices fetched since the last call, in fetch order."""
        out, self.seen = self.seen, []
        return out


class ResumeError(CheckpointError):
    """``loom train`` could not resume from the checkpoints in its output dir (the message says what to do)."""


SEARCHED_STRATEGY = "strategy.json"  # strategy: auto saves the chosen strategy here (output dir)


class _LogToJob(logging.Handler):
    """The search's progress (logger ``torchloom.search``) in the job's log (rank 0)."""

    def __init__(self, job: "Job"):
        super().__init__(logging.INFO)
        self.job = job
        self.seen: set[str] = set()  # every message and first line logged (the job skips these notes)

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        self.seen.update((msg, msg.split("\n", 1)[0]))
        for line in msg.splitlines():
            self.job.log(f"  {line}")


# ------------------------------------------------------------------------------------------ job
class Job:
    """One run of the training job on this rank (state shared by the loop, eval, checkpointing)."""

    expert_load = None  # a torchloom.moe ExpertLoadTracker for the MoE model (set in setup)

    def __init__(self, cfg: TrainConfig, max_steps_this_run: int | None = None):
        self.cfg = cfg
        self.max_steps_this_run = max_steps_this_run
        self.t_start = time.perf_counter()
        self.pbar = None
        self.flash = None  # a FlashCheckpointer when checkpoint.blocking is false (set in train)

    # -- output ---------------------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        if self.rank != 0:
            return
        if self.pbar is not None:
            self.pbar.write(f"{_PREFIX} {msg}", file=sys.stdout)
        else:
            print(f"{_PREFIX} {msg}", flush=True)
        sys.stdout.flush()

    # -- set-up ---------------------------------------------------------------------------------------
    def setup(self) -> None:
        from torch.optim.lr_scheduler import LambdaLR

        import torchloom
        from torchloom.parallel.distributed import init_distributed

        from .corpus import prepare_corpus
        from .dataset import TokenWindows
        from .metrics import PeakMemory, job_peak_flops, matmul_params

        cfg = self.cfg
        if cfg.watchdog.timeout_s:
            from torchloom.elastic.watchdog import enable_flight_recorder

            enable_flight_recorder()  # the watchdog's dump names the last collective; before the group exists
        self.device = init_distributed()
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.out = Path(cfg.output_dir).resolve()
        self.ckpt_root = self.out / "checkpoints"
        self.check_output_dir()  # before anything is written there
        self.dir_lock = self.lock_output_dir()  # one run per output dir: refused while another one trains there
        from torchloom.elastic.faults import FaultInjector, restart_attempt

        from .goodput import GoodputLog

        self.attempt = restart_attempt()
        self.faults = FaultInjector(self.rank, attempt=self.attempt)
        self.goodput = GoodputLog(self.out / "goodput.jsonl", enabled=self.rank == 0)
        if self.attempt:
            self.log(f"restart attempt {self.attempt} (TORCHELASTIC_RESTART_COUNT)")
        self.log(f"output dir {self.out}; {self.world} process(es) on {self.device.type}, "
                 f"{torch.get_num_threads()} thread(s) each; strategy {cfg.full_strategy()}")
        if cfg.ddp_swapped_for_fsdp():
            self.log("  ddp -> fsdp with dp_shard=1: DDP cannot hold tensor-parallel (DTensor) parameters; fsdp over "
                     "the replicate dimension keeps DDP's semantics (whole parameters per data-parallel rank, "
                     "gradients averaged once per step)")
        cfg.check_fits(self.world)  # `loom train` checked it for a fixed --nproc; --no-launch / auto not yet

        self.corpus = prepare_corpus(cfg.data.eval_plays, cfg.model.vocab_size, cfg.data.cache_dir, log=self.log)
        c = self.corpus
        self.log(f"corpus: {len(c.train_plays)} training texts, {c.train_ids.numel():,} tokens; held out "
                 f"{c.eval_plays}: {c.eval_ids.numel():,} tokens; vocab {c.vocab_size} ({c.cache_dir})")
        seq = cfg.model.seq_len
        if cfg.log.sample_ids and cfg.data.num_workers:
            raise ConfigError("log.sample_ids needs data.num_workers: 0 (the ids are recorded in this process); "
                              f"got data.num_workers={cfg.data.num_workers}")
        self.train_ds = (RecordingWindows if cfg.log.sample_ids else TokenWindows)(c.train_ids, seq)
        self.eval_ds = TokenWindows(c.eval_ids, seq)

        model = build_model(cfg.model, c.vocab_size, c.eos_id, cfg.train.seed)
        self.hf_config = model.config
        self.n_params = sum(p.numel() for p in model.parameters())
        self.n_matmul = matmul_params(model)
        from .metrics import active_params, flops_per_token

        # FLOPs count the parameters a token passes through: for experts, top_k of num_experts
        self.n_active = active_params(model, cfg.model.moe.top_k) if cfg.model.is_moe else self.n_params
        self.n_matmul -= self.n_params - self.n_active

        self.flops_per_token = flops_per_token(self.n_matmul, cfg.model.num_layers, cfg.model.hidden_size, seq)
        t = cfg.train
        signature = None
        if cfg.is_auto:
            from torchloom.search.auto import model_signature

            signature = model_signature(model)  # of the unchanged model, as a rerun's check computes it
        strategy, search = self.plan_strategy(cfg, lambda: build_model(cfg.model, c.vocab_size, c.eos_id, t.seed),
                                              signature=signature)
        analysis = self.analyze_for_check(model) if cfg.log.prediction_check and not cfg.is_auto else (None, None)
        extra = {} if search is None else {"search": search}
        self.loss_func = CausalLMLoss(cfg.model.moe.aux_loss_weight if cfg.model.is_moe else 0.0)
        self.res = torchloom.auto_accelerate(
            model, adamw, self.train_ds, self.loss_func, strategy=strategy,
            optim_args={"lr": t.lr, "weight_decay": t.weight_decay, "betas": (t.beta1, t.beta2),
                        "split_decay": cfg.is_auto or "zero1" not in strategy, "optimizer": t.optimizer,
                        "agd_delta": t.agd_delta, "wsam_rho": t.wsam_rho, "wsam_gamma": t.wsam_gamma},
            dataloader_args={"batch_size": t.global_batch, "micro_batch_size": None if cfg.is_auto else t.micro_batch,
                             "num_workers": cfg.data.num_workers, "shuffle": True, "drop_last": True},
            model_input_format="unpack_dict",
            lr_scheduler_cls=LambdaLR,
            lr_scheduler_args={"lr_lambda": warmup_cosine(t.warmup, t.steps, t.min_lr_ratio)},
            max_grad_norm=t.max_grad_norm, seed=t.seed, check_replicas_every=t.check_replicas_every or None,
            **extra,
        )
        res = self.res
        logged = self._search_log.seen if search is not None else set()
        for note in res.notes:
            if note not in logged:  # e.g. the search's summary line: its logger already put it in this log
                self.log(f"  {note}")
        self.strategy_used = res.strategy.to_list(explicit_only=True) if cfg.is_auto else cfg.full_strategy()
        if search is not None:
            self.save_searched(res, signature, search)
        self.tokens_per_step = res.global_batch_size * seq
        moe_note = ""
        if cfg.model.is_moe:
            from torchloom.moe import track_expert_load

            mc = cfg.model.moe
            moe_note = (f" ({mc.num_experts} experts per layer, top-{mc.top_k}: {self.n_active / 1e6:.2f}M active per "
                        f"token; aux loss weight {mc.aux_loss_weight}; expert parallel ep={res.mesh.dims.ep})")
            self.expert_load = track_expert_load(res.model)  # per-expert token counts for the metrics
            self._expert_held = torch.zeros_like(self.expert_load.counts(), dtype=torch.int64).cpu()
        name = type(model).__name__  # fully_shard swaps the class for FSDP<Name>: log the model's own name
        self.log(f"model: {name[4:] if name.startswith('FSDP') else name}, {self.n_params / 1e6:.2f}M parameters{moe_note} "
                 f"({self.n_matmul / 1e6:.2f}M in matmuls per token), {self.flops_per_token / 1e6:.1f} MFLOP/token; "
                 f"global batch {res.global_batch_size} x {seq} tokens = micro {res.micro_batch_size} x dp "
                 f"{res.mesh.dp_size} x accum {res.grad_accum_steps}")
        if len(res.dataloader) == 0:
            raise ConfigError(f"train.global_batch={t.global_batch} is larger than the {len(self.train_ds)} "
                              "training windows: nothing to train on.")

        self.drift = self.prediction_check(*analysis)

        # peak FLOP/s: every rank measures at once (cores are shared), the job keeps the best, with the load;
        # train() re-measures it at evaluations and checkpoints (MfuMeter keeps the highest)
        self.peak = job_peak_flops(self.device, res.compute_dtype)
        self.log(self.peak.describe())
        self.mem = PeakMemory(self.device)

    # -- the cost model's online check ---------------------------------------------------------------
    def analyze_for_check(self, model) -> tuple[Any, str | None]:
        """``(ModelInfo, None)`` of the unchanged ``model`` for :meth:`prediction_check` (~0.5 s for the default
        model; its own loss object, so the job's loss records nothing), or ``(None, why)``."""
        from torch.utils.data._utils.collate import default_collate

        from torchloom.search.drift import analyze_for_check

        mc = self.cfg.model
        try:
            sample = default_collate([self.train_ds[0]])
        except Exception as e:  # noqa: BLE001 - the check never stops training
            return None, f"no sample for the model analysis ({type(e).__name__}: {e})"
        loss = CausalLMLoss(mc.moe.aux_loss_weight if mc.is_moe else 0.0)
        return analyze_for_check(model, sample, input_format="unpack_dict", loss_func=loss, seq_len=mc.seq_len)

    def prediction_check(self, info=None, why_no_info: str | None = None):
        """The :class:`~torchloom.search.drift.PredictionDrift` of the plan that runs (collective: the job's
        calibration, ``job_hardware``): the searched plan's prediction under ``strategy: auto``, else the
        applied strategy priced on ``info``; inactive (one line says why) when ``log.prediction_check`` is
        false, no calibration of this machine is cached, or anything fails. Rank 0 logs it and gives its one
        warning."""
        from torchloom.search.drift import PredictionDrift, prediction_check

        if not self.cfg.log.prediction_check:
            return PredictionDrift.unavailable("log.prediction_check: false", emit=False)
        t = time.perf_counter()
        drift = prediction_check(self.res, info=info, why_no_info=why_no_info, seq_len=self.cfg.model.seq_len,
                                 measure=False,  # a cached calibration only: the job never calibrates for it
                                 emit=(lambda msg: self.log(f"warning: {msg}")) if self.rank == 0 else False)
        for note in drift.notes:
            self.log(f"  calibration: {note}")
        self.log(f"{drift.describe()} ({time.perf_counter() - t:.1f} s)")
        return drift

    def check_output_dir(self) -> None:
        """Refuse (every rank) an output dir holding a run of another model (:func:`.run_dir.check_output_dir`;
        ``loom train`` checked it before launching, this covers ``--no-launch`` and elastic restarts).

        Raises:
            ConfigError: rank 0's refusal, on every rank."""
        from .run_dir import check_output_dir

        refusal = [None]
        if self.rank == 0:
            try:
                check_output_dir(self.cfg)
            except ConfigError as e:
                refusal = [str(e)]
        dist.broadcast_object_list(refusal, src=0)
        if refusal[0] is not None:
            raise ConfigError(refusal[0])

    def lock_output_dir(self) -> list:
        """Hold the output dir's lock for this process's life (collective; :mod:`.run_lock`): under ``loom
        train``'s launcher, which claimed the dir, every rank holds the workers' lock; without it (``--no-launch``,
        ``python -m``, ``loom run``/torchrun) local rank 0 claims the dir first (single-node jobs; a multi-node
        job without ``loom train``'s launcher only holds the workers' lock), then every rank holds the workers'
        lock. Returns the locks (keep them: dropping them releases).

        Raises:
            OutputDirBusy: (a ConfigError) another run trains in the output dir, on every rank."""
        from torchloom.elastic.launcher import AGENT_PID_ENV

        from .run_lock import CLAIMED_ENV, OutputDirBusy, claim, hold_worker

        env = os.environ
        if env.get(CLAIMED_ENV) == str(self.out) and env.get(AGENT_PID_ENV) == str(os.getppid()):
            return [hold_worker(self.out, self.rank)]  # elastic restarts come here too: their launcher holds it
        local_rank = int(env.get("LOCAL_RANK", "0"))
        single_node = int(env.get("LOCAL_WORLD_SIZE", str(self.world))) == self.world
        held, refusal = [], None
        if local_rank == 0 and single_node:
            try:
                held.append(claim(self.out, role="run"))
            except ConfigError as e:
                refusal = str(e)
        refusals = [None] * self.world
        dist.all_gather_object(refusals, refusal)  # also orders: the claim's probe before any rank holds
        refusal = next((r for r in refusals if r is not None), None)
        if refusal is not None:
            raise OutputDirBusy(refusal)
        return held + [hold_worker(self.out, self.rank)]

    def write_config(self) -> None:
        """Write ``config.yaml`` (rank 0), atomically, once this run trains from a valid state: a run that trains
        nothing (already finished) or cannot resume leaves the previous one, which describes the trained steps."""
        if self.rank != 0:
            return
        import yaml

        tmp = self.out / f".config.yaml.{os.getpid()}.tmp"
        tmp.write_text(yaml.safe_dump(self.cfg.to_dict(), sort_keys=False))
        os.replace(tmp, self.out / "config.yaml")

    # -- strategy: auto ------------------------------------------------------------------------------
    def plan_strategy(self, cfg: TrainConfig, make_model, signature: str | None = None):
        """``(strategy, search)`` for ``auto_accelerate``: the configured strategy and None; with ``strategy:
        auto`` the plan file an earlier run of this output dir wrote (``strategy.json``: a resumed or repeated
        run reuses it without searching, so the checkpoints match the strategy; ``auto_accelerate`` refuses it
        for another model, world size, global batch or machine, naming the difference) and None, else
        ``"auto"`` and the search options (the job's model factory for the confirming trials; zero1
        excluded unless included: the job's optimizer has two parameter groups, which zero1 does not take).

        ``signature``: the model's :func:`~torchloom.search.auto.model_signature`, checked against the saved plan
        (with the world size, global batch and machine) before ``auto_accelerate`` would refuse it.

        Raises:
            ConfigError: ``strategy: auto`` with checkpoints in the output dir but no saved plan (a new search
                could choose a strategy the checkpoints were not written with); a saved plan made for another
                world size, global batch, model or machine (each difference named, with what to do) unless
                ``search.on_mismatch: research``, which searches again (checkpoints reshard on resume).
        """
        from torchloom import checkpoint
        from torchloom.strategy.strategy import Strategy

        if not cfg.is_auto:
            return Strategy.parse(cfg.full_strategy()), None
        plan = self.out / SEARCHED_STRATEGY
        seen = [(plan.exists(), checkpoint.latest_complete(self.ckpt_root)) if self.rank == 0 else None]
        if self.rank == 0 and seen[0][0]:
            seen[0] += (self._saved_plan_differences(plan, cfg, signature),)
        dist.broadcast_object_list(seen, src=0)  # rank 0 decides: every rank searches, or none does
        has_plan, latest, *diffs = seen[0]
        diffs = diffs[0] if diffs else []
        if has_plan and diffs and cfg.search.get("on_mismatch") != "research":
            raise ConfigError(self._plan_mismatch_advice(plan, diffs, latest))
        if has_plan and diffs:
            self.log(f"strategy: auto: {plan} does not match this run ({'; '.join(diffs)}): searching again "
                     "(search.on_mismatch: research" + ("; the checkpoints reshard on resume)" if latest else ")"))
        elif has_plan:
            self.log(f"strategy: auto -> {plan} (searched by an earlier run of this output dir; no new search; "
                     "delete it to search again)")
            return str(plan), None
        if latest is not None and not has_plan:
            raise ConfigError(f"strategy: auto with checkpoints in {self.ckpt_root} but no searched plan "
                              f"({plan}): a new search could choose another strategy than the checkpoints were "
                              "written with. Pass the strategy they were trained with (--set strategy=[...]) or "
                              "use a new output dir.")
        search = cfg.search_options()
        if "zero1" not in (search.get("include") or ()):
            search["exclude"] = sorted({*(search.get("exclude") or ()), "zero1"})
        self.log(f"strategy: auto -> searching (options {search}; trials train fresh build_model() copies)")
        search["model_factory"] = make_model
        self._search_log = _LogToJob(self)
        logger = logging.getLogger("torchloom.search")
        logger.addHandler(self._search_log)
        logger.setLevel(logging.INFO)
        return "auto", search

    def _saved_plan_differences(self, plan: Path, cfg: TrainConfig, signature: str | None) -> list[str]:
        """What differs between the saved plan and this run (rank 0; the checks ``auto_accelerate`` makes)."""
        from torchloom.errors import StrategyError
        from torchloom.search.auto import machine_fingerprint
        from torchloom.search.plan_file import read_plan

        try:
            _, saved = read_plan(plan)
        except StrategyError as e:
            return [f"the file does not read as a plan ({e})"]
        if saved is None:
            return ["the file has no 'plan' section (not written by strategy: auto)"]
        return saved.differences(model=signature, world_size=self.world, global_batch=cfg.train.global_batch,
                                 machine=machine_fingerprint())

    def _plan_mismatch_advice(self, plan: Path, diffs: list[str], latest) -> str:
        """The refusal of a saved plan made for another run: the differences and what is safe to do."""
        world = next((d for d in diffs if d.startswith("world size")), None)
        fixes = []
        if world is not None:
            fixes.append("rerun with the same --nproc as the run that searched (" + world.split(": ", 1)[1] + ")")
        fixes.append("use another --output-dir (a fresh search there)")
        if latest is not None:
            fixes.append(f"or --set search.on_mismatch=research to search again here: the checkpoints in "
                         f"{self.ckpt_root} are resumed under the new plan (a resume under another strategy or "
                         "world size reshards them, docs/reshard.md; the global batch must stay the same)")
        else:
            fixes.append(f"or --set search.on_mismatch=research (or delete {plan}) to search again here")
        return (f"strategy: auto: the plan saved in {plan} was made for another run: {'; '.join(diffs)}. "
                + "; ".join(fixes) + ".")

    def save_searched(self, res, signature: str, search: dict) -> None:
        """Print the strategy the search chose and save it as a plan file (``strategy.json`` in the output dir:
        the strategy, its batch split, the predictions and trials; a rerun reuses it) on rank 0."""
        from torchloom.search.auto import machine_fingerprint
        from torchloom.search.options import SearchOptions
        from torchloom.search.plan_file import save_plan

        logging.getLogger("torchloom.search").removeHandler(self._search_log)
        chosen = res.search.chosen
        self.log(f"strategy: auto chose {chosen.label()} ({res.search.chosen_by}): "
                 f"{res.strategy.to_list(explicit_only=True)}")
        machine = machine_fingerprint()
        if self.rank != 0:
            return
        path = save_plan(self.out / SEARCHED_STRATEGY, res.search,
                         model={"signature": signature, "name": type(res.model).__name__}, machine=machine,
                         options=SearchOptions.parse(search).cache_dict())
        self.log(f"  saved to {path} (a rerun of this output dir reuses it)")

    # -- evaluation -----------------------------------------------------------------------------------
    def evaluate(self) -> float:
        """Mean held-out loss per predicted token over exactly the chosen held-out windows (all of them, or with
        ``eval.batches`` a fixed, evenly spaced subset of ``batches x batch_size``; the same windows for any
        number of ranks), each counted once; same value on every rank. Data-parallel ranks split the windows
        with :func:`torchloom.data.eval_loader` (tensor/pipeline peers evaluate the same ones and the sums are
        reduced over the data-parallel group only). Collective: every rank runs the same number of forwards,
        as DDP/FSDP/TP/PP require; rows that only keep the shapes valid (a rank with no window left in the
        last step, pipeline micro-batch padding) get labels -100, so they add no token to the sums."""
        from torch.utils.data import Subset

        from torchloom.data import eval_loader
        from torchloom.parallel.pipeline.model import PipelinedModel

        cfg, res = self.cfg.eval, self.res
        dp = res.mesh.dp_size
        # a pipelined forward splits every batch into the schedule's micro-batches: pad each to a multiple of them
        micro = res.model.pipeline.num_microbatches if isinstance(res.model, PipelinedModel) else 1
        n = len(self.eval_ds)
        data = self.eval_ds
        if cfg.batches is not None and cfg.batches * cfg.batch_size < n:
            data = Subset(self.eval_ds, torch.linspace(0, n - 1, cfg.batches * cfg.batch_size).round().long().tolist())
        share = -(-cfg.batch_size // dp)  # this rank's share of one eval batch, in whole pipeline micro-batches
        loader = eval_loader(data, -(-share // micro) * micro, mesh=res.mesh, pad_to_multiple_of=micro)
        was_training = res.model.training
        held = self.expert_load.counts().clone() if self.expert_load is not None else None
        res.model.eval()
        total, count = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
        with torch.no_grad():
            for batch in loader:
                batch["labels"] = batch["labels"].masked_fill(~loader.valid_mask()[:, None], -100)
                tokens = (batch["labels"][:, 1:] != -100).sum()
                total += res.forward_loss(batch).double().cpu() * tokens  # the mean per token times its tokens
                count += tokens
        res.model.train(was_training)
        if held is not None:  # the expert counts are of training tokens: drop the held-out forwards
            self.expert_load.reset()
            self._expert_held = self._expert_held + held.to(torch.int64).cpu()
        return float(loader.reduce_metrics(total, count))

    # -- checkpoints ----------------------------------------------------------------------------------
    def save(self, step: int, persist: bool = True) -> bool:
        """Checkpoint ``step`` (collective): a blocking save, or with ``checkpoint.blocking: false`` a flash save
        (``persist=False``: an in-memory snapshot only). Returns False when a flash save was skipped (the saver
        busy, ``checkpoint.on_busy: skip``), else True."""
        from torchloom import checkpoint

        res = self.res
        t = time.perf_counter()
        if self.flash is not None:  # checkpoint.blocking: false -> flash checkpoint (background write)
            done = self.flash.save(step, persist=persist, extra={
                "tokens_seen": self.tokens_seen, "train_time_s": self.train_time,
                "initial_eval_loss": self.initial_eval_loss, "last_eval_loss": self.last_eval_loss})
            stall = time.perf_counter() - t
            self.goodput.event("save", attempt=self.attempt, step=step, stall_s=stall)
            what = "flash checkpoint" if persist else "in-memory snapshot"
            self.log(f"{what} step {step}: training blocked {stall:.2f} s"
                     + ("" if done else f" (skipped: the saver is busy, on_busy={self.cfg.checkpoint.on_busy})"))
            return bool(done)
        path = checkpoint.save(
            self.ckpt_root, step=step, model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler,
            dataloader=res.dataloader, train_step=res.train_step, keep_last=self.cfg.checkpoint.keep_last,
            extra={"tokens_seen": self.tokens_seen, "train_time_s": self.train_time,
                   "initial_eval_loss": self.initial_eval_loss, "last_eval_loss": self.last_eval_loss},
            trainable_only=self.cfg.checkpoint.trainable_only,
        )
        stall = time.perf_counter() - t
        self.goodput.event("save", attempt=self.attempt, step=step, stall_s=stall)
        self.log(f"checkpoint step {step} -> {path} ({stall:.1f} s)")
        return True

    def save_now(self, step: int) -> None:
        """Checkpoint ``step`` for sure (the end of a run, a requested stop): a flash save first waits for the
        one in flight instead of being skipped (``on_busy: skip``), and is committed by ``finalize``."""
        if self.flash is not None:
            self.flash.wait()
        self.save(step)

    def maybe_resume(self) -> int:
        """Load the newest usable checkpoint of the output dir (collective) and return its step (0: none).

        Raises:
            ResumeError: a checkpoint could not be loaded into this run (the reason, the checkpoint root, and
                what to do)."""
        from torchloom.data import DataError
        from torchloom.errors import CheckpointError

        try:
            return self._resume()
        except (CheckpointError, DataError) as e:
            cause, data = e, isinstance(e, DataError) or "DataError: " in str(e)  # the ranks' errors are forwarded
            while cause is not None and not data:
                data, cause = isinstance(cause, DataError), cause.__cause__
            if data:  # the saved data position does not fit this run's batch layout (or seed)
                raise ResumeError(
                    f"cannot resume the data position of the checkpoints in {self.ckpt_root}: {e}\nIn loom train the "
                    "micro batch is train.micro_batch (--set train.micro_batch=N), or keep the train.global_batch "
                    "and --nproc of the run that saved them; train.seed must stay the run's. Nothing was trained; "
                    f"to start over in {self.out}, delete {self.ckpt_root}.") from e
            raise ResumeError(
                f"cannot resume from the checkpoints in {self.ckpt_root}: {e}\nThey were written by an earlier run "
                f"of output dir {self.out}; this run cannot load them. `loom ckpt verify {self.out}` checks them. "
                "If they hold another model or training state, train this config in another --output-dir; to "
                f"start over in this one, delete {self.ckpt_root} (its checkpoints are lost).") from e

    def _resume(self) -> int:
        from torchloom import checkpoint

        res = self.res
        if self.flash is not None:  # the newest in-memory snapshot all ranks hold, else the newest on disk
            info = self.flash.load()
            if info is None:
                return 0
        else:
            latest = [checkpoint.latest_complete(self.ckpt_root) if self.rank == 0 else None]
            dist.broadcast_object_list(latest, src=0)
            if latest[0] is None:
                if self.rank == 0:
                    from torchloom.checkpoint import commit

                    torn = [p.name for _, p in commit.list_checkpoints(self.ckpt_root)]
                    if torn:
                        self.log(f"warning: no complete checkpoint in {self.ckpt_root} (incomplete: {torn}); "
                                 "starting from step 0")
                return 0
            # the root, not latest[0]: a complete checkpoint with a corrupt trainer state/DCP metadata is skipped
            info = checkpoint.load(self.ckpt_root, model=res.model, optimizer=res.optimizer,
                                   lr_scheduler=res.lr_scheduler, dataloader=res.dataloader,
                                   train_step=res.train_step)
        step = int(info["step"])
        extra = info.get("extra") or {}
        self.tokens_seen = int(extra.get("tokens_seen", step * self.tokens_per_step))
        self.train_time = float(extra.get("train_time_s", 0.0))
        self.initial_eval_loss = extra.get("initial_eval_loss")
        self.last_eval_loss = extra.get("last_eval_loss")
        self.log(f"resumed from step {step} ({info['path']})")
        return step

    # -- the loop -------------------------------------------------------------------------------------
    def train(self) -> dict[str, Any]:
        from .metrics import MetricsWriter, MfuMeter
        from .progress import Progress

        cfg, res = self.cfg, self.res
        self.tokens_seen, self.train_time = 0, 0.0
        self.initial_eval_loss = self.last_eval_loss = None
        self.watchdog = None
        if cfg.watchdog.timeout_s:
            from torchloom.elastic.watchdog import Watchdog

            self.watchdog = Watchdog(cfg.watchdog.timeout_s, cfg.watchdog.first_step_timeout_s,
                                     dump_dir=self.out / "watchdog", rank=self.rank).start()
        self.flash = None
        if not cfg.checkpoint.blocking:
            from torchloom.checkpoint.flash import FlashCheckpointer

            self.flash = FlashCheckpointer(
                self.ckpt_root, model=res.model, optimizer=res.optimizer, lr_scheduler=res.lr_scheduler,
                dataloader=res.dataloader, train_step=res.train_step, keep_last=cfg.checkpoint.keep_last,
                on_busy=cfg.checkpoint.on_busy, trainable_only=cfg.checkpoint.trainable_only)
        start = self.maybe_resume()
        total = cfg.train.steps
        agreed = [start] * self.world
        dist.all_gather_object(agreed, start)
        if len(set(agreed)) != 1:
            raise RuntimeError(f"ranks resumed from different steps {agreed}: the checkpoint directory "
                               f"{self.ckpt_root} must be one shared path that every rank sees")
        stop_at = total if self.max_steps_this_run is None else min(total, start + self.max_steps_this_run)
        if start < stop_at:
            self.write_config()
        if self.rank == 0:
            from .goodput import lost_work, process_start_time

            lost = lost_work(self.out / "metrics.jsonl", start, cfg.log.interval) if start or self.attempt \
                else {"steps": 0, "time_s": 0.0, "last_t": None}
            self.goodput.event("start", attempt=self.attempt, t_process=process_start_time(), resumed_step=start,
                               train_time_s=self.train_time, lost_steps=lost["steps"], lost_time_s=lost["time_s"],
                               last_t=lost["last_t"])
        writer = MetricsWriter(self.out / "metrics.jsonl", enabled=self.rank == 0)
        if self.rank == 0:
            if start == 0:
                writer.truncate_after(-1)  # a fresh start: drop records of an earlier, unfinished run
            else:
                dropped = writer.truncate_after(start)
                if dropped:
                    self.log(f"dropped {dropped} metrics records after step {start} (redone now)")
        if start >= total:
            self.log(f"already trained {start}/{total} steps")
        if start == 0:
            t = time.perf_counter()
            self.initial_eval_loss = self.last_eval_loss = self.evaluate()
            writer.write({"type": "eval", "step": 0, "eval_loss": self.initial_eval_loss})
            self.log(f"step 0: held-out loss {self.initial_eval_loss:.4f} ({time.perf_counter() - t:.1f} s)")

        ts = res.train_step
        accum = res.grad_accum_steps
        self.mfu = MfuMeter(self.peak, step=start)  # MFU never above 1; flagged when the peak is unreliable
        step, micro, loss_acc, aux_acc = start, 0, 0.0, 0.0
        run_expert_tokens = None  # [layers, E] summed over the data-parallel ranks and this run's steps
        run_tokens, run_time, peaks = 0, 0.0, [0] * self.world
        last_saved = start
        self.pbar = Progress(total, start, enabled=self.rank == 0 and cfg.log.progress,
                             every=cfg.log.progress_every, stream=sys.stderr)  # a bar only on a terminal
        self.mem.reset()
        if cfg.log.sample_ids:
            self.train_ds.take()  # drop fetches made during set-up
        t_prev = time.perf_counter()
        lr = res.optimizer.param_groups[0]["lr"]
        try:
            while step < stop_at:
                for batch in res.dataloader:
                    loss = ts(batch)
                    if self.expert_load is not None:  # report the cross-entropy; the aux loss on its own
                        ce, aux = self.loss_func.take()[0]  # the first call: this micro-batch's (WSAM replays)
                        loss_acc += ce
                        aux_acc += aux
                    else:
                        loss_acc += float(loss)
                    micro += 1
                    if micro < accum:
                        continue
                    micro = 0
                    step += 1
                    dt = time.perf_counter() - t_prev
                    self.faults.after_step(step)
                    if step == start + 1:
                        self.goodput.event("first_step", attempt=self.attempt, step=step)
                    self.tokens_seen += self.tokens_per_step
                    if step % cfg.log.interval == 0 or step == stop_at:
                        stats = torch.tensor([loss_acc / accum, float(self.mem.read()), dt, aux_acc / accum],
                                             dtype=torch.float64)
                        gathered = [torch.zeros_like(stats) for _ in range(self.world)]
                        dist.all_gather(gathered, stats)
                        g = torch.stack(gathered)
                        dt = float(g[:, 2].max())  # the step ends when the slowest rank ends it
                        self.drift.observe(dt)
                        step_peaks = [int(v) for v in g[:, 1].tolist()]
                        peaks = [max(a, b) for a, b in zip(peaks, step_peaks)]
                        tok_s = self.tokens_per_step / dt
                        mfu = self.mfu.record(self.flops_per_token * tok_s / self.world)
                        if self.mfu.note:
                            self.log(self.mfu.take_note())
                        # train_step returns the dp-global token mean, equal on every rank: taken as is (no
                        # second average); the MoE path's cross-entropy (loss_func.take()) is per rank
                        step_loss = float(g[:, 0].mean()) if self.expert_load is not None else float(g[0, 0])
                        rec = {
                            "type": "train", "step": step, "loss": step_loss, "lr": lr,
                            "grad_norm": float(ts.last_grad_norm) if ts.last_grad_norm is not None else None,
                            "tokens": self.tokens_per_step, "tokens_seen": self.tokens_seen,
                            "tokens_per_s": tok_s, "step_time_s": dt,
                            "peak_mem_bytes": step_peaks, "peak_mem_source": self.mem.source,
                            **mfu, "flops_per_token": self.flops_per_token,  # mfu: the peak it divides by too
                            "world_size": self.world, "skipped": bool(ts.last_step_skipped),
                            "t": time.time(), "attempt": self.attempt, **self.drift.record(),
                        }
                        if self.expert_load is not None:
                            moe_rec = self._expert_record(float(g[:, 3].mean()))
                            rec.update(moe_rec)
                            counts = torch.tensor(moe_rec["expert_tokens"], dtype=torch.int64)
                            run_expert_tokens = counts if run_expert_tokens is None else run_expert_tokens + counts
                        if cfg.log.sample_ids:
                            ids = [None] * self.world
                            dist.all_gather_object(ids, self.train_ds.take())
                            rec["sample_ids"] = ids
                        writer.write(rec)
                        self.pbar.set_postfix(loss=f"{rec['loss']:.3f}", tok_s=f"{tok_s:,.0f}", refresh=False)
                    else:
                        self.drift.observe(dt)  # this rank's time (a record's step: the slowest rank's)
                    run_tokens += self.tokens_per_step
                    run_time += dt
                    self.train_time += dt
                    loss_acc = aux_acc = 0.0
                    self.pbar.update(1)
                    paused = False  # evaluation or checkpoint: the step clock stops, the peak is measured again
                    if cfg.eval.interval and step % cfg.eval.interval == 0 and step < total:
                        self.last_eval_loss = self.evaluate()
                        writer.write({"type": "eval", "step": step, "eval_loss": self.last_eval_loss})
                        self.log(f"step {step}: held-out loss {self.last_eval_loss:.4f}")
                        paused = True
                    if cfg.checkpoint.interval and step % cfg.checkpoint.interval == 0 and step < total:
                        if self.save(step):
                            last_saved = step
                        paused = True
                    elif (self.flash is not None and cfg.checkpoint.memory_interval
                          and step % cfg.checkpoint.memory_interval == 0 and step < total):
                        self.save(step, persist=False)
                    if paused and self.peak.measured:
                        self.remeasure_peak(step)
                    if self.watchdog is not None:
                        self.watchdog.beat(step)
                    if step >= stop_at:
                        break
                    self.mem.reset()
                    lr = res.optimizer.param_groups[0]["lr"]
                    t_prev = time.perf_counter()
        finally:
            if self.watchdog is not None:
                self.watchdog.stop()  # the final evaluation, save and export are not steps
            self.pbar.close()
            self.pbar = None
        run = {"start_step": start, "end_step": step, "tokens": run_tokens, "time_s": run_time,
               "tokens_per_s": run_tokens / run_time if run_time else None,
               **self.mfu.summary(), "peak_mem_bytes": peaks, "writer": writer,
               "last_saved": last_saved, "expert_tokens": run_expert_tokens}
        return run

    def remeasure_peak(self, step: int) -> None:
        """Measure the peak FLOP/s again (collective, ~0.1 s, outside the step timing) and keep it when higher:
        a peak read low at job start (the machine busy then) is raised, so MFU is not inflated for the whole run."""
        from .metrics import REMEASURE_S, job_peak_flops

        self.mfu.offer(job_peak_flops(self.device, self.res.compute_dtype, seconds=REMEASURE_S), step)
        if self.mfu.note:
            self.log(self.mfu.take_note())

    def _expert_record(self, aux_loss: float) -> dict[str, Any]:
        """The MoE fields of a train record (collective over the data-parallel ranks): the mean aux loss of the
        step's micro-batches over the ranks, and the tokens routed to each expert (``[layers][E]``, counted
        before any capacity dropping, summed over the data-parallel ranks and the steps since the previous
        record: each token counts ``top_k`` times), with the smallest and largest share of a layer's
        assignments any expert got (1 / num_experts when balanced). Resets the counts."""
        from .metrics import expert_shares

        counts = self.expert_load.counts().to(torch.int64).cpu() + self._expert_held
        self.expert_load.reset()
        self._expert_held = torch.zeros_like(counts)
        if self.res.mesh.dp_size > 1:  # tensor-parallel peers route the same tokens: sum over dp only
            dist.all_reduce(counts, group=self.res.mesh.group("dp"))
        lo, hi = expert_shares(counts)
        return {"aux_loss": aux_loss, "aux_loss_weight": self.cfg.model.moe.aux_loss_weight,
                "expert_tokens": counts.tolist(), "expert_share_min": lo, "expert_share_max": hi}

    # -- the end --------------------------------------------------------------------------------------
    def export(self) -> Path:
        """The final model in Hugging Face format in the output dir (collective; rank 0 writes):
        ``config.json``, ``generation_config.json``, safetensors weights and the tokenizer
        (``tokenizer.json`` + ``tokenizer_config.json``), loadable with ``from_pretrained(output_dir)``.
        Returns the weights file (the index when sharded)."""
        from transformers import PreTrainedTokenizerFast

        from torchloom.hf import save_pretrained

        from .corpus import EOS

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(self.corpus.tokenizer_path), eos_token=EOS)
        save_pretrained(self.res.model, self.out, tokenizer=tokenizer)
        index = self.out / "model.safetensors.index.json"
        return index if index.exists() else self.out / "model.safetensors"

    def stop_early(self, run: dict[str, Any]) -> None:
        """The end of a run stopped by ``--max-steps-this-run`` before ``train.steps`` (collective): checkpoint
        the step reached (unless ``checkpoint.save_on_stop`` is false, or its interval save did already) and log
        the step a re-run resumes from, read back from the checkpoint directory (none: step 0).

        Raises:
            CheckpointError: the save failed, naming the steps that are not saved."""
        from torchloom.checkpoint import commit
        from torchloom.errors import CheckpointError

        cfg, step, total = self.cfg, run["end_step"], self.cfg.train.steps
        stopped = f"stopped after step {step} of {total} (--max-steps-this-run)"
        try:
            if cfg.checkpoint.save_on_stop and run["last_saved"] < step:
                self.save_now(step)
            if self.flash is not None:
                self.flash.finalize(unlink=False)  # commit the save in flight; keep the snapshots for a resume
        except CheckpointError as e:
            raise CheckpointError(f"{stopped}, but saving its checkpoint failed: {e}. The steps after the newest "
                                  f"complete checkpoint in {self.ckpt_root} are not saved (`loom ckpt list "
                                  f"{self.out}` shows it; none: a re-run starts from step 0).") from e
        if self.rank != 0:
            return
        latest = commit.latest_complete(self.ckpt_root)
        saved = commit.parse_step(latest) if latest is not None else 0
        if saved == step:
            self.log(f"{stopped}: checkpoint step {step} saved ({latest}); re-run the same command (same output "
                     f"dir) to resume from step {step}")
            return
        why = "checkpoint.save_on_stop: false" if not cfg.checkpoint.save_on_stop else "its save did not happen"
        where = f"the newest checkpoint, step {saved} ({latest})" if latest is not None else \
            "step 0: no checkpoint was saved"
        memory = (" (or from a newer in-memory snapshot, while this machine holds it)"
                  if self.flash is not None and cfg.checkpoint.memory_interval else "")
        self.log(f"{stopped} without saving it ({why}): steps {saved + 1}-{step} are lost; a re-run of the same "
                 f"command resumes from {where}{memory} and trains them again")

    def finish(self, run: dict[str, Any]) -> dict[str, Any] | None:
        cfg, writer = self.cfg, run.pop("writer")
        step, total = run["end_step"], cfg.train.steps
        if step < total:
            writer.close()
            self.stop_early(run)
            return None
        final = self.evaluate()
        if step > run["start_step"]:  # a re-run of a finished job trains nothing and logs nothing new
            writer.write({"type": "eval", "step": step, "eval_loss": final})
        writer.close()
        self.last_eval_loss = final
        if run["last_saved"] < step or not (self.ckpt_root / f"step_{step:08d}").exists():
            self.save_now(step)
        if self.flash is not None:
            self.flash.finalize()  # the final checkpoint is committed before the job ends
        weights = self.export()
        sample = None
        if self.rank == 0 and cfg.sample.max_new_tokens:
            sample = generate_sample(self.out, cfg.sample)
        summary = {
            "initial_eval_loss": self.initial_eval_loss, "final_eval_loss": final, "steps": step,
            "resumed_from": run["start_step"] or None, "wall_time_s": time.perf_counter() - self.t_start,
            "train_time_s": self.train_time, "this_run": {k: run[k] for k in ("start_step", "tokens", "time_s")},
            "tokens_seen": self.tokens_seen, "tokens_per_s": run["tokens_per_s"], "mfu": run["mfu"],
            "mfu_unreliable": run["mfu_unreliable"], "mfu_unreliable_reason": run["mfu_unreliable_reason"],
            "peak_mem_bytes": run["peak_mem_bytes"], "peak_flops": run["mfu_peak"]["flops"],
            "peak_flops_source": run["mfu_peak"]["source"], "mfu_peak": run["mfu_peak"],
            "world_size": self.world, "strategy": self.strategy_used,
            "params": self.n_params, "tokens_per_step": self.tokens_per_step, "sample": sample,
            "weights": str(weights), "checkpoints": str(self.ckpt_root),
            "restarts": self.attempt, "prediction": self.drift.summary(),
        }
        if self.cfg.model.is_moe:
            from .metrics import expert_shares

            counts = run.get("expert_tokens")
            mc = self.cfg.model.moe
            summary["moe"] = {
                "num_experts": mc.num_experts, "top_k": mc.top_k, "aux_loss_weight": mc.aux_loss_weight,
                "ep": self.res.mesh.dims.ep, "active_params": self.n_active,
                "expert_tokens": None if counts is None else counts.tolist(),
                "expert_share_min_max": None if counts is None else list(expert_shares(counts)),
            }
        if self.rank == 0:
            from .goodput import summarize

            summary["goodput"] = summarize(self.goodput.read(), time.time(), self.train_time)
        trained = step > run["start_step"]
        if self.rank == 0 and not trained and (self.out / "summary.json").exists():
            # a re-run of a finished job: keep the measured numbers of the run that trained
            # (its losses too: this evaluation may use other eval settings than its initial one did)
            previous = json.loads((self.out / "summary.json").read_text())
            summary = {**previous, "sample": sample if sample is not None else previous.get("sample")}
        if self.rank == 0:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
            if trained:
                init = f"{self.initial_eval_loss:.4f}" if self.initial_eval_loss is not None else "?"
                tps = f"{run['tokens_per_s']:,.0f}" if run["tokens_per_s"] else "?"
                self.log(f"done: {step} steps; held-out loss {init} -> {final:.4f}; {tps} tokens/s; "
                         f"wall {summary['wall_time_s']:.1f} s; peak memory per rank "
                         f"{[round(b / 2**20) for b in run['peak_mem_bytes']]} MiB")
            else:
                self.log(f"done: all {step} steps were trained before, nothing trained now; held-out loss "
                         f"{final:.4f} with this run's eval settings (summary.json keeps the numbers of the run "
                         "that trained)")
            self.log(f"weights {weights}; summary {self.out / 'summary.json'}")
            if sample is not None:
                self.log("sample:\n" + sample)
        dist.barrier()
        return summary


def generate_sample(out: Path, sc) -> str:
    """Generate from the exported model (``from_pretrained(out)``: Llama, or Mixtral for model.moe) in a plain
    model on this process (no collectives)."""
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from torchloom.hf.save import no_progress_bars

    with no_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(out, use_cache=True)
    model.eval()
    config = model.config
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    ids = torch.tensor([tok.encode(sc.prompt).ids or [config.eos_token_id]])
    torch.manual_seed(sc.seed)
    with torch.no_grad():
        gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=sc.top_k or None,
                             temperature=sc.temperature, max_new_tokens=sc.max_new_tokens,
                             pad_token_id=config.eos_token_id)
    return tok.decode(gen[0].tolist())


def run(cfg: TrainConfig, max_steps_this_run: int | None = None) -> dict[str, Any] | None:
    """Train with ``cfg`` on this process (joins the launcher's process group, if any). Returns the summary
    on a finished run, None when stopped by ``max_steps_this_run``."""
    if max_steps_this_run is not None and max_steps_this_run < 1:
        raise ConfigError(f"--max-steps-this-run must be >= 1, got {max_steps_this_run}")
    job = Job(cfg, max_steps_this_run)
    try:
        job.setup()
        return job.finish(job.train())
    finally:
        for lock in getattr(job, "dir_lock", None) or ():  # the run is over (or failed): the next one may start
            lock.release()


# -------------------------------------------------------------------------------------- entry
def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m torchloom.train.job",
                                description="The torchloom reference training job (one process; see `loom train`).")
    p.add_argument("config", nargs="?", default=None, help="YAML config file or packaged name (default: default)")
    p.add_argument("--output-dir", default=None, help="overrides output_dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config value, e.g. train.steps=100 (repeatable)")
    p.add_argument("--max-steps-this-run", type=int, default=None, metavar="K",
                   help="stop after K optimizer steps and save a checkpoint (re-run to resume; "
                        "checkpoint.save_on_stop=false stops like a crash)")
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv``, run the job, and leave through ``clean_exit`` with :func:`run_job`'s code (never returns)."""
    from torchloom.elastic.shutdown import clean_exit

    clean_exit(run_job(argv))


def run_job(argv: list[str] | None = None) -> int:
    """Parse ``argv``, run the job and return its exit code: 0 done or stopped by request, 2 invalid config (the
    message on rank 0's stderr), 1 a checkpoint error (the message on each failing rank's stderr, no
    traceback) or any other failure (with its traceback), 130 interrupted."""
    from torchloom.elastic.launcher import die_with_agent

    die_with_agent()  # a worker of loom's launcher stops when the launcher dies (SIGKILL included)
    args = parser().parse_args(argv)
    code = 0
    try:
        cfg = TrainConfig.load(args.config if args.config is not None else "default", args.overrides,
                               args.output_dir)
        run(cfg, args.max_steps_this_run)
    except ConfigError as e:
        rank = os.environ.get("RANK", "0")
        if rank == "0":
            print(f"{_PREFIX} error: {e}", file=sys.stderr, flush=True)
        code = 2
    except CheckpointError as e:  # a named problem with a named fix: no traceback (every failing rank says it)
        rank = os.environ.get("RANK", "0")
        print(f"{_PREFIX} error{'' if rank == '0' else f' (rank {rank})'}: {e}", file=sys.stderr, flush=True)
        code = 1
    except KeyboardInterrupt:
        code = 130
    except BaseException:  # noqa: BLE001 - any failure: traceback and a non-zero exit code
        print(f"{_PREFIX} rank {os.environ.get('RANK', '0')} failed:", file=sys.stderr)
        traceback.print_exc()
        code = 1
    return code


if __name__ == "__main__":
    main()
