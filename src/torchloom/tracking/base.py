"""The tracker interface, value checks shared by every back end, and the missing-package error.

A tracker receives already-checked values: a ``dict[str, int | float]`` and an ``int`` step ``>= 0``. The checks
live here, once, so every back end refuses the same things with the same message (a tensor with more than one
element, a string, a bool step, a negative step) instead of each library failing in its own way or, worse,
logging something else than what was meant (``add_scalar`` of a 1-element tensor works, of a 3-element one
raises deep inside TensorBoard; W&B accepts anything and logs a histogram).
"""
from __future__ import annotations

import importlib
import numbers
import operator
from types import ModuleType
from typing import Any, Mapping

import torch

HF_EXTRA = "pip install torchloom[hf]"


class Tracker:
    """Base class of an experiment tracker. Subclass it and override :meth:`log` (and, if useful,
    :meth:`store_init_configuration` and :meth:`finish`); pass an instance in ``log_with``.

    torchloom calls a tracker on the global main process only (rank 0), with values checked and converted by
    :func:`scalar_values` (python ``int``/``float``, keys ``str``) and a step checked by :func:`check_step`.

    Attributes:
        name: the name ``res.get_tracker(name)`` finds it by (the built-ins: ``"jsonl"``, ``"tensorboard"``,
            ``"mlflow"``, ``"wandb"``).
    """

    name: str = "custom"

    def store_init_configuration(self, config: Mapping[str, Any]) -> None:
        """Record the run's hyper-parameters (``init_trackers(config=...)``); called once, before any log."""

    def log(self, values: dict[str, int | float], step: int) -> None:
        """Record ``values`` at ``step``."""
        raise NotImplementedError(f"{type(self).__name__} must implement log(values, step)")

    def finish(self) -> None:
        """Flush and close (``res.end_training()``)."""


def scalar_values(values: Mapping[str, Any], convert: bool = True) -> dict[str, int | float]:
    """Check that ``values`` maps ``str`` keys to scalars and return them as python numbers.

    A scalar is a python ``int``/``float`` (``bool`` becomes ``int``), a numpy scalar, or a tensor / numpy array
    with zero dims (``.item()``; a CUDA tensor syncs). ``convert=False`` only checks (no ``.item()``: the ranks
    that do not log need no device sync) and returns ``{}``.

    Raises:
        TypeError: ``values`` is not a mapping, a key is not a ``str``, or a value (named by its key) is not a
            scalar: a tensor with dims (log ``t.item()`` of a 1-element tensor, or a reduction such as
            ``t.mean()``), a string, None, a complex number.
    """
    if not isinstance(values, Mapping):
        raise TypeError(f"log() takes a dict of scalars, got a {type(values).__name__}.")
    out: dict[str, int | float] = {}
    for key, v in values.items():
        if not isinstance(key, str):
            raise TypeError(f"log() keys must be str, got {key!r} ({type(key).__name__}).")
        if torch.is_tensor(v) or _is_numpy_array(v):
            complex_ = v.dtype.is_complex if torch.is_tensor(v) else v.dtype.kind == "c"
            if v.ndim != 0 or complex_:
                raise TypeError(f"log() value {key!r} is not a real scalar: a {type(v).__name__} of shape "
                                f"{tuple(v.shape)} and dtype {v.dtype}; log a 0-dim value (e.g. t.mean(), or "
                                "t.item() of a 1-element tensor) or one key per element.")
            if convert:
                out[key] = v.item()
            continue
        if isinstance(v, numbers.Real):
            if convert:
                out[key] = int(v) if isinstance(v, numbers.Integral) else float(v)
            continue
        raise TypeError(f"log() value {key!r} is not a scalar number: got {v!r} ({type(v).__name__}); trackers "
                        "record python numbers or 0-dim tensors.")
    return out


def check_step(step: Any) -> int:
    """``step`` as an ``int >= 0`` (python or numpy integer, or a 0-dim integer tensor).

    Raises:
        TypeError: not an integer (a float, a bool, None).
        ValueError: negative.
    """
    if torch.is_tensor(step):
        if step.ndim != 0 or step.is_floating_point() or step.dtype == torch.bool:
            raise TypeError(f"log() step must be an int >= 0, got a tensor of shape {tuple(step.shape)} and "
                            f"dtype {step.dtype}.")
        step = step.item()
    if isinstance(step, bool):
        raise TypeError(f"log() step must be an int >= 0, got {step!r}.")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"log() step must be an int >= 0, got {step!r} ({type(step).__name__}).") from None
    if step < 0:
        raise ValueError(f"log() step must be >= 0, got {step}.")
    return step


def require(module: str, tracker: str, package: str | None = None) -> ModuleType:
    """Import ``module`` for the ``tracker`` back end, or raise an ImportError that says how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise _missing(module, tracker, package, str(e)) from e


def check_importable(module: str, tracker: str, package: str | None = None) -> None:
    """Raise :func:`require`'s ImportError if ``module`` cannot be found, without importing it (cheap on every
    rank, while only the main process builds the tracker)."""
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise _missing(module, tracker, package, f"no module named {module!r}")


def _missing(module: str, tracker: str, package: str | None, why: str) -> ImportError:
    pkg = package or module
    return ImportError(f"the {tracker!r} tracker needs the {pkg!r} package, which could not be imported ({why}). "
                       f"Install the optional dependencies with `{HF_EXTRA}` (or `pip install {pkg}`), or "
                       "choose another back end in log_with=.")


def _is_numpy_array(v: Any) -> bool:
    return type(v).__module__ == "numpy" and hasattr(v, "ndim") and hasattr(v, "dtype")
