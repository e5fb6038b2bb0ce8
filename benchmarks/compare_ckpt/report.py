"""Aggregates the worker results into the JSON/Markdown/PNG report. All times in seconds, sizes in bytes
(GB = 1e9 bytes). A save's stall is the max over ranks of the seconds ``save()`` blocked (the ranks
move in lockstep, so the slowest one sets the loop's pace); statistics are median and quartiles over the
recorded (non-first) saves of all rounds."""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from pathlib import Path


def quart(xs: list[float]) -> dict:
    """Median, first and third quartile (inclusive method), n; ``None`` fields for no data."""
    xs = sorted(xs)
    if not xs:
        return {"median": None, "q1": None, "q3": None, "n": 0}
    if len(xs) == 1:
        return {"median": xs[0], "q1": xs[0], "q3": xs[0], "n": 1}
    q = statistics.quantiles(xs, n=4, method="inclusive")
    return {"median": statistics.median(xs), "q1": q[0], "q3": q[2], "n": len(xs)}


def versions() -> dict:
    from importlib import metadata

    v = {"python": platform.python_version()}
    for pkg in ("torch", "torchloom", "dlrover", "grpcio", "numpy", "matplotlib"):
        try:
            v[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            v[pkg] = None
    try:
        repo = Path(__file__).resolve().parents[2]
        v["torchloom_git"] = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
                                            capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    return v


def machine(work: Path) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mem = next((int(ln.split()[1]) * 1024 for ln in Path("/proc/meminfo").read_text().splitlines()
                if ln.startswith("MemTotal")), None)
    fs = subprocess.run(["df", "-T", str(work)], capture_output=True, text=True).stdout.splitlines()[-1:]
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "platform": platform.platform(),
            "checkpoint_fs": fs[0].split()[1] if fs else None, "load_avg_at_end": os.getloadavg()}


def assemble(a, stall: dict, restores: list[dict], wall_s: float, work: Path) -> dict:
    per: dict[str, dict] = {}
    for n in a.contenders:
        saves = [s for s in stall["saves"] if s["contender"] == n]
        rec = [s for s in saves if not s["first"]]
        first = [max(s["block_s"]) for s in saves if s["first"]]
        pre = [x for s in rec for rk in s["pre_step_s"] for x in rk]
        post = [x for s in rec for rk in s["post_step_s"] for x in rk]
        per[n] = {"stall_s": quart([max(s["block_s"]) for s in rec]),
                  "stall_per_rank_s": quart([x for s in rec for x in s["block_s"]]),
                  "first_save_s": first[0] if first else None,
                  "durable_after_s": quart([max(s["persist_s"]) for s in rec]),
                  "step_s_before_save": quart(pre), "step_s_during_background_write": quart(post),
                  "disk_bytes_last": rec[-1]["disk_bytes"] if rec else None,
                  "kept_bytes_last": rec[-1].get("kept_bytes") if rec else None,
                  "error": stall["errors"].get(n)}
        rs = [r for r in restores if r["contender"] == n]
        good = [r for r in rs if "error" not in r]
        chk = []
        for r in good:
            fps = r["victim"]["fingerprints"]
            for rk in r["ranks"]:
                chk.append(rk["step"] is not None and fps.get(str(rk["step"])) == rk["fingerprint"])
        per[n]["restore"] = {
            "load_s": quart([max(rk["load_s"] for rk in r["ranks"]) for r in good]),
            "restart_to_loaded_s": quart([max(rk["restart_to_loaded_s"] for rk in r["ranks"]) for r in good]),
            "construct_s": quart([max(rk["construct_s"] for rk in r["ranks"]) for r in good]),
            "steps_restored": [r["ranks"][0]["step"] for r in good],
            "sources": sorted({rk["source"] for r in good for rk in r["ranks"]}),
            "log_says_memory": [r.get("log_says_memory") for r in good],
            "log_says_disk": [r.get("log_says_disk") for r in good],
            "state_matches_saved": all(chk) if chk else None,
            "errors": [r["error"] for r in rs if "error" in r],
            "failed_attempts": [e for r in rs for e in r.get("failed_attempts", [])]}
    base = per.get("torchloom flash", {}).get("stall_s", {}).get("median")
    for n, p in per.items():
        m = p["stall_s"]["median"]
        p["stall_ratio_vs_torchloom"] = m / base if (m is not None and base) else None
        b, d = p["step_s_before_save"]["median"], p["step_s_during_background_write"]["median"]
        p["step_slowdown_during_write"] = d / b if (b and d) else None
    meta = stall.get("meta") or []
    checks = {"world_size_ok": bool(meta) and all(m["world_size"] == a.nproc for m in meta),
              "wrapper": sorted({m["wrapper"] for m in meta}),
              "state_bytes_per_rank": sorted({m["state_bytes_per_rank"] for m in meta}),
              "disk_over_state_bytes": {n: (p["disk_bytes_last"] / meta[0]["state_bytes_per_rank"]
                                            if p["disk_bytes_last"] and meta else None)
                                        for n, p in per.items()}}
    return {"config": {k: getattr(a, k) for k in ("gb", "width", "rounds", "restore_rounds", "post_steps",
                                                   "nproc", "threads", "contenders", "restore_contenders", "dlrover_early_saver",
                                                   "smoke", "argv")},
            "reused_stall_from": stall.get("reused_from"),
            "state": meta[0] if meta else None, "checks": checks, "contenders": per,
            "stall_launch_error": stall.get("launch_error"), "versions": versions(),
            "dlrover_agent_probe": stall.get("dlrover_agent_probe"),
            "machine": machine(work), "wall_s": wall_s, "raw": {"saves": stall["saves"],
                                                                "restores": restores}}


