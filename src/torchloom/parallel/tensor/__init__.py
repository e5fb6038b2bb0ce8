"""Tensor parallelism (Megatron-style, on DTensor ``parallelize_module``): style names, per-family plans
and their application. The strategy methods live in ``torchloom.methods.tensor_parallel``."""
from .apply import ResolvedPlan, check_divisible, parallelize_part, resolve_plan
from .plans import FAMILIES, TPPlan, auto_plan, custom_plan, supported_families
from .styles import STYLES, Flags

__all__ = ["FAMILIES", "STYLES", "Flags", "ResolvedPlan", "TPPlan", "auto_plan", "check_divisible", "custom_plan",
           "parallelize_part", "resolve_plan", "supported_families"]
