"""The published-runs validation set (``benchmarks/published_runs.yaml``): public training runs with enough detail
to price them with their published plan, and how each row becomes a planner input.

A row names the model (a ``loom plan`` preset or its architecture sizes), the hardware, the parallel plan, the
batch, the precision and activation checkpointing, and the published throughput (tokens/s per GPU and/or
TFLOP/s per GPU) and memory where given, with its source. :func:`load_runs` parses and checks the file (errors
name the row and the field); :func:`planner_inputs` turns a row into ``(model config, Hardware, Candidate)``.

Kernels: a run's framework decides which kernels it ran. Megatron-LM / NeMo / Megatron-DeepSpeed rows use
Transformer Engine or Apex fused kernels (fused norms, bias-GELU/SwiGLU, RoPE, softmax, cuDNN/FlashAttention
kernels): they are priced with fused op chains (the cost model's ``compile`` rule) and the ``flash3``
attention kernel on Hopper (cuDNN fused attention is of FlashAttention-3's class). torchtitan rows run PyTorch
SDPA (FlashAttention-2) and fuse only when they say ``compile``. The row's ``kernels`` field overrides this.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

DATA = Path(__file__).resolve().parent / "published_runs.yaml"
GiB = 2.0 ** 30

#: frameworks whose runs use fused (Transformer Engine / Apex) kernels
FUSED_FRAMEWORKS = ("megatron", "nemo", "megatron-deepspeed", "deepspeed-megatron", "transformer engine", "mlperf")
#: frameworks whose FSDP reduce-scatters the gradients after every micro-batch and accumulates the shards (no
#: no_sync / set_requires_gradient_sync(False) in their training loops): torchtitan (train.py's micro-batch loop
#: calls backward under FSDP2's defaults), llm-foundry/Composer and NeMo AutoModel (FSDP2, the same loop shape).
#: Megatron-Bridge's FSDP rows run Megatron-FSDP (``--use-megatron-fsdp``), whose recommended
#: ``optim_grads_params`` strategy keeps the gradients sharded ("optimizer state, gradients, and training
#: parameters are sharded": https://docs.nvidia.com/megatron-core/developer-guide/latest/apidocs/core/
#: core.distributed.fsdp.src.megatron_fsdp.fully_shard.html, ShardingStrategy; flags:
#: https://docs.nvidia.com/megatron-core/developer-guide/nightly/user-guide/features/custom_fsdp.html), so a
#: micro-batch's gradients are reduce-scattered into the shards. torchloom's ``("fsdp", {"accumulate_sharded":
#: True})``; Megatron's distributed optimizer (its non-FSDP rows) keeps whole fp32 main gradients instead.
SHARDED_ACCUMULATION_FRAMEWORKS = ("torchtitan", "llm-foundry", "nemo-automodel", "megatron-bridge")
#: accelerator names of the rows -> the planner's table (H800: an H100 SXM with 400 GB/s NVLink, patched below)
GPU_ALIASES = {"h800": "h100-sxm", "gb200": "b200"}
PRECISIONS = ("bf16", "fp16", "fp8")
AC_MODES = ("none", "selective", "full", None)


class PublishedRunError(ValueError):
    """A row of the validation set is malformed (the message names the row and the field)."""


@dataclass
class PublishedRun:
    id: str
    source: dict[str, Any]
    model: dict[str, Any]
    hardware: dict[str, Any]
    plan: dict[str, Any]
    batch: dict[str, Any]
    precision: str
    published: dict[str, Any]
    activation_checkpointing: str | None = None
    compile: bool | None = None
    fp8_recipe: str | None = None
    fp8_param_gather: bool | None = None  # FP8 weights gathered and held unsharded (Megatron's fp8_param_gather)
    notes: str = ""
    kernels: str | None = None  # "fused" / "eager"; None: from the source's framework
    loss_kernel: str | None = None  # "fused" / "eager"; None: from the source's framework (see fused_loss)

    # -- derived -----------------------------------------------------------------------------------------
    @property
    def gpus(self) -> int:
        return int(self.hardware["gpus"])

    @property
    def degrees(self) -> dict[str, int]:
        p = self.plan
        tp, pp, cp = int(p.get("tp") or 1), int(p.get("pp") or 1), int(p.get("cp") or 1)
        dp = self.gpus // (tp * pp * cp)
        return {"tp": tp, "pp": pp, "cp": cp, "dp": dp, "ep": int(p.get("ep") or 1)}

    @property
    def fused(self) -> bool:
        if self.kernels is not None:
            return self.kernels == "fused"
        return bool(self.compile) or self.transformer_engine

    @property
    def fused_loss(self) -> bool:
        """The run's cross-entropy is one fused kernel (the logits kept in bf16, their gradient written once):
        llm-foundry's MPT (``loss_fn`` defaults to ``fused_crossentropy``, flash-attn's ``CrossEntropyLoss``:
        llmfoundry/models/mpt/modeling_mpt.py) and torchtitan since ``training.compile`` compiled the loss too
        (torchtitan/components/loss.py ``build_cross_entropy_loss`` from 2025-02; its 2024 tables ran it eager:
        train.py at 9dec370 has the loss compile commented out). The row's ``loss_kernel`` overrides this."""
        if self.loss_kernel is not None:
            return self.loss_kernel == "fused"
        framework = str(self.source.get("framework", "")).lower()
        return framework == "llm-foundry"

    @property
    def transformer_engine(self) -> bool:
        """The run's framework builds its layers from Transformer Engine / Apex (Megatron, NeMo, MLPerf)."""
        if self.kernels == "eager":
            return False
        name = f"{self.source.get('name', '')} {self.source.get('framework', '')}".lower()
        return any(f in name for f in FUSED_FRAMEWORKS)

    @property
    def published_tps(self) -> float | None:
        """Published tokens/s per GPU (from TFLOP/s per GPU and the model FLOPs when only those are given:
        see :func:`tps_from_tflops`)."""
        v = self.published.get("tokens_per_s_per_gpu")
        return float(v) if v else None


