"""`python -m benchmarks compare`: training step time, tokens/s and per-rank memory of torchloom side by side
with what users would pick instead (hand-written PyTorch, Hugging Face Accelerate, DeepSpeed, Lightning Fabric),
on the same model, initial weights, token stream, global batch, optimizer and precision (docs/benchmarks.md).

One module per contender family (``torch_native``, ``loom``, ``accelerate_``, ``deepspeed_``, ``fabric``), each
with ``CONTENDERS``: name -> :class:`~benchmarks.compare.common.Contender`. ``worker`` runs one contender on one
rank; ``runner`` launches the ranks and interleaves the contenders; ``report`` writes Markdown, JSON and plots.
"""
