"""What goes into a checkpoint, and how it is read back without unpickling anything untrusted.

* Model and optimizer tensors go through ``torch.distributed.checkpoint`` (DCP), the model's built with
  ``get_model_state_dict``/``set_model_state_dict`` (plain modules, DDP, FSDP2 ``fully_shard``, ``torch.compile`` and
  activation-checkpoint wrappers; keys are the plain model's FQNs, so a checkpoint reshards to another
  world size or wrapping). ``ZeroRedundancyOptimizer`` is not supported by ``get_state_dict``; it is
  consolidated to rank 0 and stored in the same FQN-keyed layout (see
  :func:`torchloom.checkpoint.trainer_state.encode_tensors`). Other optimizers are encoded by
  :mod:`torchloom.checkpoint.optimizer_state` (DSD loses frozen and stateless parameters' state).
* Small Python state (step, scheduler, dataloader, loss scaler, user ``extra``) is JSON
  (:func:`to_json`/:func:`from_json`).
* RNG states are per-rank ``.pt`` files of tensors/ints only, read with ``torch.load(weights_only=True)``.

Reading safety: DCP's own reader unpickles ``.metadata`` with plain ``pickle`` and loads non-tensor
values with ``torch.load(weights_only=False)``. :class:`SafeFileSystemReader` unpickles ``.metadata`` with an
allow-list of DCP's metadata classes only, and :class:`SafeLoadPlanner` loads non-tensor values with
``weights_only=True``; tensor data is already read with ``weights_only=True`` by DCP.
"""
from __future__ import annotations

import contextlib
import enum
import io
import math
import pickle
import random
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
)

from torchloom.checkpoint.commit import CorruptCheckpointError
from torchloom.errors import CheckpointError

try:  # numpy is optional
    import numpy as np
except ImportError:  # pragma: no cover - numpy is a dev dependency
    np = None  # type: ignore[assignment]

# ------------------------------------------------------------------------------------- key handling
# Wrapper modules add a path component to state-dict keys; the plain model has none of them.
_WRAPPER_CHILD = {
    "DistributedDataParallel": "module",
    "OptimizedModule": "_orig_mod",
    "CheckpointWrapper": "_checkpoint_wrapped_module",
    "FullyShardedDataParallel": "_fsdp_wrapped_module",
}


def wrapper_components(model: nn.Module) -> set[str]:
    """Dotted paths (in ``model``'s own naming) of the children that wrapper modules insert, e.g.
    ``{"module", "module.layers.0._checkpoint_wrapped_module"}`` for DDP around an AC-wrapped block."""
    out = set()
    for name, mod in model.named_modules(remove_duplicate=False):
        child = _WRAPPER_CHILD.get(type(mod).__name__)
        if child is not None and hasattr(mod, child):
            out.add(f"{name}.{child}" if name else child)
    return out


def canonical_key(key: str, components: set[str]) -> str:
    """``key`` with every wrapper-inserted component (see :func:`wrapper_components`) removed."""
    if not components:
        return key
    parts = key.split(".")
    kept = []
    for i, part in enumerate(parts):
        if ".".join(parts[: i + 1]) in components:
            continue
        kept.append(part)
    return ".".join(kept)


