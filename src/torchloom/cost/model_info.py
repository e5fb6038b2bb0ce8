"""What the planner knows about a model, measured without allocating it (meta device / fake tensors).

Filled by :func:`torchloom.cost.analysis.analyze_model`; read by the methods' ``validate``/``estimate``
hooks and the cost model. Every quantity is for **micro-batch 1** at ``seq_len`` tokens per sample unless a
field says otherwise: compute and activations scale linearly with the micro-batch size (the tokens
dimension ``m`` of every GEMM is ``micro_batch * seq_len``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass
class Matmul:
    """One GEMM kind of a pass: ``C[m, n] = A[m, k] @ B[k, n]``, ``count`` times; ``m`` is the token
    dimension at micro-batch 1 (multiply by the micro-batch). FLOPs = ``2 * m * n * k * count * share``.

    Attributes:
        attention: one of the products inside a fused attention kernel (SDPA: scores ``Q K^T``, ``P V`` and
            their gradients), priced at the accelerator's attention-kernel rate where it has one.
        share: the fraction of the product the kernel computes: a causal flash kernel skips the tiles above the
            diagonal (:func:`torchloom.cost.op_trace.causal_tile_share`); 1 for a dense product.
    """

    m: int
    n: int
    k: int
    count: int = 1
    attention: bool = False
    share: float = 1.0

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count * self.share


@dataclass
class PassCost:
    """Compute of one forward or one backward pass of one module instance at micro-batch 1.

    Attributes:
        matmul_flops: FLOPs the hardware runs in matrix products (``torch.utils.flop_counter``'s formulas under
            fake tensors), incl. attention kernels: causal attention counts the tiles a flash kernel computes,
            and flash attention's backward its recomputation of the scores.
        model_flops: the FLOPs the model needs (the MFU convention, PaLM appendix B / Megatron): matmul
            FLOPs with causal attention counted for the unmasked half exactly and without flash attention's
            recomputed scores in backward. ``matmul_flops >= model_flops``.
        matmuls: the GEMMs behind ``matmul_flops`` by shape (for shape-dependent achieved FLOP/s).
        other_bytes: bytes read + written by every other op that runs a kernel, op by op (eager execution:
            elementwise, norms, softmax, copies): the memory-bandwidth-bound part.
        ops: number of dispatched ATen ops that run a kernel (views, ``detach`` and ``prim`` ops not counted):
            per-op launch/dispatch overhead, significant on CPU.
        fused_bytes: the same memory-bound work with every chain of non-matmul ops between two matrix
            products fused into one kernel (``torch.compile``/Inductor, or hand-fused kernels such as
            Transformer Engine's): only the tensors entering a chain from outside it and the ones leaving it
            (read by a matmul, a later chain, saved for backward, or alive at the end) touch memory.
        fused_kernels: kernels launched under that fusion: the matrix products plus one per fused chain.
    """

    matmul_flops: float = 0.0
    matmuls: list[Matmul] = field(default_factory=list)
    other_bytes: float = 0.0
    ops: int = 0
    model_flops: float | None = None
    fused_bytes: float | None = None
    fused_kernels: int | None = None

    def __post_init__(self):
        if self.model_flops is None:  # built by hand (tests, users): no attention detail known
            self.model_flops = self.matmul_flops
        if self.fused_bytes is None:
            self.fused_bytes = self.other_bytes
        if self.fused_kernels is None:
            self.fused_kernels = self.ops


@dataclass
class PartInfo:
    """One part of the model: a repeated block class (``count`` instances) or the non-block rest
    (embeddings, final norm, head and loss: ``name="rest"``, ``count=1``).

    Attributes:
        params: parameter elements per instance (tied parameters counted once, in the part that owns them).
        trainable: elements with ``requires_grad`` per instance.
        param_bytes: bytes of the parameters per instance in their current dtype.
        fwd / bwd: :class:`PassCost` per instance at micro-batch 1 (bwd ~ 2x fwd for matmuls).
        act_bytes: bytes this instance keeps for backward at micro-batch 1, by compute dtype
            (``{"float32": ..., "bfloat16": ...}``: fp32 training, and bf16 autocast).
        input_bytes: bytes of the instance's input activation at micro-batch 1 in fp32 (what activation
            checkpointing keeps instead of ``act_bytes``; halve for bf16).
        peak_extra: the transient per sample by trace (``"float32"``, ``"bfloat16"``, ...); empty when unknown
            (then ``peak_extra_bytes``).
        peak_lines: the rest's transient above its activations as ``[(fixed, per_sample), ...]`` lines in the
            micro-batch ``b`` (the peak is the largest ``fixed + b * per_sample``), by trace: it mixes per-token
            tensors (logits, their gradient) with state-sized ones (the head's and tied embedding's weight
            gradients before they accumulate) that do not grow with ``b``. Measured by tracing 1 and 2
            samples. Empty when unknown (then ``peak_extra`` scales with ``b``). ``peak_lines_fused``: the
            same with the loss fused.
        peak_extra_fused: ``peak_extra`` of the rest when its cross-entropy runs as one fused kernel
            (``compile`` with components ``loss``: the logits' gradient written once in their dtype, no fp32 copy or
            log-softmax); its ``act_bytes_fused`` holds what it saves then (the logits in their dtype). Empty
            when not traced (a custom ``loss_func``) and for blocks.
        peak_extra_bytes: transient bytes above ``act_bytes`` while the instance runs forward+backward
            (workspace, recomputed activations of the instance being backpropagated), fp32.
        autocast_weight_bytes: bytes of the low-precision weight copies bf16 autocast makes and saves for
            backward per instance (alive from the instance's forward to its backward; not scaled by the
            micro-batch and not part of ``act_bytes``); 0 when unknown.
        act_bytes_fused: ``act_bytes`` when the instance runs with its op chains fused (``torch.compile``):
            without the intermediates made and used inside one chain, which a fusing compiler recomputes in
            backward instead of saving (:meth:`~torchloom.cost.op_trace.OpRecorder.chain_internal_saved_bytes`);
            empty when unknown (then ``act_bytes``). For the rest: with its loss fused (see ``peak_extra_fused``).
        fp8_input_saving: bytes ``act_bytes`` shrinks by, by trace, when every weight GEMM keeps its activation
            input in FP8 (Transformer Engine's Linear layers; :meth:`~torchloom.cost.op_trace.OpRecorder.
            weight_gemm_input_saving`); empty when unknown (then 0).
        tensors: trainable parameter tensors per instance (the optimizer step's per-tensor host work); 0 when
            unknown.
    """

    name: str
    count: int
    params: int
    trainable: int
    param_bytes: int
    fwd: PassCost
    bwd: PassCost
    act_bytes: dict[str, float]
    input_bytes: float
    peak_extra_bytes: float = 0.0
    autocast_weight_bytes: float = 0.0
    act_bytes_fused: dict[str, float] = field(default_factory=dict)
    fp8_input_saving: dict[str, float] = field(default_factory=dict)
    peak_extra: dict[str, float] = field(default_factory=dict)
    peak_extra_fused: dict[str, float] = field(default_factory=dict)
    peak_lines: dict[str, list] = field(default_factory=dict)
    peak_lines_fused: dict[str, list] = field(default_factory=dict)
    tensors: int = 0


@dataclass
class ExpertsInfo:
    """The routed experts of a Mixture-of-Experts model (what expert parallelism shards).

    Found with :func:`torchloom.moe.protocol.find_experts_modules`: every module whose direct parameters are
    fused over ``num_experts`` (dim 0). Counts are parameter elements.

    Attributes:
        modules: qualified names of the experts modules (one per MoE layer), model order.
        num_experts: experts per layer ``E`` (all layers must agree; the analysis refuses otherwise).
        top_k: experts each token is routed to (router ``top_k``, else the config's ``num_experts_per_tok``).
        params: expert parameter elements of the whole model (all layers, all experts).
        params_per_expert: elements of one expert in one layer (``params / (layers * E)``).
        active_params: elements one token uses: dense parameters + ``top_k / E`` of the expert ones.
        routed_flops_fwd: forward FLOPs of the experts per sample at the analysed ``seq_len``, priced as
            ``tokens * top_k * 2 * params_per_expert`` per layer: balanced routing (each expert gets
            ``tokens * top_k / E`` rows; a fake-tensor trace of data-dependent routing gives arbitrary counts,
            so this is the number the planner reasons with). Backward is twice as much.
        hidden_size: the hidden width of a routed token (bytes of the all-to-all per routed token).
    """

    modules: list[str]
    num_experts: int
    top_k: int
    params: int
    params_per_expert: int
    active_params: int
    routed_flops_fwd: float
    hidden_size: int

    @property
    def layers(self) -> int:
        return len(self.modules)


@dataclass
class ModelInfo:
    """A model as the planner sees it.

    Attributes:
        name: a label (class name or built-in config name).
        seq_len: tokens per sample the costs were traced at.
        parts: the repeated blocks first (in model order), then ``"rest"``.
        block_classes: class names of the repeated blocks (what FSDP/AC/PP cut by).
        num_blocks: total block instances.
        n_params / n_trainable: whole-model parameter elements (tied counted once).
        param_dtype: dtype name of the parameters (``"float32"``).
        tied: groups of parameter names that share one tensor.
        dims: architecture sizes where known (``hidden_size``, ``num_heads``, ``num_kv_heads``, ``head_dim``,
            ``intermediate_size``, ``vocab_size``, ``num_layers``, ``num_experts``): TP divisibility and
            TP/SP message sizes.
        family: the tensor-parallel family detected (``"llama"``, ``"gpt2"``, ...) or None.
        module: the meta-device model (for ``validate`` hooks that reuse the methods' own checks); not saved.
        signature: a hash of parameter names, shapes and dtypes (plan cache key).
        notes: what the analysis assumed (e.g. a stand-in loss), for the planner's output.
        experts: the routed experts (:class:`ExpertsInfo`) of a Mixture-of-Experts model, None for a dense one.
        eager_code: the style of the model's eager code (``"modules"``, ``"transformers"``): which measured host
            cost per op prices its uncompiled passes (``Hardware.eager_op_overhead_s``).
        sequence: whether a sample is a sequence of ``seq_len`` tokens; False for an input without one (images,
            feature vectors: ``seq_len`` is then 1 and throughput is counted in samples;
            :func:`torchloom.cost.analysis.sample_seq_len`).
    """

    name: str
    seq_len: int
    parts: list[PartInfo]
    block_classes: list[str]
    num_blocks: int
    n_params: int
    n_trainable: int
    param_dtype: str = "float32"
    tied: list[list[str]] = field(default_factory=list)
    dims: dict[str, int] = field(default_factory=dict)
    family: str | None = None
    module: nn.Module | None = field(default=None, repr=False, compare=False)
    signature: str = ""
    notes: list[str] = field(default_factory=list)
    experts: ExpertsInfo | None = None
    sequence: bool = True
    eager_code: str = "modules"

    @property
    def blocks(self) -> list[PartInfo]:
        return [p for p in self.parts if p.name != "rest"]

    @property
    def rest(self) -> PartInfo | None:
        return next((p for p in self.parts if p.name == "rest"), None)

    def flops_per_sample(self) -> float:
        """Model FLOPs of one sample's forward + backward (:attr:`PassCost.model_flops`: no recomputation,
        causal attention counted for its unmasked half): what MFU divides. For a dense decoder this is the
        PaLM/Megatron count ``6 N + 6 L d s`` per token (``N`` matmul parameters, ``L`` layers, ``d`` the
        attention width, ``s`` the sequence), the attention half of PaLM's ``12 L d s`` for causal masking."""
        return sum((p.fwd.model_flops + p.bwd.model_flops) * p.count for p in self.parts)

    def hardware_flops_per_sample(self) -> float:
        """FLOPs the hardware runs for one sample's forward + backward: flash attention's recomputed scores
        and the computed tiles on the causal diagonal included (activation checkpointing's recomputation is
        not: it depends on the plan, :class:`~torchloom.cost.step.Prediction` adds it)."""
        return sum((p.fwd.matmul_flops + p.bwd.matmul_flops) * p.count for p in self.parts)

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict, fields

        # not asdict(self): it would deep-copy the module
        def value(name):
            v = getattr(self, name)
            if name == "parts":
                return [asdict(p) for p in v]
            return asdict(v) if name == "experts" and v is not None else v

        return {f.name: value(f.name) for f in fields(self) if f.name != "module"}