def _need(row: dict, key: str, rid: str):
    if row.get(key) is None:
        raise PublishedRunError(f"published run {rid!r}: missing {key!r}.")
    return row[key]


def parse_run(row: dict[str, Any]) -> PublishedRun:
    """One row of the YAML as a :class:`PublishedRun`.

    Raises:
        PublishedRunError: a missing or bad field, naming the row and the field."""
    rid = str(row.get("id") or "?")
    known = {f.name for f in dataclasses.fields(PublishedRun)}
    unknown = sorted(set(row) - known)
    if unknown:
        raise PublishedRunError(f"published run {rid!r}: unknown field(s) {unknown}; known: {sorted(known)}.")
    for key in ("id", "source", "model", "hardware", "plan", "batch", "precision", "published"):
        _need(row, key, rid)
    run = PublishedRun(**row)
    if not (run.source.get("url") or run.source.get("where")):
        raise PublishedRunError(f"published run {rid!r}: the source needs a url (and where in it).")
    if run.precision not in PRECISIONS:
        raise PublishedRunError(f"published run {rid!r}: precision {run.precision!r} is not one of {PRECISIONS}.")
    if run.activation_checkpointing not in AC_MODES:
        raise PublishedRunError(f"published run {rid!r}: activation_checkpointing {run.activation_checkpointing!r} "
                                f"is not one of {AC_MODES}.")
    for key in ("kernels", "loss_kernel"):
        if getattr(run, key) not in (None, "fused", "eager"):
            raise PublishedRunError(f"published run {rid!r}: {key} {getattr(run, key)!r} is not 'fused' or 'eager'.")
    for key in ("gpu", "gpus"):
        _need(run.hardware, key, rid)
    for key in ("seq_len", "global_batch"):
        _need(run.batch, key, rid)
    d = run.degrees
    if d["dp"] < 1 or d["dp"] * d["tp"] * d["pp"] * d["cp"] != run.gpus:
        raise PublishedRunError(f"published run {rid!r}: tp x pp x cp = {d['tp'] * d['pp'] * d['cp']} does not divide "
                                f"{run.gpus} GPUs.")
    mb = int(run.batch.get("micro_batch") or 1)
    if run.batch["global_batch"] % (mb * d["dp"]):
        raise PublishedRunError(f"published run {rid!r}: global batch {run.batch['global_batch']} is not a multiple of "
                                f"micro-batch {mb} x dp {d['dp']}.")
    if not (run.published.get("tokens_per_s_per_gpu") or run.published.get("tflops_per_gpu")
            or run.published.get("mfu")):
        raise PublishedRunError(f"published run {rid!r}: no published throughput (tokens_per_s_per_gpu, "
                                "tflops_per_gpu or mfu).")
    m = run.model
    if not m.get("preset"):
        for key in ("layers", "hidden", "heads", "vocab"):
            _need(m, key, rid)
    return run