def canonical_param_names(model: nn.Module) -> dict[int, list[str]]:
    """``id(param or buffer) -> [canonical FQNs]`` in registration order (tied weights have several)."""
    comps = wrapper_components(model)
    names: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        key = canonical_key(name, comps)
        lst = names.setdefault(id(t), [])
        if key not in lst:
            lst.append(key)
    return names


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Groups of canonical FQNs that share one tensor (e.g. ``[["model.embed_tokens.weight",
    "lm_head.weight"]]`` for a Llama with ``tie_word_embeddings=True``); the first name is the owner."""
    return [v for v in canonical_param_names(model).values() if len(v) > 1]


# ----------------------------------------------------------------------------------- JSON codec
_TAG = "__loom__"


def to_json(obj: Any, where: str = "state") -> Any:
    """Encode plain Python state as JSON-ready data, losslessly: ``dict`` (also with non-str keys), ``list``,
    ``tuple``, ``str``, ``int``, ``float`` (also inf/nan), ``bool``, ``None``, numpy scalars and small
    tensors. Anything else raises :class:`CheckpointError` naming where it was found."""
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        if math.isfinite(obj):
            return obj
        return {_TAG: "float", "v": repr(obj)}
    if isinstance(obj, enum.Enum):
        raise CheckpointError(f"{where} holds an Enum ({obj!r}); store its .value instead")
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj) and _TAG not in obj:
            return {k: to_json(v, f"{where}[{k!r}]") for k, v in obj.items()}
        return {_TAG: "dict", "items": [[to_json(k, f"{where} key"), to_json(v, f"{where}[{k!r}]")] for k, v in obj.items()]}
    if isinstance(obj, list):
        return [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {_TAG: "tuple", "items": [to_json(v, f"{where}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, torch.Tensor):
        if obj.numel() > 65536:
            raise CheckpointError(
                f"{where} holds a tensor of {obj.numel()} elements; large tensors do not belong in the JSON "
                f"trainer state (keep them in a module/optimizer so they go through DCP)"
            )
        if obj.is_complex() or obj.is_quantized or obj.layout != torch.strided:
            raise CheckpointError(f"{where} holds an unsupported tensor ({obj.dtype}, {obj.layout})")
        t = obj.detach().cpu()
        data = t.tolist() if t.dtype != torch.bool else t.to(torch.uint8).tolist()
        return {_TAG: "tensor", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                "data": to_json(data, where)}
    if np is not None and isinstance(obj, np.generic):
        return to_json(obj.item(), where)
    raise CheckpointError(
        f"{where} holds a {type(obj).__module__}.{type(obj).__qualname__}, which torchloom does not store "
        f"(checkpoints never pickle): use dicts/lists of str/int/float/bool/None (or small tensors)"
    )


def from_json(obj: Any) -> Any:
    """Inverse of :func:`to_json`."""
    if isinstance(obj, list):
        return [from_json(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    tag = obj.get(_TAG)
    if tag is None:
        return {k: from_json(v) for k, v in obj.items()}
    if tag == "float":
        return float(obj["v"])
    if tag == "dict":
        return {_hashable(from_json(k)): from_json(v) for k, v in obj["items"]}
    if tag == "tuple":
        return tuple(from_json(v) for v in obj["items"])
    if tag == "tensor":
        dtype = getattr(torch, obj["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"unknown tensor dtype {obj['dtype']!r}")
        data = from_json(obj["data"])
        if dtype == torch.bool:
            return torch.tensor(data, dtype=torch.uint8).to(torch.bool).reshape(obj["shape"])
        return torch.tensor(data, dtype=dtype).reshape(obj["shape"])
    raise ValueError(f"unknown tag {tag!r}")


def _hashable(k: Any) -> Any:
    return tuple(_hashable(x) for x in k) if isinstance(k, list) else k


# ----------------------------------------------------------------------------------------- RNG
def capture_rng() -> dict[str, Any]:
    """This process's RNG states (python ``random``, numpy global, torch CPU, current accelerator) as a
    dict of tensors/ints/floats/str only, loadable with ``torch.load(weights_only=True)``."""
    version, internal, gauss = random.getstate()
    st: dict[str, Any] = {
        "format": 1,
        "python": {"version": int(version), "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss},
        "torch_cpu": torch.get_rng_state(),
    }
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = {"name": str(name), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    from torchloom.utils import default_device

    dev = default_device()
    if dev.type != "cpu":
        mod = torch.get_device_module(dev.type)
        st["accelerator"] = {"type": dev.type, "state": mod.get_rng_state(dev)}
    return st


def restore_rng(st: dict[str, Any]) -> None:
    """Inverse of :func:`capture_rng` (an accelerator state is restored only on the same device type)."""
    py = st["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    torch.set_rng_state(st["torch_cpu"])
    if np is not None and "numpy" in st:
        n = st["numpy"]
        np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"]))
    acc = st.get("accelerator")
    if acc is not None:
        from torchloom.utils import default_device

        dev = default_device()
        if dev.type == acc["type"]:
            torch.get_device_module(dev.type).set_rng_state(acc["state"], dev)


# ------------------------------------------------------------------------------ safe DCP reading
class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` refusing every global outside DCP's metadata vocabulary."""

    _ALLOWED = {
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("pathlib", "Path"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
    }
    _CLASS_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch":
            obj = getattr(torch, name, None)
            if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
                return obj
        if module in self._CLASS_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type):  # dataclasses and enums only, never functions
                return obj
        raise pickle.UnpicklingError(
            f"refusing to unpickle {module}.{name}: not part of torch.distributed.checkpoint metadata"
        )


