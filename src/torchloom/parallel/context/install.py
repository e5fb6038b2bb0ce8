"""Installing a sequence split on an :class:`~torchloom.context.AccelContext` (shared by the
``context_parallel`` and ``ulysses`` methods)."""
from __future__ import annotations

from ...errors import StrategyError
from .dispatch import sequence_attention
from .split import SequenceSplitter, attention_window


def configure_degree(ctx, method: str, size: int | None) -> None:
    """Set ``ctx.dims.cp`` from the method's ``size`` or ``parallel_mode``'s ``cp`` (one of them, or equal).

    Raises:
        StrategyError: both given and different, or neither.
    """
    mode = ctx.strategy.config("parallel_mode")
    given = getattr(mode, "cp", None) if mode is not None else None
    if size is not None and given is not None and size != given:
        raise StrategyError(f"{method}: size={size} but parallel_mode sets cp={given}; give the degree once.")
    degree = size if size is not None else given
    if degree is None:
        raise StrategyError(f"{method} needs its degree: ('{method}', {{'size': 2}}) or ('parallel_mode', {{'cp': 2}}).")
    ctx.dims.cp = degree


def use_sdpa_attention(model) -> str | None:
    """Switch a Hugging Face model to its SDPA attention (the implementation the split routes); returns the
    implementation it had when it was another one, else None."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if config is None or impl in (None, "sdpa"):
        return None
    setter = getattr(model, "set_attn_implementation", None)
    if callable(setter):
        setter("sdpa")
    else:
        config._attn_implementation = "sdpa"
    return impl


def check_model(model, method: str) -> None:
    """Refuse what the split cannot compute exactly: attention dropout, and Hugging Face heads other than causal
    LM ones (a sequence classifier pools one token per rank; token labels must not be shifted).

    Raises:
        StrategyError: naming the setting or the head class.
    """
    name = type(model).__name__
    if getattr(model, "config", None) is not None and "For" in name and not name.endswith("ForCausalLM"):
        raise StrategyError(f"{method}: {name} is not a causal language model; the sequence split serves causal LMs "
                            "(each rank holds part of every sample and labels are shifted for next-token prediction), "
                            "so a sequence-level head would pool one rank's tokens only. Use a *ForCausalLM model or "
                            "train without the split.")
    config = getattr(model, "config", None)
    chunk = getattr(config, "attention_chunk_size", None) if config is not None else None
    if chunk:
        raise StrategyError(f"{method}: the model uses chunked attention (attention_chunk_size={chunk}), a mask the "
                            "sequence split does not express. Supported: full causal attention, a sliding window on "
                            "every layer, padding and packed documents.")
    if config is not None and getattr(config, "attention_dropout", 0.0):
        raise StrategyError(f"{method}: the model has attention_dropout={config.attention_dropout}; attention dropout "
                            "is not supported under a sequence split. Set config.attention_dropout = 0.")


def install(ctx, *, method: str, kind: str, load_balance: bool, causal: bool, ulysses: int = 1) -> None:
    """Give ``ctx`` the split: ``ctx.sequence_split`` (TrainStep splits every batch) and the SDPA routing
    around forward, loss and backward (``ctx.step_contexts``)."""
    cp = ctx.mesh.dims.cp
    if cp == 1:
        ctx.note(f"{method}: cp=1, nothing to split")
        return
    if ctx.sequence_split is not None:
        raise StrategyError(f"{method}: another method already splits the sequence; use one of context_parallel "
                            "and ulysses.")
    model = ctx.model
    check_model(model, method)
    window, every_layer = attention_window(model)
    if window and not every_layer:
        raise StrategyError(f"{method}: the model mixes sliding-window attention (window {window}) with full attention "
                            "layers (config.layer_types); an attention call does not say which layer it is, so the "
                            "split cannot give each its mask. Supported: full causal attention, or a sliding window on "
                            "every layer (Mistral); padding and packed documents on either.")
    old = use_sdpa_attention(model)
    if old is not None:
        ctx.note(f"{method}: attention implementation {old!r} switched to 'sdpa' (the split routes SDPA calls)")
    # groups of their own: FSDP's asynchronous collectives run beside the ring's sends
    group = ctx.mesh.sequence_group(1)[0]
    u = cp if kind == "ulysses" else ulysses
    ring_group, ulysses_group = ctx.mesh.sequence_group(u) if u > 1 else (group, None)
    rank = ctx.mesh["cp"].get_local_rank()
    ctx.sequence_split = SequenceSplitter(group=group, cp=cp, rank=rank, kind=kind, load_balance=load_balance,
                                          ulysses=ulysses, ring_group=ring_group, ulysses_group=ulysses_group,
                                          causal=causal, model=model, window=window,
                                          window_every_layer=every_layer, pipelined=ctx.parts is not None)
    ctx.step_contexts.append(sequence_attention)
    layout = "load-balanced zigzag chunks" if load_balance and kind == "ring" else "contiguous chunks"
    how = ("Ulysses all-to-all" if kind == "ulysses" else "ring attention" if ulysses == 1 else
           f"ring attention over {cp // ulysses} ring ranks x Ulysses all-to-all over {ulysses}")
    ctx.note(f"{method}: every sample's sequence split over cp={cp} ({layout}); attention by {how}; gradients "
             "reduce over dp x cp (FSDP shards over dp_shard x cp)")