def load_runs(path: Path | str = DATA) -> list[PublishedRun]:
    """Every row of the validation set, checked.

    Raises:
        PublishedRunError: a malformed row or duplicate ids."""
    doc = yaml.safe_load(Path(path).read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("runs"), list):
        raise PublishedRunError(f"{path}: expected a mapping with a 'runs' list.")
    runs = [parse_run(r) for r in doc["runs"]]
    ids = [r.id for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise PublishedRunError(f"{path}: duplicate ids {dup}.")
    return runs


# -- planner inputs ------------------------------------------------------------------------------------------
def model_config(run: PublishedRun) -> dict[str, Any] | str:
    """A ``loom plan`` model: the preset name, or a Hugging Face config dict built from the row's sizes (a
    Llama-style decoder: gated SwiGLU MLP, RMSNorm, RoPE; ``gelu`` MLP rows (GPT-3 style) as GPT-2's architecture:
    LayerNorm, 4h GELU MLP, learned positions; MoE rows as Mixtral)."""
    m = run.model
    if m.get("preset"):
        return m["preset"]
    seq = int(run.batch["seq_len"])
    h, layers, heads, vocab = int(m["hidden"]), int(m["layers"]), int(m["heads"]), int(m["vocab"])
    kv = int(m.get("kv_heads") or heads)
    arch = (m.get("arch") or "").lower()
    if arch == "gpt" or (not m.get("ffn") and not m.get("moe")) or arch == "gelu":
        # GELU as one kernel (F.gelu: Megatron's fused bias-GELU, MPT's nn.GELU), not HF's composite gelu_new
        return {"model_type": "gpt2", "n_embd": h, "n_layer": layers, "n_head": heads, "vocab_size": vocab,
                "n_positions": seq, "n_inner": int(m.get("ffn") or 4 * h), "activation_function": "gelu",
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    cfg = {"vocab_size": vocab, "hidden_size": h, "intermediate_size": int(m["ffn"]), "num_hidden_layers": layers,
           "num_attention_heads": heads, "num_key_value_heads": kv, "max_position_embeddings": seq,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": bool(m.get("tied", False)),
           "hidden_act": "silu"}
    if m.get("head_dim"):
        cfg["head_dim"] = int(m["head_dim"])
    moe = m.get("moe")
    if moe:
        cfg.update(model_type="mixtral", num_local_experts=int(moe["experts"]), num_experts_per_tok=int(moe["top_k"]),
                   intermediate_size=int(moe.get("expert_ffn") or m["ffn"]), sliding_window=None,
                   router_aux_loss_coef=0.0)
    else:
        cfg.update(model_type="llama", attention_bias=False, mlp_bias=False)
    return cfg


def hardware(run: PublishedRun):
    """The row's cluster: the accelerator table entry, with what the row publishes about its hosts put in
    (``memory_gib``, ``hbm_tb_s``, ``nvlink_gb_s``), and the attention kernel of its framework."""
    from torchloom.cost.accelerators import cluster, lookup

    hw_row = run.hardware
    name = str(hw_row["gpu"]).lower()
    acc = lookup(GPU_ALIASES.get(name, name))
    changes = {}
    if name == "h800":
        changes["link_bw"] = 200e9  # 400 GB/s bidirectional NVLink: 200 GB/s one direction (NVIDIA H800 brief)
    if hw_row.get("nvlink_gb_s"):
        changes["link_bw"] = float(hw_row["nvlink_gb_s"]) * 1e9
    if hw_row.get("memory_gib"):
        changes["memory_bytes"] = float(hw_row["memory_gib"]) * GiB
    if hw_row.get("hbm_tb_s"):
        changes["mem_bw"] = float(hw_row["hbm_tb_s"]) * 1e12
    if changes:
        acc = dataclasses.replace(acc, **changes)
    kernel = "flash3" if run.fused else "flash2"
    per_node = int(hw_row.get("gpus_per_node") or min(8, run.gpus))
    return cluster(acc, run.gpus, per_node, attention_kernel=kernel)


def strategy_methods(run: PublishedRun) -> list[tuple[str, dict[str, Any]]]:
    """The row's plan as torchloom methods (stage order does not matter: the cost model sorts them)."""
    p, d = run.plan, run.degrees
    out: list[tuple[str, dict[str, Any]]] = []
    if d["tp"] > 1:
        out.append(("tensor_parallel", {}))
        if p.get("sequence_parallel") is not False:  # Megatron's default with TP since 2022, torchtitan's too
            out.append(("sequence_parallel", {}))
        # the cross-entropy on vocabulary-sharded logits: Megatron's vocab_parallel_cross_entropy (always with
        # TP), torchtitan's loss_parallel (on by default with TP)
        if p.get("loss_parallel") is not False:
            out.append(("loss_parallel", {}))
    if d["pp"] > 1:
        v = int(p.get("vpp") or 1)
        sched = p.get("pp_schedule") or ("interleaved_1f1b" if v > 1 else "1f1b")
        cfg = {"schedule": sched}
        if v > 1:
            cfg["stages_per_rank"] = v
        out.append(("pipeline_parallel", cfg))
    if d["cp"] > 1:
        out.append(("context_parallel", {}))
    if d["ep"] > 1:
        out.append(("expert_parallel", {}))
    zero = p.get("zero")
    if p.get("fsdp") or zero == 3 or (d["cp"] > 1 and not zero):
        framework = str(run.source.get("framework", "")).lower()
        sharded_accum = framework in SHARDED_ACCUMULATION_FRAMEWORKS and d["pp"] == 1
        out.append(("fsdp", {"accumulate_sharded": True} if sharded_accum else {}))
    elif zero in (1, 2):
        # Megatron's distributed optimizer (its "ZeRO-1"): bf16 model weights whole, fp32 main gradients whole
        # while micro-batches accumulate, fp32 master weights and Adam state sharded over dp; gradients
        # reduce-scattered in backward and weights all-gathered after the step, both overlapped. In torchloom's
        # vocabulary that is FSDP ZeRO-2 under amp: the same bytes per parameter (2 + 4 + 12/dp) and the same
        # two collectives per step (torchloom's zero1, optimizer-only sharding with a broadcast, is not it)
        out.append(("fsdp", {"reshard_after_forward": False}))
    elif d["dp"] > 1:
        out.append(("ddp", {}))
    if run.precision == "fp8":
        # Transformer Engine's FP8 Linear layers keep the FP8-cast input for backward (torchao's keep bf16)
        fp8 = {"recipe": run.fp8_recipe or "tensorwise"}
        if run.transformer_engine:
            fp8["save_fp8_inputs"] = True
        # Megatron-Bridge's FP8 recipes (megatron/bridge/training/mixed_precision.py: delayed, current scaling,
        # MXFP8) set fp8_param_gather=True: FP8 model weights, gathered in FP8 (torchao's FSDP float8 all-gather)
        if run.fp8_param_gather:
            fp8["fsdp_float8_all_gather"] = True
        out += [("amp", {"dtype": "bfloat16"}), ("float8", fp8)]
    else:
        out.append(("amp", {"dtype": "bfloat16" if run.precision == "bf16" else "float16"}))
    ac = run.activation_checkpointing
    if ac == "full":
        out.append(("checkpoint", {}))
    elif ac == "selective":
        out.append(("checkpoint", {"mode": "selective"}))
    components = (["model"] if run.fused else []) + (["loss"] if run.fused_loss else [])
    if components:
        out.append(("compile", {"components": components} if components != ["model"] else {}))
    return out


def candidate(run: PublishedRun):
    """The row's plan as a :class:`~torchloom.search.candidate.Candidate` (FSDP rows shard over dp)."""
    from torchloom.parallel.mesh import ParallelDims
    from torchloom.search.candidate import Candidate

    d = run.degrees
    methods = strategy_methods(run)
    names = {n for n, _ in methods}
    sharded = "fsdp" in names
    # HSDP only where the row says FSDP with replicas; Megatron's distributed optimizer shards over all of dp
    hsdp = int(run.plan.get("dp_replicate") or 1) if sharded and run.plan.get("fsdp") else 1
    dims = ParallelDims(pp=d["pp"], tp=d["tp"], cp=d["cp"], ep=d["ep"],
                        dp_replicate=hsdp if sharded else d["dp"], dp_shard=d["dp"] // hsdp if sharded else 1)
    dims.resolve(run.gpus)  # a plan torchloom cannot express (ep not dividing dp, ...) is named, not mispriced
    mb = int(run.batch.get("micro_batch") or 1)
    accum = int(run.batch["global_batch"]) // (mb * d["dp"])
    return Candidate(dims, tuple(methods), mb, accum, int(run.batch["seq_len"]))


def tps_from_tflops(tflops_per_gpu: float, model_flops_per_token: float) -> float:
    """Tokens/s per GPU from a published TFLOP/s per GPU and the FLOPs per token it was computed with."""
    return tflops_per_gpu * 1e12 / model_flops_per_token if model_flops_per_token > 0 else math.nan