def read_metadata_safely(path: str | Path) -> Metadata:
    """Read a DCP ``.metadata`` file with the allow-listed unpickler."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except FileNotFoundError as e:
        raise CorruptCheckpointError(f"DCP metadata file {path} is missing") from e
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(f"DCP metadata file {path} is corrupt or unsafe: {type(e).__name__}: {e}") from e
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"DCP metadata file {path} does not hold DCP Metadata (got {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` that never runs arbitrary pickles and names the file a read failed on."""

    def __init__(self, path: str | Path, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._current_file: str | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_metadata_safely(self._get_metadata_path(kwargs.get("rank")))
        from torch.distributed.checkpoint.metadata import StorageMeta

        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _slice_file(self, file, sinfo):  # noqa: ANN001 - DCP internal signature
        self._current_file = str(Path(self.path) / sinfo.relative_path)
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):  # noqa: ANN001 - DCP signature
        self._current_file = None
        try:
            return super().read_data(plan, planner)
        except Exception as e:  # noqa: BLE001
            where = self._current_file or f"a file of {self.path}"
            detail = str(e) if isinstance(e, CheckpointError) else f"{type(e).__name__}: {short_error(e)}"
            raise CorruptCheckpointError(f"checkpoint file {where} is corrupt or truncated: {detail}") from e


def short_error(e: BaseException) -> str:
    """The informative line of an exception (torch's weights-only errors are paragraphs)."""
    text = str(e)
    if "WeightsUnpickler error:" in text:
        return "WeightsUnpickler error: " + text.split("WeightsUnpickler error:", 1)[1].strip().split("\n")[0]
    return text.strip().split("\n")[0][:500]


def _load_bytes_safely(planner: DefaultLoadPlanner, read_item: Any, value: io.BytesIO) -> None:
    from torch.distributed.checkpoint._traverse import set_element

    fqn = read_item.dest_index.fqn
    try:
        obj = torch.load(value, weights_only=True, map_location="cpu")
    except Exception as e:  # noqa: BLE001
        raise CorruptCheckpointError(
            f"its value {fqn!r} does not load with torch.load(weights_only=True): {short_error(e)}"
        ) from e
    if planner.flatten_state_dict:
        set_element(planner.original_state_dict, planner.mappings[fqn], obj)
    else:
        planner.state_dict[fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor values with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value):  # noqa: ANN001
        _load_bytes_safely(self, read_item, value)


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads every entry (or those under ``keys``) of a checkpoint into an empty dict, safely."""

    def load_bytes(self, read_item, value):  # noqa: ANN001
        _load_bytes_safely(self, read_item, value)


def unwrap_checkpoint_exception(e: BaseException, ckpt_dir: Path, action: str) -> CheckpointError:
    """Turn DCP's ``CheckpointException`` (a BaseException listing per-rank failures) into a
    :class:`CheckpointError` carrying the first root-cause message."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        rank, pair = sorted(failures.items())[0]
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, CheckpointError):
            return type(inner)(f"{inner} (rank {rank})")
        return CheckpointError(f"{action} checkpoint {ckpt_dir} failed on rank {rank}: {type(inner).__name__}: {inner}")
    if isinstance(e, CheckpointError):
        return e
    return CheckpointError(f"{action} checkpoint {ckpt_dir} failed: {type(e).__name__}: {e}")


# -------------------------------------------------------------------------- model/optimizer state
def is_zero_optimizer(optimizer: Any) -> bool:
    """Whether ``optimizer`` is ``torch.distributed.optim.ZeroRedundancyOptimizer``."""
    try:
        from torch.distributed.optim import ZeroRedundancyOptimizer
    except ImportError:  # pragma: no cover
        return False
    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _optimizers(optimizer: Any) -> tuple[torch.optim.Optimizer, ...]:
    if optimizer is None:
        return ()
    if isinstance(optimizer, (list, tuple)):
        opts = tuple(optimizer)
    else:
        opts = (optimizer,)
    if any(is_zero_optimizer(o) for o in opts) and len(opts) > 1:
        raise CheckpointError("a ZeroRedundancyOptimizer must be the only optimizer passed to checkpoint save/load")
    return opts


def _param_fqn(model: nn.Module) -> dict[int, str]:
    return {pid: names[0] for pid, names in canonical_param_names(model).items()}


