"""From launch results to rows: medians and quartiles of step time over steps and rounds, tokens/s, per-rank
memory, first-step loss agreement and the silent-fallback checks; then the headline ratios."""
from __future__ import annotations

import importlib
import statistics

from .common import MODELS


def _quantiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) < 2:
        return xs[0], xs[0], xs[0]
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return q[0], statistics.median(xs), q[2]


def contender_spec(name: str):
    mod, key = name.split(":")
    return importlib.import_module(f"benchmarks.compare.{mod}").CONTENDERS[key]


def row(name: str, launches: list[dict], cfg: dict, world: int) -> dict:
    """One contender's row. Step time of a step = the slowest rank's (s); pooled over the timed steps of every
    round. Memory: the largest rank's bytes, median over rounds."""
    spec = contender_spec(name)
    base = {"contender": name.split(":")[1], "family": name.split(":")[0], "strategy": spec.strategy,
            "precision": spec.precision}
    ok = [la for la in launches if "error" not in la]
    if not ok:
        err = next(la for la in launches if "error" in la)
        return {**base, "error": err["error"], "traceback": err.get("traceback", "")[-4000:],
                "stderr_tail": err.get("stderr_tail", "")[-2000:]}
    w = cfg["warmup"]
    pooled, round_medians = [], []
    for la in ok:
        per_step = [max(ts) for ts in zip(*[r["step_s"][w:] for r in la["ranks"]])]
        pooled += per_step
        round_medians.append(statistics.median(per_step))
    q1, med, q3 = _quantiles(pooled)
    tokens = cfg["global_batch"] * MODELS[cfg["model"]]["seq_len"]

    def mem(key):
        return int(statistics.median(max(r[key] for r in la["ranks"]) for la in ok))

    def tracked(la):
        vals = [r.get("tracked_peak", {}).get("total") for r in la["ranks"]]
        return max(vals) if all(v is not None for v in vals) else None

    tr = [tracked(la) for la in ok]
    r0 = ok[0]["ranks"][0]
    out = {**base, "step_s_median": med, "step_s_q1": q1, "step_s_q3": q3, "round_medians_s": round_medians,
           "tokens_per_s": tokens / med, "rounds": len(ok), "timed_steps": len(pooled),
           "setup_s": statistics.median(max(r["setup_s"] for r in la["ranks"]) for la in ok),
           "train_peak_rss": mem("train_peak_rss"), "setup_peak_rss": mem("setup_peak_rss"),
           "param_bytes": mem("param_bytes"), "optim_state_bytes": mem("optim_state_bytes"),
           "optim_param_copy_bytes": mem("optim_param_copy_bytes"), "full_param_bytes": r0["full_param_bytes"],
           "tracked_peak": int(statistics.median(tr)) if all(t is not None for t in tr) else None,
           "tracked_detail": r0.get("tracked_peak"), "first_loss": r0["loss"][0], "losses": r0["loss"],
           "wrapper": r0["wrapper"], "dist_world_size": r0["dist_world_size"],
           "contender_world_size": r0["contender_world_size"], "threads": r0["threads"], "notes": r0["notes"]}
    out["precision"] = r0.get("precision") or out["precision"]  # what strategy="auto" picked
    out["checks"] = fallback_checks(out, spec, world, cfg, ok)
    out["rounds_failed"] = len(launches) - len(ok)
    if out["rounds_failed"]:  # a crash or hang in a later round is not a valid row
        err = next(la for la in launches if "error" in la)["error"].splitlines()[0][:300]
        out["checks"].append(f"failed in {out['rounds_failed']} of {len(launches)} rounds: {err}")
    split = [la for la in ok if len({r.get("param_digest") for r in la["ranks"]}) > 1]
    if not spec.sharded and spec.strategy != "auto" and split:
        out["checks"].append("replicas diverged: the parameters differ between ranks after the steps (gradients "
                             "not all-reduced, or not the same update on every rank)")
    return out


def fallback_checks(r: dict, spec, world: int, cfg: dict, ok: list[dict]) -> list[str]:
    """Silent fallbacks: the world size the process group and the contender itself see, the wrapper type, the
    per-rank parameter bytes (sharded ~ full / world, replicated = full), the thread count, an optimizer that
    holds no state after the steps (it never stepped), unsharded optimizer state under ZeRO. Ranks that do not
    synchronise show in the loss trajectory, compared with the reference contender's in :func:`loss_checks`."""
    bad = []
    if r["dist_world_size"] != world:
        bad.append(f"process group world size {r['dist_world_size']} != {world}")
    if r["contender_world_size"] != world:
        bad.append(f"contender reports world size {r['contender_world_size']} != {world}")
    if spec.wrapper and spec.wrapper not in r["wrapper"]:
        bad.append(f"wrapper {r['wrapper']!r}, expected {spec.wrapper!r}")
    full, mine = r["full_param_bytes"], r["param_bytes"]
    if spec.sharded and mine > full / world * 1.05 + 4096:
        bad.append(f"not sharded: {mine / 2**20:.1f} MiB parameters per rank of {full / 2**20:.1f} MiB")
    if not spec.sharded and spec.strategy != "auto" and mine < full * 0.99:
        bad.append(f"parameters unexpectedly sharded ({mine / 2**20:.1f} of {full / 2**20:.1f} MiB)")
    if (spec.sharded or spec.strategy in ("zero1", "zero2")) and r["optim_state_bytes"] > 2 * full / world * 1.05 + 8192:
        bad.append(f"optimizer state not sharded: {r['optim_state_bytes'] / 2**20:.1f} MiB per rank "
                   f"(AdamW of all parameters: {2 * full / 2**20:.1f} MiB)")
    if r["threads"] != cfg["threads"]:
        bad.append(f"torch threads {r['threads']} != {cfg['threads']}")
    if r["optim_state_bytes"] == 0:
        bad.append("optimizer holds no state after the steps (it never stepped these parameters)")
    return bad


