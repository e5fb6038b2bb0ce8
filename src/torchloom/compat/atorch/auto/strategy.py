"""ATorch's ``atorch.auto.strategy.Strategy``: a list of ``(name, config, tunable)`` triples.

Same methods and semantics as ATorch's class (``add_opt``, ``opt_names``, ``is_tunable``,
``get_parallel_mode``, ``reset_config``, ``set_tunable_value``, ``adjust_data_parallel``,
``remove_distributed_method``, ``convert_strategy_to_easydl_format``, ``__eq__``...), written on torchloom's
side. Pickling keeps the plain ``opt_list`` only; loading a pickle goes through
:func:`torchloom.compat.atorch.strategy_io.restricted_loads` (never plain ``pickle.loads``).
"""
from __future__ import annotations

from typing import Any

#: ATorch methods its ``OptimizationLibrary`` marks ``is_distributed=True``: dropped in one process
#: (``fsdp``/``fsdp2`` with ``cpu_offload=True`` are kept, as ATorch's ``FSDPOptimization.distributed_only``).
DISTRIBUTED_ONLY = ("zero1", "zero2", "fsdp", "fsdp2", "auto_ddp", "tensor_parallel", "pipeline_parallel",
                    "mixed_parallel")
#: ATorch's ``SEMIAUTO_STRATEGIES``: tunable even when given with a config.
SEMIAUTO_STRATEGIES = ("tensor_parallel", "mixed_parallel", "pipeline_parallel")


def distributed_only(name: str, config: Any) -> bool:
    """ATorch's ``opt_lib[name].distributed_only(config)``."""
    if name in ("fsdp", "fsdp2") and isinstance(config, dict) and config.get("cpu_offload", False) is True:
        return False
    return name in DISTRIBUTED_ONLY


class Strategy:
    """ATorch's acceleration strategy: ``opt_list`` is a list of ``(method_name, config, tunable)``.

    Args:
        opt_list: the triples (None: empty). Items are kept as given, like ATorch's class; they are
            checked when the strategy is used (:func:`torchloom.compat.atorch.auto.accelerate.auto_accelerate`).
    """

    def __init__(self, opt_list=None):
        self.opt_list = [] if opt_list is None else opt_list

    def __len__(self):
        return len(self.opt_list)

    def __getitem__(self, idx):
        return self.opt_list[idx]

    def __setitem__(self, idx, value):
        self.opt_list[idx] = value

    def __iter__(self):
        return iter(self.opt_list)

    def add_opt(self, opt):
        """Append one ``(name, config, tunable)`` triple."""
        self.opt_list.append(opt)

    def remove_opt(self, name):
        """Remove every item named ``name``; return True if one was removed."""
        before = len(self.opt_list)
        self.opt_list = [o for o in self.opt_list if o[0] != name]
        return len(self.opt_list) != before

    def opt_names(self):
        """The method names, in order."""
        return [opt[0] for opt in self.opt_list]

    def is_tunable(self):
        """True if any item is tunable."""
        return any(item[2] for item in self.opt_list)

    def get_parallel_mode(self):
        """``(found, config)`` of the ``parallel_mode`` item."""
        for item in self.opt_list:
            if item[0] == "parallel_mode":
                return True, item[1]
        return False, None

    def reset_config(self):
        """Config to None and tunable to True for every item except ``parallel_mode`` (ATorch's finetune)."""
        for idx, item in enumerate(self.opt_list):
            if item[1] is not None and item[0] != "parallel_mode":
                self.opt_list[idx] = (item[0], None, True)

    def set_tunable_value(self, opt_lib=None):
        """Tunable None -> False when a config is given, else the method's own tunability (ATorch: only
        the semi-automatic methods are tunable). ``opt_lib`` is accepted for ATorch's signature; an
        object with ``[name].is_tunable`` is used when given."""
        for idx, item in enumerate(self.opt_list):
            if item[2] is None:
                if item[1] is not None:
                    tunable = False
                elif opt_lib is not None and opt_lib[item[0]] is not None:
                    tunable = opt_lib[item[0]].is_tunable
                else:
                    tunable = item[0] in SEMIAUTO_STRATEGIES
                self.opt_list[idx] = (item[0], item[1], tunable)

    def adjust_data_parallel(self, data_parallel_size):
        """Set the ``data`` degree of ``parallel_mode`` to ``data_parallel_size`` (None config: data only)."""
        for idx, item in enumerate(self.opt_list):
            if item[0] == "parallel_mode":
                if item[1] is not None:
                    if len(item[1]) > 2 and item[1][2]:  # support_multi_parallel_instance
                        break
                    pg_list = [(name, data_parallel_size if name == "data" else size) for name, size in item[1][0]]
                    self.opt_list[idx] = (item[0], (pg_list, item[1][1]), False)
                else:
                    self.opt_list[idx] = (item[0], ([("data", data_parallel_size)], None), False)
                break

    def remove_distributed_method(self, opt_lib=None):
        """Remove the methods that only make sense with several processes; return their names or None.
        ``opt_lib`` is accepted for ATorch's signature; an object with ``[name].distributed_only(config)``
        is used when given."""
        def is_dist(item):
            if opt_lib is not None and opt_lib[item[0]] is not None:
                return opt_lib[item[0]].distributed_only(item[1])
            return distributed_only(item[0], item[1])

        removed = [item for item in self.opt_list if is_dist(item)]
        if not removed:
            return None
        for item in removed:
            self.opt_list.remove(item)
        return [item[0] for item in removed]

    def convert_strategy_to_easydl_format(self):
        """ATorch's engine format ``[(name, serialised config, tunable)]``. ATorch pickles each config; the
        configs here are serialised as JSON text (:func:`strategy_io.encode_value`), never pickled."""
        import json

        from ..strategy_io import encode_value

        return [(item[0], json.dumps(encode_value(item[1])), item[2]) for item in self.opt_list]

    def __reduce__(self):
        # only the plain list travels; the restricted unpickler admits this class and plain values
        return (Strategy, (list(self.opt_list),))

    def __setstate__(self, state):
        # ATorch's pickles (protocol >= 2) rebuild the object with NEWOBJ, then BUILD with its __dict__
        if not isinstance(state, dict) or set(state) != {"opt_list"} or not isinstance(state["opt_list"], list):
            raise ValueError(f"a pickled ATorch Strategy must carry exactly {{'opt_list': [...]}}; got {state!r:.200}")
        for item in state["opt_list"]:
            if not isinstance(item, (tuple, list)) or len(item) != 3 or not isinstance(item[0], str):
                raise ValueError(f"a Strategy item must be a (name, config, tunable) triple; got {item!r:.200}")
        self.opt_list = state["opt_list"]

    def __str__(self):
        output = f"Acceleration strategy has {len(self)} optimization methods"
        for idx, item in enumerate(self.opt_list):
            output += f"\n[{idx}] {item[0]}"
            if item[0] == "parallel_mode" and item[1] is not None:
                output += f" : {item[1][0]}"
        return output

    def __repr__(self):
        return f"Strategy({self.opt_list!r})"

    def __eq__(self, other):
        try:
            if len(self) != len(other):
                return False
            return all(item == other[idx] for idx, item in enumerate(self.opt_list))
        except TypeError:
            return NotImplemented

    __hash__ = None  # mutable, like ATorch's (which defines __eq__ only)
