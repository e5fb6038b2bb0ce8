"""Planning memos keyed on a model: a search validates thousands of candidates against one model."""
from __future__ import annotations

import weakref

from ..errors import StrategyError

_MODEL_CHECKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> {key: None | StrategyError}


def memo_model_check(model, key: tuple, check) -> None:
    """Run ``check()`` once per (``model``, ``key``) and replay its outcome: a search validates thousands of
    candidates that differ only in what the check does not read (walking an 80-layer model for the
    tensor-parallel plan or the pipeline stages takes 0.05-0.1 s each). ``key`` must hold everything the
    check reads besides the model's structure (degrees, configs). Only for planning: a model changed in place
    afterwards keeps its old answers (``auto_accelerate`` never goes through here).

    Raises:
        StrategyError: the check's own, re-raised each time.
    """
    done = _MODEL_CHECKS.setdefault(model, {})
    if key not in done:
        try:
            check()
            done[key] = None
        except StrategyError as e:
            done[key] = e
    if done[key] is not None:
        raise StrategyError(str(done[key]))