def _zero_state_to_fqn(model: nn.Module, zero: Any) -> dict[str, Any]:
    """A consolidated ``ZeroRedundancyOptimizer.state_dict()`` (integer param ids) -> the FQN-keyed layout
    ``get_optimizer_state_dict`` produces for a plain optimizer, so both kinds of checkpoint interchange."""
    sd = zero.state_dict()
    fqn_of = _param_fqn(model)
    idx_to_fqn: dict[int, str] = {}
    i = 0
    for group in zero.param_groups:
        for p in group["params"]:
            if id(p) not in fqn_of:
                raise CheckpointError("ZeroRedundancyOptimizer holds a parameter that is not in the model being saved")
            idx_to_fqn[i] = fqn_of[id(p)]
            i += 1
    state = {idx_to_fqn[k]: v for k, v in sd["state"].items() if v is not None}
    groups = []
    for g in sd["param_groups"]:
        g = dict(g)
        g["params"] = [idx_to_fqn[k] for k in g["params"]]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def _zero_state_from_fqn(model: nn.Module, zero: Any, osd: dict[str, Any]) -> dict[str, Any]:
    fqn_of = _param_fqn(model)
    fqn_to_idx: dict[str, int] = {}
    i = 0
    for group in zero.param_groups:
        for p in group["params"]:
            fqn_to_idx[fqn_of[id(p)]] = i
            i += 1
    missing = sorted(set(fqn_to_idx) - set().union(*[set(g["params"]) for g in osd["param_groups"]]))
    if missing:
        raise CheckpointError(f"the checkpoint's optimizer has no parameter group entry for {missing[:5]}")
    state = {fqn_to_idx[k]: v for k, v in osd.get("state", {}).items() if k in fqn_to_idx}
    groups = []
    for g in osd["param_groups"]:
        g = dict(g)
        g["params"] = [fqn_to_idx[k] for k in g["params"] if k in fqn_to_idx]
        groups.append(g)
    return {"state": state, "param_groups": groups}


def flat_optimizer(model: nn.Module) -> bool:
    """Whether ``model``'s optimizer state is stored per parameter name (``param_groups.<fqn>.lr``) rather than
    per group index. Pipelined models need it: each rank's group 0 holds other parameters, and per-index
    entries saved by several ranks would overwrite each other (torchtitan flattens for the same reason)."""
    return _holds_part_of_model(model)


def _holds_part_of_model(model: nn.Module) -> bool:
    """True for a pipelined model (each rank holds some stages' parameters under their original names)."""
    from torchloom.parallel.pipeline.model import PipelinedModel

    return isinstance(model, PipelinedModel)


def _load_everything(ckpt_dir: Path, key: str, *, no_dist: bool) -> dict[str, Any]:
    """Every entry under top-level ``key`` of a DCP checkpoint, unsharded (built from its metadata).

    Uses the private ``_load_state_dict`` like ``format_utils.dcp_to_torch_save`` does: the public
    ``dcp.load`` only fills keys already present in the target dict, and here the target starts empty.
    """
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    full: dict[str, Any] = {}
    with quiet_single_process():
        _load_state_dict(full, storage_reader=SafeFileSystemReader(ckpt_dir),
                         planner=SafeEmptyLoadPlanner(keys={key}), no_dist=no_dist)
    return full


@contextlib.contextmanager
def quiet_single_process():
    """Silence DCP's "assuming the intent is to save/load in a single process" warning (intended here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def read_model_tensors(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, unsharded, on CPU, without a process group."""
    import torch.distributed.checkpoint as dcp

    try:
        full = _load_everything(ckpt_dir, "model", no_dist=True)
    except (Exception, dcp.api.CheckpointException) as e:
        raise unwrap_checkpoint_exception(e, ckpt_dir, "reading") from e
    model = full.get("model")
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds no model tensors")
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full (unsharded) CPU state dict of ``model`` on rank 0 ({} on other ranks). Collective."""
    if dist.is_available() and dist.is_initialized():
        sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return {}
    else:
        sd = get_model_state_dict(model)
    comps = wrapper_components(model)
    out = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        if hasattr(v, "full_tensor"):  # a DTensor that was not gathered (should not happen)
            v = v.full_tensor()
        out[canonical_key(k, comps)] = v.detach().cpu()
    return out

