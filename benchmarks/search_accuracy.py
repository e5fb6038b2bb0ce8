"""How accurate is the planner? Every candidate of a grid is run for real on this machine and compared with
what the cost model predicts for it (step time, peak memory per rank), and the plan ``strategy="auto"``
chooses is compared with the best measured one.

    .venv/bin/python benchmarks/search_accuracy.py                  # measure, predict, compare (~10 min)
    .venv/bin/python benchmarks/search_accuracy.py --quick          # smaller grid; *_quick files in results/
    .venv/bin/python benchmarks/search_accuracy.py --measure-only   # write benchmarks/results/*.json only
    .venv/bin/python benchmarks/search_accuracy.py --predict-only   # compare against the saved JSON

Models (global batch fixed per model, AdamW, random tokens, ``labels = input_ids``):

- ``default``: the default ``loom train`` model (``train/configs/default.yaml``: LLaMA, 4.46 M parameters,
  vocab 2048, hidden 256, 4 layers, 4 heads, intermediate 768), sequence 128, global batch 16.
- ``llama25m``: LLaMA with vocab 8192, hidden 512, 6 layers, 8 heads (8 KV heads), intermediate 1408,
  untied embeddings: 27.7 M parameters; sequence 128, global batch 4.

Grid per world size (2 and 4 processes; ``OMP_NUM_THREADS = max(1, 2 // nproc)`` as ``loom run`` sets):
DDP, ZeRO-1, ZeRO-2, ZeRO-3, TP, PP (1F1B, 2 x pp micro-batches where the batch allows), and on 4 processes
dp2 x tp2 (FSDP 2-D), dp2 x pp2 (DDP), tp2 x pp2; with and without activation checkpointing of every block
(the larger model: DDP, ZeRO-3, TP and PP only), bf16 autocast for DDP and ZeRO-3 (default model). Default
model: 5 timed steps after 2 warm-up; llama25m: 3 after 1. One launch per world size runs every
candidate of both models in turn (``--rounds`` repeats the whole grid,
interleaved, and keeps the median). Time and memory come from :func:`torchloom.search.measure.measure_steps`
(the same function the search's confirming trials use): median step time of the slowest rank; peak of live
tensor bytes during one extra, untimed step (MemTracker), max over ranks.

Outputs: ``benchmarks/results/search_grid_<model>_w<N>.json`` (measurements, machine, load; ``--quick``:
``..._w<N>_quick.json``), and with
predictions ``benchmarks/results/search_accuracy.json`` (per-candidate errors and the metrics) and
``docs/images/search_accuracy.png`` (log-log predicted vs measured).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(Path(__file__).resolve().parent))

# steps: (timed, warm-up) per candidate (the larger model's steps are ~6x longer)
MODELS = {
    "default": {"config": None, "global_batch": 16, "steps": (5, 2)},  # None: train/configs/default.yaml's
    "llama25m": {"config": {"vocab_size": 8192, "hidden_size": 512, "num_layers": 6, "num_heads": 8,
                            "num_kv_heads": 8, "intermediate_size": 1408, "seq_len": 128,
                            "tie_embeddings": False, "rope_theta": 10000.0},
                 "global_batch": 4, "steps": (3, 1)},
}


# ----------------------------------------------------------------------------------------------- models
def model_config(name: str):
    """The :class:`~torchloom.train.config.ModelConfig` of a benchmark model."""
    from torchloom.train.config import ModelConfig, TrainConfig, read_yaml, resolve_config_path

    spec = MODELS[name]["config"]
    if spec is None:
        return TrainConfig.from_dict(read_yaml(resolve_config_path("default.yaml"))).model
    return ModelConfig(**spec)


def build(name: str, meta: bool = False):
    """A fresh ``LlamaForCausalLM`` of the benchmark model (seed 0), on the meta device if asked."""
    import torch

    from torchloom.train.job import build_model

    mc = model_config(name)
    if meta:
        with torch.device("meta"):
            return build_model(mc, mc.vocab_size, eos_id=0, seed=0)
    return build_model(mc, mc.vocab_size, eos_id=0, seed=0)


def lm_loss(batch, output):
    return output.loss


# ------------------------------------------------------------------------------------------------- grid
def grid(model: str, world: int, quick: bool = False) -> list:
    """The candidates measured for ``model`` on ``world`` processes, at the model's fixed global batch.

    Each is a :class:`~torchloom.search.candidate.Candidate`; ``micro_batch`` is the samples per forward
    (with pipeline parallelism: per pipeline micro-batch, ``grad_accum`` = the schedule's micro-batches).
    """
    from torchloom.parallel.mesh import ParallelDims
    from torchloom.search.candidate import Candidate
    from torchloom.search.space import dp_spec

    gb, seq = MODELS[model]["global_batch"], model_config(model).seq_len
    ac = ("checkpoint", {})  # every block
    amp = ("amp", {"dtype": "bfloat16"})
    out: list[Candidate] = []

    def add(dims: dict, dp: str | None, tp: bool = False, extras: list[list] = ([],)) -> None:
        """Items in the order (and spelling) the search's space enumerates them: data parallel, precision,
        tensor parallel, pipeline, checkpointing."""
        d = ParallelDims(**dims)
        if d.pp * d.dp_replicate * d.dp_shard * d.tp * d.ep != world:
            return
        per_dp = gb // d.dp
        mb, accum = per_dp, 1
        if d.pp > 1:
            accum = min(2 * d.pp, per_dp)
            mb = per_dp // accum
        for x in extras:
            items = [i for i in (dp_spec(dp, d), *[e for e in x if e[0] == "amp"]) if i is not None]
            items += [("tensor_parallel", {})] if tp else []
            items += [("pipeline_parallel", {"schedule": "1f1b", "num_microbatches": accum})] if d.pp > 1 else []
            items += [e for e in x if e[0] != "amp"]
            out.append(Candidate(d, tuple((n, dict(c)) for n, c in items), mb, accum, seq))

    w = world
    full = model == "default" and not quick  # the larger model runs ~6x slower per step: fewer twins
    twins = [[], [ac], [amp]] if full else [[], [ac]]  # bf16 autocast for a few
    ac_twin = [[], [ac]] if full else [[]]
    add({"dp_replicate": w}, "ddp", extras=twins)
    add({"dp_replicate": w}, "zero1", extras=ac_twin)
    add({"dp_shard": w}, "zero2", extras=ac_twin)
    add({"dp_shard": w}, "zero3", extras=twins)
    add({"tp": w}, None, tp=True, extras=[[], [ac]])
    add({"pp": w}, None, extras=[[], [ac]])
    if w == 4:
        add({"dp_shard": 2, "tp": 2}, "zero3", tp=True, extras=ac_twin)
        add({"pp": 2, "dp_replicate": 2}, "ddp", extras=ac_twin)
        add({"pp": 2, "tp": 2}, None, tp=True)
    return out


def accelerate_args(cand) -> dict:
    """``dataloader_args`` for ``auto_accelerate`` that reproduce the candidate's batch split: the global
    batch, and the per-call batch ``train_step`` takes (the whole per-rank batch under pipelining, which
    the schedule splits into ``grad_accum`` micro-batches)."""
    from torchloom.search.plan_file import batch_args

    return batch_args(cand)  # the rule the search's trials and plan files use


# ---------------------------------------------------------------------------------------------- measure
def run_grid(jobs: list[tuple[str, dict, int, int]], rounds: int, log_path: str,
             meta: dict | None = None) -> list[dict]:
    """On every rank: for each round, for each ``(model, candidate dict, steps, warmup)``: a fresh model, the
    candidate's strategy through ``auto_accelerate``, :func:`measure_steps`, then the trial's groups torn down. A
    failing candidate is recorded (``error``), never fatal. Rank 0 appends each row to ``log_path`` and
    rewrites the result files (marked ``"partial": true``) as it goes, so a crash, or a reader that cannot
    wait, keeps what was measured."""
    import torch
    import torch.distributed as dist

    import torchloom
    from torchloom.search.candidate import Candidate
    from torchloom.search.measure import measure_steps

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank = dist.get_rank()
    rows: list[dict] = []
    for r in range(rounds):
        for model_name, cdict, steps, warmup in jobs:
            cand = Candidate.from_dict(cdict)
            row = {"model": model_name, "candidate": cdict, "label": cand.label(), "round": r, "steps": steps,
                   "warmup": warmup}
            t0 = time.perf_counter()
            try:
                mc = model_config(model_name)
                res = torchloom.auto_accelerate(
                    build(model_name), torch.optim.AdamW, None, lm_loss, strategy=cand.strategy(),
                    optim_args={"lr": 1e-4}, dataloader_args=accelerate_args(cand),
                    model_input_format="unpack_dict")
                g = torch.Generator().manual_seed(1000 + res.mesh.dp_rank)  # tp/pp peers read the same batch
                per_call = res.micro_batch_size
                batches = []
                for _ in range(2):
                    ids = torch.randint(0, mc.vocab_size, (per_call, mc.seq_len), generator=g)
                    batches.append({"input_ids": ids, "labels": ids})
                row["setup_s"] = time.perf_counter() - t0
                m = measure_steps(res, batches, steps=steps, warmup=warmup)
                row.update(m.to_dict())
                row["loadavg"] = os.getloadavg()
                del res
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                row["error"] = f"{type(e).__name__}: {e}"
            row["wall_s"] = time.perf_counter() - t0
            _cleanup()
            dist.barrier()
            rows.append(row)
            if rank == 0:
                with open(log_path, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if meta is not None:
                    write_results(rows, {**meta, "partial": True, "loadavg_after": os.getloadavg()})
                status = row.get("error") or (f"{row['step_time_s'] * 1e3:8.1f} ms  "
                                              f"{row['peak_memory_bytes'] / 2**20:7.1f} MiB")
                print(f"[w{dist.get_world_size()} r{r}] {model_name:9} {row['label']:42} {status}", flush=True)
    return rows


def _cleanup() -> None:
    """Between candidates: drop the trial's model and mesh. Its process groups are kept, not destroyed:
    with ``torchloom.search.isolation.ProcessState.restore`` (which destroys them) a later tensor-parallel
    candidate fails ("Could not resolve the process group registered under the name N"; reproduced with
    dps2 x tp2 then pp2 x tp2 on 4 ranks, torch 2.13). Idle gloo groups cost nothing measurable."""
    from torchloom.parallel.mesh import set_current_mesh

    set_current_mesh(None)
    gc.collect()


def machine() -> dict:
    import torch

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node()}


def steps_for(model: str, quick: bool, steps: int | None, warmup: int | None) -> tuple[int, int]:
    """(timed steps, warm-up steps) per candidate: the command line's, else the model's (quick: fewer)."""
    s, w = MODELS[model]["steps"]
    if quick:
        s, w = max(2, s - 2), 1
    return steps or s, w if warmup is None else warmup


def measure(models: list[str], worlds: list[int], quick: bool, steps: int | None, warmup: int | None, rounds: int,
            only: list[str] | None = None) -> None:
    from torchloom.testing import run_ranks

    RESULTS.mkdir(parents=True, exist_ok=True)
    for w in worlds:
        jobs = [(m, c.to_dict(), *steps_for(m, quick, steps, warmup)) for m in models for c in grid(m, w, quick)
                if not only or any(o in c.label() for o in only)]
        log_path = RESULTS / f".search_grid_w{w}.partial.jsonl"
        log_path.unlink(missing_ok=True)
        env = {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // w))}
        os.environ.update(env)
        load_before, t0 = os.getloadavg(), time.time()
        meta = {"world_size": w, "models": models, "rounds": rounds, "only": only or None,
                "quick": quick, "omp_num_threads": int(env["OMP_NUM_THREADS"]), "machine": machine(),
                "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t0)), "loadavg_before": load_before,
                "command": " ".join(["benchmarks/search_accuracy.py", *sys.argv[1:]])}
        print(f"world {w}: {len(jobs)} candidates x {rounds} round(s), load {load_before[0]:.2f}", flush=True)
        error = ""
        try:
            # a hung candidate must not stall the run for long: ~90 s a candidate in all, then the logged rows
            budget = max(600.0, 90.0 * len(jobs) * rounds)
            rows = run_ranks(run_grid, w, jobs, rounds, str(log_path), meta, timeout=budget, env=env)[0]
        except RuntimeError as e:  # keep what rank 0 logged before the launch failed
            error = str(e)[-2000:]
            print(f"world {w}: launch failed, keeping the logged rows: {error}", file=sys.stderr)
            rows = [json.loads(ln) for ln in log_path.read_text().splitlines()] if log_path.exists() else []
        meta.update(wall_s=time.time() - t0, loadavg_after=os.getloadavg(), launch_error=error, partial=False)
        for path in write_results(rows, meta):
            print(f"wrote {path.relative_to(ROOT)} ({meta['wall_s']:.0f} s for {w} processes)", flush=True)
        log_path.unlink(missing_ok=True)


def grid_path(model: str, world: int, quick: bool = False) -> Path:
    """Where the measurements of ``model`` on ``world`` processes are saved (``--quick`` grids apart, so a
    quick run never replaces a full one)."""
    return RESULTS / f"search_grid_{model}_w{world}{'_quick' if quick else ''}.json"


def write_results(rows: list[dict], meta: dict) -> list[Path]:
    """Write ``search_grid_<model>_w<N>.json`` for every model of ``meta["models"]`` from ``rows``. With
    ``meta["only"]`` (a rerun of some candidates) the new entries replace those of the existing file and
    the others are kept (``rerun`` lists the replaced labels)."""
    paths = []
    for m in meta["models"]:
        mine = [r for r in rows if r["model"] == m]
        if not mine and (meta.get("partial") or meta.get("only")):
            continue  # not reached yet / not rerun: keep the existing file
        path = grid_path(m, meta["world_size"], meta.get("quick", False))
        cands = _merge_rounds(mine)
        out = {"model": m, "model_config": _model_config_dict(m), "global_batch": MODELS[m]["global_batch"],
               "steps": mine[0]["steps"] if mine else None, "warmup": mine[0]["warmup"] if mine else None,
               **{k: v for k, v in meta.items() if k not in ("models", "only")}}
        if meta.get("only") and path.exists():
            old = json.loads(path.read_text())
            new = {json.dumps(c["candidate"], sort_keys=True): c for c in cands}
            kept = [c for c in old["candidates"] if json.dumps(c["candidate"], sort_keys=True) not in new]
            out = {**old, "rerun": sorted({*old.get("rerun", []), *(c["label"] for c in cands)}),
                   "rerun_date_utc": meta["date_utc"], "candidates": kept + cands}
        else:
            out["candidates"] = cands
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)  # readers never see a half-written file
        paths.append(path)
    return paths


def _model_config_dict(name: str) -> dict:
    from dataclasses import asdict

    return asdict(model_config(name))


def _merge_rounds(rows: list[dict]) -> list[dict]:
    """One entry per candidate: the median over rounds of the step time, the max of the peak memory."""
    import statistics

    by: dict[str, list[dict]] = {}
    for r in rows:
        by.setdefault(json.dumps(r["candidate"], sort_keys=True), []).append(r)
    out = []
    for rs in by.values():
        ok = [r for r in rs if "error" not in r]
        base = {"candidate": rs[0]["candidate"], "label": rs[0]["label"]}
        if not ok:
            out.append({**base, "error": rs[0]["error"]})
            continue
        best = max(ok, key=lambda r: r["peak_memory_bytes"])
        out.append({**base, "step_time_s": statistics.median(r["step_time_s"] for r in ok),
                    "round_step_time_s": [r["step_time_s"] for r in ok],
                    "step_times": [t for r in ok for t in r["step_times"]],
                    "peak_memory_bytes": best["peak_memory_bytes"], "memory": best["memory"],
                    "rank_peak_bytes": best["rank_peak_bytes"], "state_bytes": best["state_bytes"],
                    "memory_method": best["memory_method"], "memory_error": best["memory_error"],
                    "setup_s": statistics.median(r["setup_s"] for r in ok),
                    "loadavg": [r["loadavg"] for r in ok]})
    return out


# ---------------------------------------------------------------------------------------------- predict
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--worlds", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--quick", action="store_true", help="a smaller grid (no bf16, fewer checkpointing twins)")
    ap.add_argument("--steps", type=int, default=None,
                    help="timed steps per candidate (default: default model 5, llama25m 3; quick: 2 fewer, >= 2)")
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2 / 1; quick 1)")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the grid, interleaved; median of rounds")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--measure-only", action="store_true", help="run the grid, write the JSON, stop")
    mode.add_argument("--predict-only", action="store_true", help="compare with the saved JSON, run nothing")
    ap.add_argument("--only", nargs="*",
                    help="rerun only candidates whose label contains one of these (merged into the saved files)")
    ap.add_argument("--no-auto", action="store_true", help="skip the strategy='auto' search run")
    args = ap.parse_args()
    t0 = time.time()
    if not args.predict_only:
        measure(args.models, args.worlds, args.quick, args.steps, args.warmup, args.rounds, args.only)
    if not args.measure_only:
        from _accuracy import report

        report(args.models, args.worlds, auto=not args.no_auto, quick=args.quick)
    print(f"total {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
