"""A fixed grid of candidates x hardware for the cost model's regression check (test_search_cost.py::
test_predictions_match_the_recorded_grid). ``python tests/unit/cost_grid.py`` rewrites the recorded values
(tests/unit/data/cost_predict_grid.json): do that only for an intended change of the cost model."""
from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_search_cost import S, toy_hw, toy_info  # noqa: E402

from torchloom.errors import TorchloomError  # noqa: E402
from torchloom.parallel.mesh import ParallelDims  # noqa: E402
from torchloom.search.candidate import Candidate  # noqa: E402
from torchloom.cost.cluster import cluster_hardware, cluster_spec  # noqa: E402
from torchloom.search.pricing import predict  # noqa: E402

DATA = Path(__file__).resolve().parent / "data" / "cost_predict_grid.json"

METHODS = [
    [("ddp", {})],
    [("zero1", {}), ("amp", {"dtype": "bfloat16"})],
    [("fsdp", {})],
    [("zero2", {}), ("amp", {"dtype": "bfloat16"}), ("checkpoint", {})],
    [("fsdp", {}), ("half", {})],
    [("tensor_parallel", {}), ("sequence_parallel", {}), ("fsdp", {}), ("amp", {"dtype": "bfloat16"})],
    [("pipeline_parallel", {"schedule": "1f1b"}), ("fsdp", {}), ("amp", {"dtype": "bfloat16"}), ("checkpoint", {})],
    [("pipeline_parallel", {"schedule": "interleaved_1f1b", "stages_per_rank": 2}), ("tensor_parallel", {}),
     ("fsdp", {"reshard_after_forward": False}), ("amp", {"dtype": "bfloat16"})],
    [("pipeline_parallel", {"schedule": "zero_bubble"}), ("zero2", {}), ("checkpoint", {})],
]
DIMS = [dict(dp_shard=16), dict(dp_replicate=4, dp_shard=4), dict(tp=2, dp_shard=8), dict(pp=2, tp=2, dp_shard=4),
        dict(pp=4, dp_replicate=2, dp_shard=2), dict(pp=2, dp_replicate=8)]
MICRO = [(1, 1), (2, 4), (1, 8)]


def hardwares():
    """(name, Hardware) pairs: the GPU table over nodes, a one-node toy, co-located CPU ranks (oversubscribed)."""
    yield "h100x16", cluster_hardware(cluster_spec(gpu="h100", gpus=16, gpus_per_node=8))
    yield "toy16", toy_hw(ranks=16)
    cpu = toy_hw(ranks=16, device="cpu")
    cpu.mem_bw, cpu.op_overhead_s, cpu.fingerprint, cpu.threads_per_rank = 1e10, 5e-6, {"cores": 8}, 1
    yield "cpu16", cpu


def candidates():
    for methods, dims, (mb, accum) in itertools.product(METHODS, DIMS, MICRO):
        if dims.get("tp", 1) == 1 and any(n == "tensor_parallel" for n, _ in methods):
            continue
        if (dims.get("pp", 1) > 1) != any(n == "pipeline_parallel" for n, _ in methods):
            continue
        yield Candidate(ParallelDims(**dims), tuple((n, dict(c)) for n, c in methods), mb, accum, S)


def summary(p) -> dict:
    return {"step_time_s": p.step_time_s, "time": dict(p.time), "memory": dict(p.memory),
            "peak_memory_bytes": p.peak_memory_bytes, "tokens_per_s": p.tokens_per_s, "mfu": p.mfu,
            "collectives": [[c["label"], c["seconds"], c["exposed_s"]] for c in p.collectives],
            "notes": list(p.notes)}


def grid() -> dict:
    info = toy_info()
    out = {}
    for hw_name, hw in hardwares():
        for c in candidates():
            try:
                out[f"{hw_name}|{c.key()}"] = summary(predict(c, info, hw))
            except TorchloomError as e:
                out[f"{hw_name}|{c.key()}"] = {"error": type(e).__name__}
    return out


if __name__ == "__main__":
    DATA.write_text(json.dumps(grid(), indent=0, sort_keys=True, default=str))
    print(f"wrote {DATA}")
