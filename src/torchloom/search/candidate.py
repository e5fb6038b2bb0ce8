"""One point of the search space (:class:`Candidate`). The step shape the methods' ``estimate`` hooks read
(:class:`~torchloom.cost.step.StepShape`) and what the cost model predicts (:class:`~torchloom.cost.step.Prediction`)
live in :mod:`torchloom.cost.step`; they are re-exported here."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..parallel.mesh import ParallelDims
from ..cost.step import Prediction, StepShape  # noqa: F401  (re-exported)
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
        degrees = {k: v for k, v in self.dims.as_dict().items() if k not in ("ep", "cp") or v > 1}
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
                                               ("ep", d.ep), ("cp", d.cp), ("tp", d.tp)) if v > 1) or "1"
        parts = []
        for n, c in self.methods:
            if n == "fsdp":
                zero = "zero2" if c.get("reshard_after_forward") is False else "zero3"
                # /rs: reduce-scatter every micro-batch, gradients kept sharded (accumulate_sharded); with one
                # micro-batch per step it changes nothing, so the label does not claim it
                sharded = c.get("accumulate_sharded") and self.grad_accum > 1
                parts.append(zero + ("/rs" if sharded else ""))
                if c.get("cpu_offload"):
                    parts.append("offload")
            elif n == "amp":
                parts.append(f"amp({c.get('dtype', 'bfloat16')})")
            elif n == "checkpoint":
                k = c.get("every_k", 1)
                parts.append("ac" if k == 1 else f"ac/{k}")
            elif n == "float8":
                parts.append("fp8" + ("/ag" if c.get("fsdp_float8_all_gather") else "")
                             + ("/te" if c.get("save_fp8_inputs") else ""))
            elif n == "compile":
                comps = list(c.get("components", ["model"]))
                parts.append("compile" if comps == ["model"] else f"compile({'+'.join(comps)})")
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
