"""What the model analysis records about a Mixture-of-Experts model, and how it traces one.

* :func:`experts_info`: the experts modules (:func:`torchloom.moe.protocol.find_experts_modules`), ``E``,
  ``top_k``, the expert parameter counts and the routed FLOPs, priced for **balanced routing** (every expert
  gets ``tokens * top_k / E`` rows): a fake-tensor trace cannot know where tokens go.
* :func:`moe_trace`: the settings the fake-tensor trace of such a model needs, for its duration only (the
  model is the same afterwards):

  - Hugging Face experts run their ``grouped_mm`` implementation: the eager one loops over the experts hit
    (``nonzero``: data-dependent shapes fake tensors cannot give); the grouped GEMM is traced with balanced
    groups (:mod:`torchloom.cost.op_trace`), the same assumption as above;
  - every other experts module (``torchloom.moe.GroupedExperts``: ``bincount(...).tolist()`` and a split per
    expert) runs :func:`balanced_forward` instead: the dispatch gather, its fused weights as batched GEMMs
    over ``E`` equal groups (a gated pair ``silu(a) * b`` where two first-layer weights or one of twice the
    next layer's width say so), the weighting and the sum over ``k``: the same FLOPs, and activations of
    the same shapes, as the real forward under balanced routing;
  - ``torchloom.moe.MoE`` skips its per-call load bookkeeping (``bincount`` of the routed tokens into
    module attributes: data-dependent, and it would store fake tensors on the model);
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


def balanced_forward(module: nn.Module):
    """A stand-in ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]`` for an experts
    module whose own forward has data-dependent shapes: every expert gets ``ceil(T k / E)`` rows.

    The module's 3-D parameters ``[E, out, in]`` (registration order) are applied as batched GEMMs: those
    taking width ``H`` form the first layer (two of equal width combine as ``silu(a) * b``; one of twice the
    next weight's input width is split in two and combined so, as Hugging Face's ``gate_up_proj``), the
    rest chain from there; 2-D ``[E, n]`` biases are added where their width matches.

    Raises:
        ValueError: the weights do not chain from width ``H`` back to ``H`` (the message names the module
            and its shapes; give it a forward without data-dependent shapes to analyse it).
    """
    import torch
    import torch.nn.functional as F

    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    biases = [p for p in module.parameters(recurse=False) if p.dim() == 2]
    shapes = [tuple(p.shape) for p in module.parameters(recurse=False)]

    def fail(h):
        return ValueError(f"cannot price the experts module {type(module).__name__} (parameters {shapes}): its "
                          f"fused [E, out, in] weights do not chain from the hidden width {h} back to {h}. Give it "
                          "a forward without data-dependent shapes (grouped GEMMs) to analyse it.")

    def forward(hidden, top_k_index, top_k_weights, *args, **kwargs):
        t, k = top_k_index.shape
        h = hidden.shape[-1]
        if not weights:
            raise fail(h)
        e, rows = weights[0].shape[0], t * k
        m = -(-rows // e)
        x = hidden.repeat_interleave(k, dim=0)  # the dispatch: one row per (token, choice)
        if m * e > rows:
            x = torch.cat([x, x.new_zeros(m * e - rows, h)])
        z = x.reshape(e, m, h)
        first = [w for w in weights if w.shape[2] == h][:2]
        if not first or weights[: len(first)] != first:
            raise fail(h)
        rest = weights[len(first):]
        outs = [_bias(torch.bmm(z, w.transpose(1, 2)), biases) for w in first]
        need = rest[0].shape[2] if rest else None
        if len(outs) == 2 and outs[0].shape[-1] == outs[1].shape[-1]:
            y = F.silu(outs[0]) * outs[1]
        elif need is not None and outs[0].shape[-1] == 2 * need:
            a, b = outs[0].chunk(2, dim=-1)
            y = F.silu(a) * b
        else:
            y = F.silu(outs[0]) if rest else outs[0]
        for w in rest:
            if w.shape[2] != y.shape[-1]:
                raise fail(h)
            y = _bias(torch.bmm(y, w.transpose(1, 2)), biases)
        if y.shape[-1] != h:
            raise fail(h)
        y = y.reshape(e * m, h)[:rows] * top_k_weights.reshape(-1, 1).to(y.dtype)
        return y.reshape(t, k, h).sum(dim=1).to(hidden.dtype)

    return forward


def _bias(y, biases):
    b = next((b for b in biases if b.shape[-1] == y.shape[-1]), None)
    return y if b is None else y + b.unsqueeze(1).to(y.dtype)


def _is_torchloom_moe(module: nn.Module) -> bool:
    from ..moe.layer import MoE

    return isinstance(module, MoE)


@contextmanager
def moe_trace(model: nn.Module, notes: list[str]):
    """For the duration: Hugging Face experts on ``grouped_mm``, other experts modules on
    :func:`balanced_forward`, ``torchloom.moe.MoE`` without its load bookkeeping and ``output_router_logits``
    off (see the module docstring); everything restored after, also on error."""
    restore, stand_ins = [], []
    for q, m in find_experts_modules(model):
        cfg = getattr(m, "config", None)
        impl = getattr(cfg, "_experts_implementation", None) if cfg is not None else None
        if cfg is not None and impl not in (None, "grouped_mm") and hasattr(type(m), "forward"):
            restore.append((cfg, "_experts_implementation", impl))
            cfg._experts_implementation = "grouped_mm"
        elif impl is None and "forward" not in m.__dict__:
            m.forward = balanced_forward(m)
            stand_ins.append((m, "forward"))
    for m in model.modules():
        if _is_torchloom_moe(m) and "_record" not in m.__dict__:
            m._record = lambda *args, **kwargs: None
            stand_ins.append((m, "_record"))
    if any(a == "forward" for _, a in stand_ins):
        names = sorted({type(m).__name__ for m, a in stand_ins if a == "forward"})
        text = (f"experts: {', '.join(names)} traced with a balanced grouped-GEMM stand-in (their forward's "
                "shapes depend on the routing)")
        if text not in notes:
            notes.append(text)
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
        for mod, attr in stand_ins:
            delattr(mod, attr)
