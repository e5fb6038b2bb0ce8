"""`context_parallel`: every sample's sequence split over the ``cp`` mesh dimension, attention computed by ring
attention (``torchloom.parallel.context``; docs/methods/context_parallel.md).

Ring attention (Liu et al. 2023, "Ring Attention with Blockwise Transformers"; PyTorch's
``torch.distributed.tensor.experimental.context_parallel``, torchtitan's CP): each rank holds ``S / cp`` tokens
of every sample; attention passes the key/value chunks around the ring (``cp - 1`` steps, each overlapping the
attention of the chunk already there) and merges the partial results with the online softmax. With causal load
balancing each rank holds a chunk from the front and its mirror from the back, so causal work is even.
Everything else (projections, MLP, norms, the loss) runs on the rank's tokens only. Parameters are not split by
``cp``: FSDP shards them over ``dp_shard x cp`` (torchtitan's layout), DDP and ZeRO-1 reduce over ``dp x cp``;
without a data-parallel method one is added (gradients must be reduced over the cp peers).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.effects import Collective, Effects, blocks_per_rank, dtype_bytes, split_tokens_temporary_scale
from ..errors import StrategyError
from ..parallel.context.install import configure_degree, install
from .ulysses import check_heads
from ..strategy.registry import Method, Stage, register_method


@dataclass
class ContextParallelConfig:
    """size: the cp degree (or ``parallel_mode``'s ``cp``). load_balance: give each rank a front chunk and its
    mirrored back chunk (even causal work); without it the last rank does ``(2 cp - 1) / cp`` of the mean
    attention work. causal: the mask for attention calls that pass a (rank-local) mask instead of
    ``is_causal``: it is replaced by the global causal one (True, causal LMs) or by padding/documents only.
    ulysses: the ring x Ulysses hybrid (USP, Fang & Zhao 2024): Ulysses all-to-alls over ``ulysses`` adjacent cp
    ranks, the ring over the ``cp / ulysses`` groups (``cp=4, ulysses=2``: "CP 2 x SP 2"); must divide cp and the
    attention heads per tp rank. 1: ring only."""

    size: int | None = None
    load_balance: bool = True
    causal: bool = True
    ulysses: int = 1


@register_method
class ContextParallel(Method):
    """Split the sequence over ``cp`` ranks; ring attention exchanges keys and values (see the module doc)."""

    name = "context_parallel"
    aliases = {"cp": {}}
    Config = ContextParallelConfig
    stage = Stage.TENSOR + 1
    mesh_dims = ("cp",)
    conflicts = {"ulysses": "both split the sequence over cp; choose one"}

    def estimate(self, info, dims, hw, step):
        """Per rank: the tokens, so every pass's FLOPs, memory-bound bytes, activations and transients, 1/cp
        (attention too: a rank's queries meet all keys, ``S/cp x S`` of the ``S x S`` scores); without load
        balancing the slowest rank's attention is ``(2 cp - 1) / cp`` of the mean (added as its own time).
        Ring traffic per attention layer and micro-batch: forward ``cp - 1`` sends of the rank's key/value
        chunk (``2 x tokens/cp x kv_heads/tp x head_dim`` in the compute dtype), backward twice that (keys
        and values again, and their gradients travelling with them), each overlapping the attention of the
        chunk at hand except the first. The ring x Ulysses hybrid (``ulysses = u``): the ring has ``cp / u``
        ranks (the same bytes per send: ``u`` times the tokens of ``1/u`` of the heads), plus Ulysses'
        four all-to-alls per layer and pass over ``u`` ranks (:meth:`~torchloom.methods.ulysses.Ulysses.estimate`)."""
        cp = dims.cp
        if cp <= 1:
            return None
        d = info.dims
        kv, hd = d.get("num_kv_heads") or d.get("num_heads"), d.get("head_dim")
        if not hd and d.get("hidden_size") and d.get("num_heads"):
            hd = d["hidden_size"] // d["num_heads"]
        scale = 1.0 / cp
        e = Effects(self.name, matmul_scale=scale, other_scale=scale,
                    memory_scale={"activations": scale,
                                  "temporary": split_tokens_temporary_scale(info, step, cp)})
        layers = blocks_per_rank(info, dims)
        u = max(self.config.ulysses, 1)
        ring = cp // u
        if kv and hd and layers:
            tokens = step.micro_batch * step.seq_len / cp
            chunk = 2.0 * tokens * kv / max(dims.tp, 1) * hd * dtype_bytes(step.compute_dtype)
            m = step.grad_accum
            if ring > 1:
                e.collectives += [
                    Collective("send_recv", chunk, "cp", calls=m * layers * (ring - 1), overlap="forward",
                               exposed_calls=m * layers, label="cp.ring_kv", recomputed=True),
                    Collective("send_recv", chunk, "cp", calls=2 * m * layers * (ring - 1), overlap="backward",
                               exposed_calls=m * layers, label="cp.ring_kv_bwd")]
            if u > 1:
                h = d.get("num_heads") or kv
                kv_sent = kv if (kv // max(dims.tp, 1)) % u == 0 else h
                nbytes = tokens * (2 * h + 2 * kv_sent) / max(dims.tp, 1) * hd * dtype_bytes(step.compute_dtype)
                e.collectives += [Collective("all_to_all", nbytes, "cp", calls=m * layers, label="cp.ulysses_a2a",
                                             recomputed=True),
                                  Collective("all_to_all", nbytes, "cp", calls=m * layers,
                                             label="cp.ulysses_a2a_bwd")]
        else:
            e.notes.append("no head sizes known: ring traffic not priced")
        if not self.config.load_balance:
            e.notes.append(f"no load balancing: the last rank's causal attention is {(2 * cp - 1) / cp:.2f} x the "
                           "mean (priced on the critical path through the attention FLOPs share)")
            attn = _attention_share(info)
            e.matmul_scale *= 1.0 + attn * ((2 * cp - 1) / cp - 1.0)
        return e

    def validate(self, info, dims) -> None:
        """Refuse what the split cannot do: a sequence the ``2 cp`` load-balanced chunks do not divide, expert
        parallelism together with cp (not priced), heads unknown."""
        cp = dims.cp
        if cp <= 1:
            return
        if dims.ep > 1:
            raise StrategyError(f"context_parallel with ep={dims.ep}: context and expert parallelism together are "
                                "not supported yet; choose one.")
        u = self.config.ulysses
        if u > 1:
            if cp % u:
                raise StrategyError(f"context_parallel: ulysses={u} does not divide cp={cp}; choose a divisor.")
            d = info.dims
            check_heads(d.get("num_heads"), d.get("num_kv_heads") or d.get("num_heads"), dims.tp, u)
        seq = info.seq_len
        chunks = 2 * cp if self.config.load_balance else cp
        if seq % chunks:
            raise StrategyError(f"context_parallel: the sequence length {seq} is not a multiple of {chunks} "
                                f"({'2 x ' if self.config.load_balance else ''}cp={cp} chunks); pad the sequences to "
                                f"a multiple of {chunks} or choose another cp.")

    def configure(self, ctx) -> None:
        configure_degree(ctx, self.name, self.config.size)

    def apply(self, ctx) -> None:
        if ctx.mesh.dims.ep > 1:
            raise StrategyError(f"context_parallel with ep={ctx.mesh.dims.ep}: context and expert parallelism together "
                                "are not supported yet; choose one.")
        u, cp = self.config.ulysses, ctx.mesh.dims.cp
        if u > 1:
            if cp % u:
                raise StrategyError(f"context_parallel: ulysses={u} does not divide cp={cp}; the hybrid runs Ulysses "
                                    f"over {u} of the cp ranks and the ring over cp / ulysses: choose a divisor.")
            config = getattr(ctx.model, "config", None)
            if config is not None:
                h = getattr(config, "num_attention_heads", None)
                check_heads(h, getattr(config, "num_key_value_heads", None) or h, ctx.mesh.dims.tp, u)
        install(ctx, method=self.name, kind="ring", load_balance=self.config.load_balance, causal=self.config.causal,
                ulysses=u)


def _attention_share(info) -> float:
    """Share of the blocks' forward FLOPs in attention products."""
    blocks = info.blocks
    if not blocks:
        return 0.0
    total = sum(g.flops for g in blocks[0].fwd.matmuls)
    attn = sum(g.flops for g in blocks[0].fwd.matmuls if g.attention)
    return attn / total if total else 0.0
