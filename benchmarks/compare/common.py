"""What every contender shares: the model, its seeded initial weights, the token stream, the optimizer recipe,
and the result of a contender's setup (:class:`Prepared`). No torchloom import here (the hand-written
PyTorch contender uses this module too)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

# The default `loom train` model (src/torchloom/train/configs/default.yaml; torchloom.train.job.build_model) and a
# larger one of the same family.
MODELS: dict[str, dict[str, Any]] = {
    "default": dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=4,
                    intermediate_size=768, seq_len=128, tie_embeddings=False, rope_theta=10000.0),
    "llama36m": dict(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                     intermediate_size=1536, seq_len=128, tie_embeddings=False, rope_theta=10000.0),
    "tiny": dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
                 intermediate_size=128, seq_len=32, tie_embeddings=False, rope_theta=10000.0),
}

# AdamW as `loom train` configures it (lr fixed: no schedule, so every contender sees the same update).
OPTIM_ARGS = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
BLOCK_CLASS = "LlamaDecoderLayer"


def build_model(name: str, seed: int = 0, meta: bool = False) -> torch.nn.Module:
    """The LLaMA model ``name`` of :data:`MODELS` in fp32 on CPU, initialised after ``torch.manual_seed(seed)``:
    the same construction as ``torchloom.train.job.build_model`` (so the same weights for the same seed).
    ``meta=True``: the same module tree on the meta device (no storage; the contender materialises it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    mc = MODELS[name]
    config = LlamaConfig(
        vocab_size=mc["vocab_size"], hidden_size=mc["hidden_size"], intermediate_size=mc["intermediate_size"],
        num_hidden_layers=mc["num_layers"], num_attention_heads=mc["num_heads"],
        num_key_value_heads=mc["num_kv_heads"], max_position_embeddings=mc["seq_len"],
        tie_word_embeddings=mc["tie_embeddings"], rope_parameters={"rope_type": "default", "rope_theta": mc["rope_theta"]},
        bos_token_id=0, eos_token_id=0, pad_token_id=0, use_cache=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return LlamaForCausalLM(config)
    return LlamaForCausalLM(config)


def global_batches(name: str, global_batch: int, steps: int, seed: int = 1234, noise: float = 0.1) -> torch.Tensor:
    """The token stream: ``steps`` global batches of shape (global_batch, seq_len), int64, the same for every
    contender and world size. A learnable source, so that the loss moves and the loss checks can see a run that
    is not the same training (uniform tokens sit at ln(vocab) whatever the weights): each next token is a fixed
    random permutation of the previous one, replaced by a uniform draw with probability ``noise``."""
    mc = MODELS[name]
    v, t = mc["vocab_size"], mc["seq_len"]
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(v, generator=g)
    x = torch.empty(steps, global_batch, t, dtype=torch.int64)
    x[..., 0] = torch.randint(0, v, (steps, global_batch), generator=g)
    for i in range(1, t):
        x[..., i] = perm[x[..., i - 1]]
    flip = torch.rand(steps, global_batch, t, generator=g) < noise
    return torch.where(flip, torch.randint(0, v, (steps, global_batch, t), generator=g), x)


def rank_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's micro-batch of one global batch: rows ``[rank * mb, (rank + 1) * mb)``, mb = global / world."""
    mb = batch.shape[0] // world
    return batch[rank * mb:(rank + 1) * mb].contiguous()


@dataclass
class Prepared:
    """A contender set up on one rank.

    Attributes:
        step: ``step(input_ids) -> loss``: one optimizer step (forward with ``labels=input_ids``, backward,
            optimizer step, zero grad) on this rank's micro-batch; returns this rank's mean loss (float tensor).
        module: the module whose parameters hold this rank's weights (the wrapped model or its engine).
        optimizer: the innermost ``torch.optim.Optimizer`` (for optimizer-state bytes).
        world_size: the number of processes the contender itself reports (its own accessor).
        wrapper: what the model became (class names of the wrapper / FSDP units).
        notes: anything the contender wants in the report (settings, warnings).
        param_bytes: this rank's parameter bytes when the framework hides them from ``module.parameters()``
            (DeepSpeed ZeRO-3 keeps the shard in ``p.ds_tensor``); None: sum over ``module.parameters()``.
        precision: the compute precision the contender ended up with, when only setup knows it
            (``strategy="auto"``); None: the :class:`Contender`'s.
        batch_slice: ``batch_slice(global_batch) -> this rank's input`` when the rank does not read rows
            ``[rank * mb, (rank + 1) * mb)`` (pipeline or tensor parallel peers read the same data-parallel
            slice); None: :func:`rank_slice`.
    """

    step: Callable[[torch.Tensor], torch.Tensor]
    module: torch.nn.Module
    optimizer: Any
    world_size: int
    wrapper: str
    notes: list[str] = field(default_factory=list)
    param_bytes: int | None = None
    precision: str | None = None
    batch_slice: Callable[[torch.Tensor], torch.Tensor] | None = None


@dataclass
class Contender:
    """One configuration of one framework.

    Attributes:
        setup: ``setup(model, cfg) -> Prepared`` on every rank; ``cfg`` is the run's dict (model, global_batch,
            world, rank, dtype); the process group may or may not exist yet (the contender creates it its way).
        strategy: the common strategy label (``ddp``, ``zero1``, ``zero2``, ``zero3``, ``zero3+ac+bf16``), used
            to pair contenders across frameworks.
        sharded: whether parameters must be split over ranks (checked: per-rank parameter bytes ~ 1/world).
        wrapper: a substring the wrapper description must contain (checked).
        precision: ``fp32`` or ``bf16`` (compute dtype of the matmuls).
        meta: the worker builds the model on the meta device (after the same seed) and the contender
            materialises it: what a user does so that no rank ever holds the whole fp32 model.
    """

    setup: Callable[..., Prepared]
    strategy: str
    sharded: bool
    wrapper: str
    precision: str = "fp32"
    meta: bool = False
