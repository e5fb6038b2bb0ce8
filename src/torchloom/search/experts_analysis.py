"""What the model analysis records about a Mixture-of-Experts model, and how it traces one.

* :func:`experts_info`: the experts modules (:func:`torchloom.moe.protocol.find_experts_modules`), ``E``,
  ``top_k``, the expert parameter counts and the routed FLOPs, priced for **balanced routing** (every expert
  gets ``tokens * top_k / E`` rows): a fake-tensor trace cannot know where tokens go.
* :func:`moe_trace`: the settings the fake-tensor trace of such a model needs, for its duration only (the
  model is the same afterwards):

  - Hugging Face experts run their ``grouped_mm`` implementation: the eager one loops over the experts hit
    (``nonzero``: data-dependent shapes fake tensors cannot give); the grouped GEMM is traced with balanced
    groups (:mod:`torchloom.search.op_trace`), the same assumption as above;
  - ``output_router_logits`` off: the analysis traces the non-block rest with the blocks replaced by
    pass-throughs, so no router runs and Hugging Face's load-balancing loss would index an empty tuple.
    That loss costs ``O(tokens x E)`` elementwise work, left out of the trace (noted).
"""
from __future__ import annotations

import warnings
from contextlib import contextmanager

from torch import nn

from ..moe.protocol import find_experts_modules
from .model_info import ExpertsInfo

#: config attribute spellings of the routed experts per token (first found wins)
_TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "moe_topk")


def experts_info(model: nn.Module, n_params: int, seq_len: int, hidden_size: int | None,
                 notes: list[str]) -> ExpertsInfo | None:
    """The :class:`ExpertsInfo` of ``model`` (None when it has no experts module).

    Args:
        n_params: the model's parameter elements (tied counted once): active = dense + top_k/E of experts.
        seq_len: tokens per sample the routed FLOPs are priced at.
        hidden_size: the model's hidden width (default: the experts' input width, dim -1 of the first
            3-D parameter).
        notes: the analysis notes; the balanced-routing assumption (and a guessed ``top_k``) is added.

    Raises:
        ValueError: experts modules with different ``num_experts`` (expert parallelism shards one ``E``).
    """
    found = find_experts_modules(model)
    if not found:
        return None
    counts = {int(m.num_experts) for _, m in found}
    if len(counts) > 1:
        raise ValueError(f"the experts modules have different num_experts {sorted(counts)} "
                         f"({', '.join(q for q, _ in found)}): the planner needs one expert count per model.")
    e = counts.pop()
    seen: set[int] = set()
    params = per_token_matrix = 0
    for _, m in found:
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += p.numel()
            if p.dim() >= 3:  # a fused weight matrix [E, out, in]: 2 FLOPs per element per routed token
                per_token_matrix += p.numel() // e
    top_k = _top_k(model, found, notes)
    if hidden_size is None:
        w = next((p for _, m in found for p in m.parameters(recurse=False) if p.dim() >= 3), None)
        hidden_size = int(w.shape[-1]) if w is not None else 0
    layers = len(found)
    per_expert = params // (layers * e)
    active = n_params - params + params * min(top_k, e) // e
    text = (f"experts: {layers} MoE layers x {e} experts, top_k={top_k}; expert FLOPs priced for balanced "
            f"routing (tokens x top_k / E rows per expert)")
    if text not in notes:
        notes.append(text)
    return ExpertsInfo(modules=[q for q, _ in found], num_experts=e, top_k=top_k, params=params,
                       params_per_expert=per_expert, active_params=active,
                       routed_flops_fwd=2.0 * seq_len * top_k * per_token_matrix, hidden_size=int(hidden_size))


def _top_k(model: nn.Module, found, notes: list[str]) -> int:
    """Routed experts per token: a ``top_k`` of the MoE layer or its router (the experts module's parent and
    its children), else the model config's; 1 with a warning when none says."""
    mods = dict(model.named_modules())
    qual = found[0][0]
    parent = mods.get(qual.rpartition(".")[0]) if "." in qual else model
    places = [parent, *(parent.children() if parent is not None else ())]
    for m in places:
        for attr in _TOP_K_ATTRS:
            k = getattr(m, attr, None)
            if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
                return k
    cfg = getattr(model, "config", None)
    for attr in _TOP_K_ATTRS:
        k = getattr(cfg, attr, None)
        if isinstance(k, int) and not isinstance(k, bool) and k >= 1:
            return k
    msg = (f"experts: no top_k found on {qual}'s MoE layer, its router or the model config; assumed top_k=1 "
           "(give the router a `top_k` attribute to plan with the real one)")
    warnings.warn(msg, stacklevel=3)
    notes.append(msg)
    return 1


@contextmanager
def moe_trace(model: nn.Module, notes: list[str]):
    """For the duration: Hugging Face experts on ``grouped_mm`` and ``output_router_logits`` off (see the
    module docstring); everything restored after, also on error."""
    restore = []
    for _, m in find_experts_modules(model):
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_experts_implementation", None) if cfg is not None else None
        if cfg is not None and impl not in (None, "grouped_mm") and hasattr(type(m), "forward"):
            restore.append((cfg, "_experts_implementation", impl))
            cfg._experts_implementation = "grouped_mm"
    cfg = getattr(model, "config", None)
    if getattr(cfg, "output_router_logits", False) is True:
        restore.append((cfg, "output_router_logits", True))
        cfg.output_router_logits = False
        text = "experts: the router's load-balancing loss (O(tokens x E) elementwise) is not traced"
        if text not in notes:
            notes.append(text)
    if any(a == "_experts_implementation" for _, a, _ in restore):
        text = "experts: traced with the grouped_mm experts implementation (the eager loop is data-dependent)"
        if text not in notes:
            notes.append(text)
    try:
        yield
    finally:
        for obj, attr, value in reversed(restore):
            setattr(obj, attr, value)