def headline(text: str) -> str:
    """The line of an error text that names the error: the first ``[rankN]: XError: ...`` line (what a
    rank raised), else the first line naming an error, else the first line."""
    import re

    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    pat = re.compile(r"\b\w*(Error|Exception)\b:")
    for pref in (True, False):
        for ln in lines:
            if pat.search(ln) and (ln.startswith("[rank") or not pref) and "_shm_handler" not in ln:
                return ln[:400]
    return lines[0][:400] if lines else "?"


def _f(q: dict, key: str = "median", nd: int = 3) -> str:
    return "—" if q.get(key) is None else f"{q[key]:.{nd}f}"


def _iqr(q: dict, nd: int = 3) -> str:
    return "—" if q["median"] is None else f"{q['median']:.{nd}f} [{q['q1']:.{nd}f}–{q['q3']:.{nd}f}]"


def markdown(r: dict) -> str:
    s, c = r["state"] or {}, r["config"]
    L = [f"State: {s.get('n_params', 0) / 1e6:.0f} M fp32 params ({s.get('n_layers')} x Linear "
         f"{s.get('width')}x{s.get('width')}) + AdamW moments = {s.get('state_bytes_per_rank', 0) / 1e9:.2f} GB "
         f"per rank; {c['nproc']} gloo ranks, DDP (every rank holds the full state), {c['threads']} thread(s) "
         f"per rank; {c['rounds']} recorded saves per contender (+1 first save), interleaved, reversed every "
         f"other round; {c['restore_rounds']} kill+restore run(s) per contender.", "",
         "| contender | stall per save, s: median [q1–q3] | × torchloom | first save, s | durable after, s "
         "| step time during write ÷ before | one checkpoint on disk, GB |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for n, p in r["contenders"].items():
        if p["stall_s"]["median"] is None:
            L.append(f"| {n} | failed: see below | | | | | |")
            continue
        ratio = "—" if p["stall_ratio_vs_torchloom"] is None else f"{p['stall_ratio_vs_torchloom']:.1f}×"
        slow = "—" if p["step_slowdown_during_write"] is None else f"{p['step_slowdown_during_write']:.2f}"
        disk = "—" if not p["disk_bytes_last"] else f"{p['disk_bytes_last'] / 1e9:.2f}"
        L.append(f"| {n} | {_iqr(p['stall_s'])} | {ratio} | {p['first_save_s']:.3f} | "
                 f"{_f(p['durable_after_s'], nd=2)} | {slow} | {disk} |")
    L += ["", "Restore after a kill (SIGKILL of every rank's process group right after the save of step 2 "
          "returned; step 1 was durable):", "",
          "| contender | load(), s: median | restart → state loaded, s | step restored | source | "
          "state = saved state |", "| --- | --- | --- | --- | --- | --- |"]
    for n, p in r["contenders"].items():
        q = p["restore"]
        if n not in c["restore_contenders"]:
            L.append(f"| {n} | not run (--restore-contenders) | | | | |")
            continue
        if q["load_s"]["median"] is None:
            L.append(f"| {n} | failed: see below | | | | |")
            continue
        L.append(f"| {n} | {_f(q['load_s'])} | {_f(q['restart_to_loaded_s'], nd=2)} | "
                 f"{', '.join(str(x) for x in q['steps_restored'])} | {', '.join(q['sources'])}"
                 f"{' (log: memory)' if any(q['log_says_memory']) else ''}"
                 f"{' (log: disk)' if any(q.get('log_says_disk') or []) else ''} | {q['state_matches_saved']} |")
    errs = [(n, p["error"]) for n, p in r["contenders"].items() if p["error"]]
    errs += [(n, {"phase": "restore", "errors": p["restore"]["errors"]})
             for n, p in r["contenders"].items() if p["restore"]["errors"]]
    errs += [(n, {"phase": "restore, failed attempt (retried)", "errors": [e]})
             for n, p in r["contenders"].items() for e in p["restore"]["failed_attempts"]]
    if r.get("stall_launch_error"):
        errs.append(("stall launch", {"phase": "launch", "errors": [r["stall_launch_error"]]}))
    if errs:
        L += ["", "Failures:", ""]
        for n, e in errs:
            text = e["errors"][0] if e["errors"] else ""
            L.append(f"- **{n}** ({e['phase']}): `{text.strip().splitlines()[0] if text.strip() else '?'}`: "
                     f"`{headline(text)}`")
    pr = r.get("dlrover_agent_probe")
    if pr:
        L += ["", f"DLRover agent mode (`{pr['cmd']}`): " + ("starts." if pr["ok"] else
              f"does not start here: `{pr['error']}`; so DLRover runs without its agent (saver = daemon "
              "child of local rank 0, killed with the job).")]
    ch, v, m = r["checks"], r["versions"], r["machine"]
    L += ["", f"Checks: world size {'ok' if ch['world_size_ok'] else 'WRONG'} on every rank; wrapper "
          f"{', '.join(ch['wrapper'])}; on-disk bytes ÷ per-rank state bytes: " +
          ", ".join(f"{n} {x:.2f}" for n, x in ch["disk_over_state_bytes"].items() if x) + ".",
          f"Versions: " + ", ".join(f"{k} {x}" for k, x in v.items()) + ".",
          f"Machine: {m['cpu']}, {m['cores']} cores, {m['mem_bytes'] / 2**30:.0f} GiB, checkpoints on "
          f"{m['checkpoint_fs']}, load average (1 min) at start {m.get('load_avg_at_start', [float('nan')])[0]:.1f}, at end {m['load_avg_at_end'][0]:.1f}; run took {r['wall_s']:.0f} s."]
    return "\n".join(L)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, p in r["contenders"].items() if p["stall_s"]["median"] is not None]
    fig, ax = plt.subplots(1, 2, figsize=(12, 4.2))

    def bars(axis, series, title):
        width = 0.8 / len(series)
        plotted = []
        for j, (label, qs) in enumerate(series):
            xs = [i + (j - (len(series) - 1) / 2) * width for i, q in enumerate(qs) if q["median"] is not None]
            ok = [q for q in qs if q["median"] is not None]
            plotted += [q["median"] for q in ok]
            axis.bar(xs, [q["median"] for q in ok], width, label=label,
                     yerr=[[q["median"] - q["q1"] for q in ok], [q["q3"] - q["median"] for q in ok]], capsize=3)
        axis.set_xticks(range(len(names)), names, rotation=25, ha="right")
        if any(v > 0 for v in plotted):  # a log axis needs a positive value (a smoke run may measure none)
            axis.set_yscale("log")
        axis.set_title(title)
        if len(series) > 1:
            axis.legend(fontsize=8)

    C = r["contenders"]
    bars(ax[0], [("stall per save", [C[n]["stall_s"] for n in names])], "training blocked per save (s, log)")
    bars(ax[1], [("load()", [C[n]["restore"]["load_s"] for n in names]),
                 ("restart → state loaded", [C[n]["restore"]["restart_to_loaded_s"] for n in names])],
         "restore after a kill (s, log)")
    s = r["state"] or {}
    fig.suptitle(f"{s.get('state_bytes_per_rank', 0) / 1e9:.2f} GB state per rank, {r['config']['nproc']} "
                 f"gloo ranks (DDP); bars: median, whiskers: quartiles")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(r: dict, out: Path) -> list[Path]:
    j, md, png = out / "compare_ckpt.json", out / "compare_ckpt.md", out / "compare_ckpt.png"
    j.write_text(json.dumps(r, indent=1, default=str))
    import shlex

    cmd = "python -m benchmarks compare-ckpt " + " ".join(shlex.quote(x) for x in r["config"].get("argv", []))
    md.write_text(f"# Checkpoint stall\n\nCommand: `{cmd}` (config: {json.dumps(r['config'])})\n\n"
                  + markdown(r) + "\n\n![checkpoint stall](compare_ckpt.png)\n")
    plot(r, png)
    return [j, md, png]
