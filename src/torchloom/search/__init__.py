"""Automatic strategy search (``strategy="auto"``, ``loom plan``): model analysis, hardware calibration, the
cost model, the search space, the search with confirming runs, and plan files. See docs/search.md.

The data types most callers need are re-exported here; the search itself is
:func:`torchloom.search.search.search` (not re-exported: the name would hide the submodule).
"""
from .candidate import Candidate, Prediction, StepShape
from .options import SearchOptions
from .plan_file import Plan, read_plan, save_plan
from .result import Evaluated, SearchResult, Trial

__all__ = ["Candidate", "Prediction", "StepShape", "SearchOptions", "Plan", "read_plan", "save_plan", "Evaluated",
           "SearchResult", "Trial"]
