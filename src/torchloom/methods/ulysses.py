"""`ulysses`: every sample's sequence split over the ``cp`` mesh dimension, attention by DeepSpeed-Ulysses
all-to-alls (Jacobs et al. 2023, arXiv 2309.14509; ``torchloom.parallel.context.ulysses``;
docs/methods/context_parallel.md).

Around each attention an all-to-all swaps the rank's sequence shard of all heads for the whole sequence of
``H / cp`` heads, attention runs on whole sequences (the original SDPA kernel where only causal masking
applies), and a second all-to-all returns the output to sequence shards. Needs ``cp`` to divide the query
heads (after tensor parallelism's split); key/value heads it does not divide are replicated to their query-head
groups. Parameters are not split by ``cp``: FSDP shards over ``dp_shard x cp``, DDP reduces over ``dp x cp``.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..cost.effects import Collective, Effects, blocks_per_rank, dtype_bytes, split_tokens_temporary_scale
from ..errors import StrategyError
from ..parallel.context.install import configure_degree, install
from ..strategy.registry import Method, Stage, register_method


@dataclass
class UlyssesConfig:
    """size: the Ulysses degree (the ``cp`` mesh dimension; or ``parallel_mode``'s ``cp``). causal: as in
    ``context_parallel``."""

    size: int | None = None
    causal: bool = True


@register_method
class Ulysses(Method):
    """Split the sequence over ``cp`` ranks; all-to-all to head shards around attention (module doc)."""

    name = "ulysses"
    aliases = {"ulysses_sequence_parallel": {}}
    key_aliases = {"sp_size": "size", "sequence_parallel_size": "size", "degree": "size"}
    Config = UlyssesConfig
    stage = Stage.TENSOR + 1
    mesh_dims = ("cp",)

    def estimate(self, info, dims, hw, step):
        """Per rank: the tokens, so every pass's FLOPs, activations and transients, 1/cp (attention: whole
        sequences of ``H/cp`` heads). Per attention layer and micro-batch four all-to-alls forward (q, k, v, the
        output; ``tokens/cp x heads/tp x head_dim`` each in the compute dtype, k/v with the key/value heads, or
        the query heads when cp does not divide them and they are replicated) and four backward, none overlapped
        (attention waits for them)."""
        cp = dims.cp
        if cp <= 1:
            return None
        d = info.dims
        h, kv, hd = d.get("num_heads"), d.get("num_kv_heads") or d.get("num_heads"), d.get("head_dim")
        if not hd and d.get("hidden_size") and h:
            hd = d["hidden_size"] // h
        e = Effects(self.name, matmul_scale=1.0 / cp, other_scale=1.0 / cp,
                    memory_scale={"activations": 1.0 / cp,
                                  "temporary": split_tokens_temporary_scale(info, step, cp)})
        layers = blocks_per_rank(info, dims)
        if h and hd and layers:
            tokens = step.micro_batch * step.seq_len / cp
            kv_sent = kv if (kv // max(dims.tp, 1)) % cp == 0 else h  # replicated when cp does not divide them
            nbytes = tokens * (2 * h + 2 * kv_sent) / max(dims.tp, 1) * hd * dtype_bytes(step.compute_dtype)
            m = step.grad_accum
            e.collectives += [Collective("all_to_all", nbytes, "cp", calls=m * layers, label="ulysses.all_to_all",
                                         recomputed=True),
                              Collective("all_to_all", nbytes, "cp", calls=m * layers, label="ulysses.all_to_all_bwd")]
        else:
            e.notes.append("no head sizes known: all-to-all traffic not priced")
        return e

    def validate(self, info, dims) -> None:
        """The heads (after tp's split) and the sequence must divide by cp; no ep with it."""
        cp = dims.cp
        if cp <= 1:
            return
        if dims.ep > 1:
            raise StrategyError(f"ulysses with ep={dims.ep}: not supported yet; drop expert parallelism or set cp=1.")
        d = info.dims
        check_heads(d.get("num_heads"), d.get("num_kv_heads") or d.get("num_heads"), dims.tp, cp)
        if info.seq_len % cp:
            raise StrategyError(f"ulysses: the sequence length {info.seq_len} is not a multiple of cp={cp}; pad the "
                                f"sequences to a multiple of {cp}.")

    def configure(self, ctx) -> None:
        configure_degree(ctx, self.name, self.config.size)

    def apply(self, ctx) -> None:
        cp = ctx.mesh.dims.cp
        config = getattr(ctx.model, "config", None)
        if config is not None and cp > 1:
            h = getattr(config, "num_attention_heads", None)
            check_heads(h, getattr(config, "num_key_value_heads", None) or h, ctx.mesh.dims.tp, cp)
        install(ctx, method=self.name, kind="ulysses", load_balance=False, causal=self.config.causal)


def check_heads(heads: int | None, kv_heads: int | None, tp: int, cp: int) -> None:
    """Ulysses splits the query heads a rank holds over cp (key/value heads cp does not divide are replicated
    to their query-head groups at run time).

    Raises:
        StrategyError: cp does not divide the query heads per tensor-parallel rank (the head counts, the degrees
            that would, and context_parallel as the alternative, named).
    """
    if not heads:
        return
    per = heads // max(tp, 1)
    if per % cp:
        ok = [k for k in range(2, per + 1) if per % k == 0]
        choose = f"choose cp among {ok}, or use" if ok else f"no cp > 1 divides {per} head; use"
        kv = f" ({kv_heads} key/value heads)" if kv_heads else ""
        raise StrategyError(
            f"ulysses: cp={cp} does not divide the {per} attention heads per tensor-parallel rank ({heads} heads{kv} / "
            f"tp={tp}); {choose} context_parallel (ring attention has no head limit).")
