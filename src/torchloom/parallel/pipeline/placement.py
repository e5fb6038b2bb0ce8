"""Schedule names and stage placement (kept free of ``torch.distributed.pipelining`` so that parsing a strategy
does not import it)."""
from __future__ import annotations

#: schedule name -> (``torch.distributed.pipelining`` class, "single"/"multi" stages per rank, placement style)
SCHEDULES: dict[str, tuple[str, str, str]] = {
    "gpipe": ("ScheduleGPipe", "single", "loop"),
    "1f1b": ("Schedule1F1B", "single", "loop"),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", "multi", "loop"),
    "zero_bubble": ("ScheduleInterleavedZeroBubble", "multi", "loop"),
    "zbv": ("ScheduleZBVZeroBubble", "multi", "v"),
}

#: schedules that compute weight gradients apart from input gradients (``autograd.grad`` + manual ``.grad``)
SPLIT_BACKWARD = ("zero_bubble", "zbv")


def stage_ranks(pp: int, num_stages: int, style: str) -> list[int]:
    """``ranks[s]``: the pipeline rank holding stage ``s``. ``loop``: stage ``s`` on rank ``s % pp``; ``v``
    (ZB-V): down the ranks, then back up, so rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``."""
    if style == "loop":
        return [s % pp for s in range(num_stages)]
    return [(s % pp) if (s // pp) % 2 == 0 else pp - 1 - (s % pp) for s in range(num_stages)]
