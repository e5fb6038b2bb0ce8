"""One point of the search space (:class:`Candidate`), the step shape the methods' ``estimate`` hooks read
(:class:`StepShape`), and what the cost model predicts for a candidate (:class:`Prediction`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ..parallel.mesh import ParallelDims
from ..strategy.strategy import Strategy


@dataclass(frozen=True)
class Candidate:
    """A full plan: mesh degrees, the strategy's methods, and the batch split.

    Attributes:
        dims: resolved mesh degrees (product = world size).
        methods: strategy items without ``parallel_mode`` (``("fsdp", {"reshard_after_forward": True})``,
            ``("amp", {"dtype": "bfloat16"})``, ``("checkpoint", {"every_k": 2})``, ...), as a tuple of
            ``(name, config_dict)`` pairs (hashable via :meth:`key`).
        micro_batch: samples per rank per forward/backward.
        grad_accum: micro-batches per optimizer step per data-parallel rank (with pipeline parallel: the
            pipeline's micro-batch count; one optimizer step runs ``grad_accum`` micro-batches).
        seq_len: tokens per sample.
    """

    dims: ParallelDims
    methods: tuple[tuple[str, dict[str, Any]], ...]
    micro_batch: int
    grad_accum: int
    seq_len: int

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step over all data-parallel ranks."""
        return self.dims.dp * self.micro_batch * self.grad_accum

    @property
    def names(self) -> list[str]:
        return [n for n, _ in self.methods]

    def config(self, name: str) -> dict[str, Any] | None:
        return next((dict(c) for n, c in self.methods if n == name), None)

    def strategy(self) -> Strategy:
        """The :class:`Strategy` to apply: ``parallel_mode`` with every degree, then the methods."""
        degrees = {k: v for k, v in self.dims.as_dict().items() if k != "ep" or v > 1}
        return Strategy([("parallel_mode", degrees), *[(n, dict(c)) if c else n for n, c in self.methods]])

    def key(self) -> str:
        """A stable text key (sorting, de-duplication, plan files)."""
        import json

        return json.dumps({"dims": self.dims.as_dict(), "methods": [[n, c] for n, c in self.methods],
                           "micro_batch": self.micro_batch, "grad_accum": self.grad_accum}, sort_keys=True)

    def label(self) -> str:
        """A short human-readable name, e.g. ``dp2 tp2 | fsdp amp(bf16) ckpt/2 | mb4x2``."""
        d = self.dims
        mesh = " ".join(f"{k}{v}" for k, v in (("pp", d.pp), ("dpr", d.dp_replicate), ("dps", d.dp_shard),
                                               ("ep", d.ep), ("tp", d.tp)) if v > 1) or "1"
        parts = []
        for n, c in self.methods:
            if n == "fsdp":
                parts.append("zero2" if c.get("reshard_after_forward") is False else "zero3")
                if c.get("cpu_offload"):
                    parts.append("offload")
            elif n == "amp":
                parts.append(f"amp({c.get('dtype', 'bfloat16')})")
            elif n == "checkpoint":
                k = c.get("every_k", 1)
                parts.append("ac" if k == 1 else f"ac/{k}")
            elif n == "pipeline_parallel":
                parts.append(f"pp:{c.get('schedule', '1f1b')}")
            else:
                parts.append(n)
        return f"{mesh} | {' '.join(parts) or 'none'} | mb{self.micro_batch}x{self.grad_accum}"

    def to_dict(self) -> dict[str, Any]:
        return {"dims": self.dims.as_dict(), "methods": [[n, dict(c)] for n, c in self.methods],
                "micro_batch": self.micro_batch, "grad_accum": self.grad_accum, "seq_len": self.seq_len}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Candidate":
        return cls(ParallelDims(**d["dims"]), tuple((n, dict(c or {})) for n, c in d["methods"]),
                   int(d["micro_batch"]), int(d["grad_accum"]), int(d["seq_len"]))


@dataclass
class StepShape:
    """What every method's ``estimate`` hook may read about the step besides the mesh degrees.

    Attributes:
        micro_batch / grad_accum / seq_len: as in :class:`Candidate`.
        methods: canonical names of every method in the candidate (to see e.g. whether amp is on).
        configs: each method's config as a dict.
        compute_dtype: dtype name of the matmuls (``"bfloat16"`` under amp/half, else ``"float32"``).
        param_dtype: dtype name the parameters are stored in (``"bfloat16"`` under half).
    """

    micro_batch: int
    grad_accum: int
    seq_len: int
    methods: list[str]
    configs: dict[str, dict[str, Any]]
    compute_dtype: str = "float32"
    param_dtype: str = "float32"

    @classmethod
    def of(cls, cand: Candidate, param_dtype: str = "float32") -> "StepShape":
        configs = {n: dict(c) for n, c in cand.methods}
        compute = param_dtype
        for n in ("amp", "half"):
            if n in configs:
                compute = _dtype_name(configs[n].get("dtype", "bfloat16"))
        if "half" in configs:
            param_dtype = compute
        return cls(cand.micro_batch, cand.grad_accum, cand.seq_len, list(configs), configs, compute, param_dtype)


def _dtype_name(s: str) -> str:
    """Canonical dtype name of an amp/half ``dtype`` option (their own table of spellings)."""
    from ..methods.amp import DTYPES

    return str(DTYPES[s]).removeprefix("torch.") if s in DTYPES else s


@dataclass
class Prediction:
    """The cost model's answer for one candidate, per rank (the most loaded rank).

    Attributes:
        step_time_s: predicted seconds per optimizer step.
        time: the breakdown of ``step_time_s`` in seconds (``forward``, ``backward``, ``recompute``,
            ``optimizer``, ``comm_exposed:<label>``, ``bubble``, ...); the parts sum to ``step_time_s``.
        memory: predicted peak bytes per rank by category (``params``, ``grads``, ``optimizer``,
            ``activations``, ``temporary``, ``headroom``); they sum to ``peak_memory_bytes``.
        peak_memory_bytes: the sum of ``memory``.
        memory_limit_bytes: the device memory it is compared with.
        tokens_per_s: tokens per second over the whole job; ``tokens_per_s_per_device`` divides by world size.
        mfu: model FLOPs utilisation: model FLOPs per second per device (no recomputation) / ``peak_flops``.
        peak_flops: the per-device peak the MFU divides by (dtype of the matmuls), FLOP/s.
        collectives: each collective's per-step record (kind, bytes, group, calls, seconds, exposed seconds).
        notes: assumptions the estimate made.
    """

    step_time_s: float
    time: dict[str, float] = field(default_factory=dict)
    memory: dict[str, float] = field(default_factory=dict)
    peak_memory_bytes: float = 0.0
    memory_limit_bytes: float = 0.0
    tokens_per_s: float = 0.0
    tokens_per_s_per_device: float = 0.0
    mfu: float = 0.0
    peak_flops: float = 0.0
    collectives: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
