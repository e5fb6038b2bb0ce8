"""The planning vocabulary and the cost model, below the methods (``methods -> cost``, ``search -> methods,
cost``): what a model is to the planner (:mod:`~torchloom.cost.analysis`, :mod:`~torchloom.cost.model_info`,
named presets), what a machine is (:mod:`~torchloom.cost.hardware`, the accelerator table, calibration on this
machine), what a method does to a step (:mod:`~torchloom.cost.effects`, :mod:`~torchloom.cost.step`) and the
arithmetic that prices it (:mod:`~torchloom.cost.model`). See docs/cost_model.md.

Nothing here imports the method registry, the strategy or the search.
"""
