"""Optimizers from ATorch's papers: AGD (NeurIPS 2023) and WSAM (KDD 2023)."""
from .agd import AGD
from .wsam import WSAM, WeightedSAM  # WeightedSAM: ATorch's name for WSAM

__all__ = ["AGD", "WSAM"]