def loss_checks(rows: list[dict], ref: str = "torch_ddp") -> None:
    """Adds ``loss_check``: first-step loss vs the reference (must agree: bit-identical in fp32 up to ~1e-6
    relative, bf16 within 2e-2), and the largest relative difference of the later losses (global-batch means,
    worker.global_mean)."""
    refrow = next((r for r in rows if r["contender"] == ref and "error" not in r), None)
    for r in rows:
        if "error" in r or refrow is None:
            continue
        d0 = abs(r["first_loss"] - refrow["first_loss"]) / abs(refrow["first_loss"])
        later = max((abs(a - b) / abs(b) for a, b in zip(r["losses"][1:], refrow["losses"][1:])), default=0.0)
        r["first_loss_rel_diff"], r["later_loss_max_rel_diff"] = d0, later
        tol0, tol = (2e-2, 5e-2) if r["precision"] == "bf16" else (1e-5, 1e-3)
        if d0 > tol0:
            r["checks"].append(f"first-step loss differs from {ref} by {d0:.2e} (relative)")
        if later > tol:
            r["checks"].append(f"loss trajectory differs from {ref} by up to {later:.2e} (relative): not the "
                               f"same training")


PAIRS = [("ddp", "torch_ddp", "loom_ddp"), ("zero1", "torch_ddp_zero1", "loom_zero1"), ("zero3", "torch_fsdp2_zero3", "loom_zero3"),
         ("zero2", "torch_fsdp2_zero2", "loom_zero2"),
         ("zero3+ac+bf16", "torch_fsdp2_zero3_ac_bf16", "loom_zero3_ac_bf16"),
         ("zero3+ac+bf16, meta init", "torch_fsdp2_zero3_ac_bf16_meta", "loom_zero3_ac_bf16_meta")]


def headlines(rows: list[dict]) -> dict:
    """(1) torchloom / hand-written step time per strategy (with the per-round ratio range), (2) ZeRO-3 + AC +
    bf16 vs DDP fp32: memory ratios and throughput ratio (hand-written and torchloom), (3) torchloom's best vs
    each peer family's best valid configuration (no failed checks)."""
    by = {r["contender"]: r for r in rows if "error" not in r}
    h: dict = {"overhead": [], "zero3_ac_bf16_vs_ddp": [], "vs_peers": []}
    for strat, t, loom in PAIRS:
        if t in by and loom in by:
            a, b = by[loom], by[t]
            rr = [x / y for x, y in zip(a["round_medians_s"], b["round_medians_s"])]
            h["overhead"].append({"strategy": strat, "ratio": a["step_s_median"] / b["step_s_median"],
                                  "round_ratio_min": min(rr), "round_ratio_max": max(rr),
                                  "valid": not a["checks"] and not b["checks"]})
    for fam, ddp, z in (("hand-written", "torch_ddp", "torch_fsdp2_zero3_ac_bf16"),
                        ("torchloom", "loom_ddp", "loom_zero3_ac_bf16"),
                        ("accelerate", "accel_ddp", "accel_fsdp2_zero3_ac_bf16"),
                        ("hand-written, meta init", "torch_ddp", "torch_fsdp2_zero3_ac_bf16_meta"),
                        ("torchloom, meta init", "loom_ddp", "loom_zero3_ac_bf16_meta")):
        if ddp in by and z in by:
            a, b = by[z], by[ddp]
            h["zero3_ac_bf16_vs_ddp"].append({
                "family": fam, "tracked_peak_cut": (b["tracked_peak"] / a["tracked_peak"])
                if a["tracked_peak"] and b["tracked_peak"] else None,
                "state_bytes_cut": (b["param_bytes"] + b["optim_state_bytes"] + b["optim_param_copy_bytes"])
                / max(1, a["param_bytes"] + a["optim_state_bytes"] + a["optim_param_copy_bytes"]),
                "train_rss_cut": b["train_peak_rss"] / a["train_peak_rss"],
                "setup_rss_cut": b["setup_peak_rss"] / a["setup_peak_rss"],
                "throughput_ratio": a["tokens_per_s"] / b["tokens_per_s"], "valid": not a["checks"]})
    valid = [r for r in by.values() if not r["checks"]]
    loom = [r for r in valid if r["family"] == "loom"]
    if loom:
        best = min(loom, key=lambda r: r["step_s_median"])
        for fam in ("torch_native", "accelerate_", "deepspeed_", "fabric"):
            peers = [r for r in valid if r["family"] == fam]
            if peers:
                p = min(peers, key=lambda r: r["step_s_median"])
                same = next((r for r in loom if r["strategy"] == p["strategy"]), None)
                # the peer may offer no bf16 configuration here: compare at its precision too
                prec = [r for r in loom if r["precision"] == p["precision"]]
                bp = min(prec, key=lambda r: r["step_s_median"]) if prec else None
                h["vs_peers"].append({"peer": fam, "peer_best": p["contender"], "loom_best": best["contender"],
                                      "best_ratio": best["step_s_median"] / p["step_s_median"],
                                      "peer_precision": p["precision"],
                                      "loom_best_same_precision": bp["contender"] if bp else None,
                                      "same_precision_ratio": bp["step_s_median"] / p["step_s_median"] if bp else None,
                                      "same_strategy": same["contender"] if same else None,
                                      "same_strategy_ratio": same["step_s_median"] / p["step_s_median"] if same else None})
    return h
