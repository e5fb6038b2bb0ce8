"""The *experts module* protocol: the seam between routing (the MoE block) and expert computation, the one
``expert_parallel`` shards. It is the shape Hugging Face's current MoE models use (``MixtralExperts``,
``Qwen2MoeExperts``, ``Qwen3MoeExperts``, ``OlmoeExperts``... in transformers 5) and torchloom's own
:class:`torchloom.moe.GroupedExperts`:

* ``module.num_experts`` (int, ``E``);
* every *direct* parameter is fused over experts: a tensor whose dim 0 is ``E`` (``gate_up_proj`` ``[E, 2I, H]``,
  ``down_proj`` ``[E, H, I]``, or ``w1/w2/w3``; biases ``[E, ...]`` allowed); no child module holds parameters;
* ``forward(hidden [T, H], top_k_index [T, k] int64, top_k_weights [T, k]) -> [T, H]``: token ``t`` gets
  ``sum_j top_k_weights[t, j] * expert_{top_k_index[t, j]}(hidden[t])``; an index equal to ``E`` (:func:`dropped`)
  means "no expert" (a token dropped by the capacity limit) and contributes nothing.

Expert parallelism keeps the module's own ``forward`` for the math: it calls it on the tokens received by
this rank with the local expert shard swapped in (``E_local = E / ep`` rows of each parameter), local
expert indices in ``[0, E_local)`` and ``num_experts`` set to ``E_local`` for the duration of the call (HF's
``grouped_mm`` implementation sizes its groups from it).
"""
from __future__ import annotations

import inspect

from torch import nn


def is_experts_module(module: nn.Module) -> bool:
    """True when ``module`` follows the protocol above (checked structurally: ``num_experts`` and direct
    parameters all of leading size ``num_experts``, at least one of them, no parameters in children, and a
    ``forward`` taking three positional arguments: a router has ``num_experts`` and an ``[E, H]`` weight too,
    but takes only the hidden states)."""
    e = getattr(module, "num_experts", None)
    if isinstance(e, bool) or not isinstance(e, int) or e < 1:
        return False
    own = list(module.parameters(recurse=False))
    if not own or any(p.dim() < 2 or p.shape[0] != e for p in own):
        return False
    if any(True for c in module.children() for _ in c.parameters()):
        return False
    return _takes_three(type(module).forward)


def _takes_three(forward) -> bool:
    try:
        params = list(inspect.signature(forward).parameters.values())[1:]  # without self
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def find_experts_modules(model: nn.Module, class_names: list[str] | None = None) -> list[tuple[str, nn.Module]]:
    """``(qualname, module)`` of every experts module in ``model`` (model order). With ``class_names``, only
    modules of those classes, each required to follow the protocol.

    Raises:
        torchloom.errors.StrategyError: a named class is absent from the model, or present but not following
            the protocol (the message says which requirement fails).
    """
    from ..errors import StrategyError

    if class_names is None:
        return [(q, m) for q, m in model.named_modules() if is_experts_module(m)]
    found = [(q, m) for q, m in model.named_modules() if type(m).__name__ in class_names]
    missing = set(class_names) - {type(m).__name__ for _, m in found}
    if missing:
        present = sorted({type(m).__name__ for _, m in model.named_modules() if is_experts_module(m)})
        raise StrategyError(f"experts classes {sorted(missing)} are not in the model; experts modules found: "
                            f"{present or 'none'}.")
    for q, m in found:
        if not is_experts_module(m):
            raise StrategyError(
                f"{q} ({type(m).__name__}) is not an experts module: it needs an int `num_experts` and direct "
                "parameters whose dim 0 is num_experts (fused experts), with forward(hidden [T, H], "
                "top_k_index [T, k], top_k_weights [T, k]); see torchloom.moe.protocol.")
    return found


def dropped(module: nn.Module) -> int:
    """The index value meaning "no expert" in ``top_k_index`` (``num_experts``, as Hugging Face uses it)."""
    return int(module.num_experts)
