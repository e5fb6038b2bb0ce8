"""The step shape the methods' ``estimate`` hooks read (:class:`StepShape`) and what the cost model predicts
for one candidate (:class:`Prediction`)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..search.candidate import Candidate

#: ``torch.compile`` backends that generate fused kernels (the others trace and run the same eager kernels)
FUSING_BACKENDS = ("inductor",)


@dataclass
class StepShape:
    """What every method's ``estimate`` hook may read about the step besides the mesh degrees.

    Attributes:
        micro_batch / grad_accum / seq_len: as in :class:`Candidate`.
        methods: canonical names of every method in the candidate (to see e.g. whether amp is on).
        configs: each method's config as a dict.
        compute_dtype: dtype name of the matmuls (``"bfloat16"`` under amp/half, else ``"float32"``).
        param_dtype: dtype name the parameters are stored in (``"bfloat16"`` under half).
        fp8: the blocks' weight GEMMs run in FP8 (the ``float8`` method); attention and the head stay in
            ``compute_dtype``.
        pipelined: the candidate has pipeline stages (``pp > 1``): the last stage's loss runs inside the
            schedule, which ``compile`` does not compile.

    The saved activations and transients follow from the step's kernels (:attr:`fused_blocks`,
    :attr:`fused_loss`, :attr:`fp8_saved_inputs`): one definition (:func:`torchloom.cost.effects.
    step_activations`, :func:`~torchloom.cost.effects.step_peak`) that the baseline and every method read, so
    the methods' memory rules compose on what the kernels really keep.
    """

    micro_batch: int
    grad_accum: int
    seq_len: int
    methods: list[str]
    configs: dict[str, dict[str, Any]]
    compute_dtype: str = "float32"
    param_dtype: str = "float32"
    fp8: bool = False
    pipelined: bool = False

    @property
    def block_gemm_dtype(self) -> str:
        """Dtype of the blocks' weight GEMMs: ``"float8"`` under the float8 method, else ``compute_dtype``."""
        return "float8" if self.fp8 else self.compute_dtype

    @property
    def fused_blocks(self) -> bool:
        """The blocks run compiled with a fusing backend (``compile``, Inductor): chain-internal
        intermediates are recomputed in backward, not saved (``PartInfo.act_bytes_fused``)."""
        c = self.configs.get("compile")
        return (c is not None and c.get("backend", "inductor") in FUSING_BACKENDS
                and "model" in c.get("components", ("model",)))

    @property
    def fused_loss(self) -> bool:
        """The loss runs compiled (``compile`` with ``"loss"`` in its components and a fusing backend): its
        cross-entropy is one fused kernel (``PartInfo.act_bytes_fused`` / ``peak_extra_fused`` of the rest)."""
        c = self.configs.get("compile")
        return bool(c is not None and "loss" in c.get("components", ("model",)) and not self.pipelined
                    and c.get("backend", "inductor") in FUSING_BACKENDS)

    @property
    def fp8_saved_inputs(self) -> bool:
        """The blocks' weight GEMMs keep their activation inputs in FP8 for backward (``float8`` with
        ``save_fp8_inputs``: Transformer Engine's behaviour; ``PartInfo.fp8_input_saving``)."""
        c = self.configs.get("float8", self.configs.get("fp8"))
        return bool(self.fp8 and c and c.get("save_fp8_inputs"))

    @property
    def fp8_gathered_weights(self) -> bool:
        """The blocks' Linear weights are all-gathered and held unsharded in FP8 (``float8`` with
        ``fsdp_float8_all_gather``: torchao's ``enable_fsdp_float8_all_gather``, Megatron's
        ``fp8_param_gather``): FSDP's gathered bytes and all-gather traffic for the block units are 1 byte
        per element."""
        c = self.configs.get("float8", self.configs.get("fp8"))
        return bool(self.fp8 and c and c.get("fsdp_float8_all_gather"))

    @property
    def residual_dtype(self) -> str:
        """Dtype of the hidden state between blocks (what pipeline stages send, what activation checkpointing
        keeps): the parameters' dtype under plain autocast (the residual adds run in fp32), the compute dtype
        when the parameters are cast for compute (``half``; fsdp's ``MixedPrecisionPolicy`` under amp)."""
        if "fsdp" in self.configs and self.compute_dtype != "float32":
            return self.compute_dtype
        return self.param_dtype

    @property
    def activation_key(self) -> str:
        """Which trace of ``PartInfo.act_bytes`` holds this step's activations: ``"bfloat16:params"`` when the
        parameters themselves are low precision during compute (fsdp's mixed precision, half: everything bf16),
        else the compute dtype (autocast on fp32 parameters: norms and the residual stream stay fp32)."""
        if self.compute_dtype != "float32" and self.residual_dtype == self.compute_dtype:
            return f"{self.compute_dtype}:params"
        return self.compute_dtype

    @classmethod
    def of(cls, cand: "Candidate", param_dtype: str = "float32") -> "StepShape":
        configs = {n: dict(c) for n, c in cand.methods}
        compute = param_dtype
        for n in ("amp", "half"):
            if n in configs:
                compute = _dtype_name(configs[n].get("dtype", "bfloat16"))
        fp8 = "float8" in configs or "fp8" in configs
        if fp8 and compute == param_dtype:  # float8 implies bf16 amp
            compute = "bfloat16"
        if "half" in configs:
            param_dtype = compute
        return cls(cand.micro_batch, cand.grad_accum, cand.seq_len, list(configs), configs, compute, param_dtype,
                   fp8, cand.dims.pp > 1)


#: spellings the amp/half ``dtype`` options accept -> canonical dtype names
DTYPE_SPELLINGS = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}


def _dtype_name(s: str) -> str:
    """Canonical dtype name of an amp/half ``dtype`` option."""
    return DTYPE_SPELLINGS.get(s, s)


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
        mfu: model FLOPs utilisation: model FLOPs per second per device / ``peak_flops``. Model FLOPs follow the
            PaLM/Megatron convention: ``6 N`` per token plus causal attention's unmasked half, no recomputation
            (:meth:`~torchloom.cost.model_info.ModelInfo.flops_per_sample`).
        hfu: hardware FLOPs utilisation: the FLOPs the kernels run (checkpointing's recomputation, flash
            attention's recomputed scores, the causal diagonal tiles) per second per device / ``peak_flops``.
        model_flops_per_token / hardware_flops_per_token: the two counts per token.
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
    hfu: float = 0.0
    model_flops_per_token: float = 0.0
    hardware_flops_per_token: float = 0.0

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
