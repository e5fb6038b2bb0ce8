"""Markdown, JSON and PNG plots of a comparison run (``benchmarks/results/compare*.{md,json,png}``)."""
from __future__ import annotations

import json
import os
import platform
from importlib import metadata

MiB = 2 ** 20


def environment() -> dict:
    """Package versions and the machine (CPU model, cores, memory, kernel, Python)."""
    vers = {}
    for pkg in ("torch", "transformers", "torchloom", "accelerate", "deepspeed", "lightning", "numpy", "matplotlib"):
        try:
            vers[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            vers[pkg] = None
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        mem = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"versions": vers, "cpu": cpu, "cores": os.cpu_count(), "mem_bytes": mem, "kernel": platform.release(),
            "python": platform.python_version(), "loadavg_at_end": load}


def _f(x, spec=".3f"):
    return "–" if x is None else format(x, spec)


def table(rows: list[dict]) -> list[str]:
    out = ["| contender | strategy | prec | step s median [q1–q3] | tokens/s | peak RSS/rank MiB (train / setup) "
           "| tracked peak MiB | params / optim state / optim copies MiB per rank | first loss | checks |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['contender']} | {r['strategy']} | {r['precision']} | **failed** | | | | | | "
                       f"`{r['error'].splitlines()[0][:300]}` |")
            continue
        chk = "; ".join(r["checks"]) if r["checks"] else "ok"
        out.append(
            f"| {r['contender']} | {r['strategy']} | {r['precision']} | {r['step_s_median']:.3f} "
            f"[{r['step_s_q1']:.3f}–{r['step_s_q3']:.3f}] | {r['tokens_per_s']:.0f} | "
            f"{r['train_peak_rss'] / MiB:.0f} / {r['setup_peak_rss'] / MiB:.0f} | "
            f"{_f(r['tracked_peak'] / MiB if r['tracked_peak'] else None, '.1f')} | "
            f"{r['param_bytes'] / MiB:.1f} / {r['optim_state_bytes'] / MiB:.1f} / {r['optim_param_copy_bytes'] / MiB:.1f}"
            f" | {r['first_loss']:.6f} | {chk} |")
    return out


def headline_lines(h: dict) -> list[str]:
    out = ["Framework overhead (torchloom ÷ hand-written PyTorch, median step time; per-round range; goal ≤ 1.02):", ""]
    for o in h["overhead"]:
        out.append(f"- {o['strategy']}: **{o['ratio']:.3f}×** (rounds {o['round_ratio_min']:.3f}–"
                   f"{o['round_ratio_max']:.3f})" + ("" if o["valid"] else " — a check failed, see the table"))
    if h["zero3_ac_bf16_vs_ddp"]:
        out += ["", "ZeRO-3 + activation checkpointing + bf16 vs DDP fp32 (same global batch; cut = DDP ÷ ZeRO-3):", ""]
    for z in h["zero3_ac_bf16_vs_ddp"]:
        out.append(f"- {z['family']}: tracked peak cut {_f(z['tracked_peak_cut'], '.2f')}×, params+optimizer "
                   f"bytes cut {z['state_bytes_cut']:.2f}×, peak RSS cut {z['train_rss_cut']:.2f}× "
                   f"(setup {z.get('setup_rss_cut', float('nan')):.2f}×), throughput "
                   f"ratio {z['throughput_ratio']:.2f}×" + ("" if z["valid"] else " — a check failed"))
    out += ["", "torchloom vs each peer's best valid configuration (step time ratio, < 1 = torchloom faster):", ""]
    for v in h["vs_peers"]:
        same = (f"; same strategy {v['same_strategy']}: {v['same_strategy_ratio']:.3f}×"
                if v["same_strategy"] else "")
        prec = (f"; best at {v['peer_precision']} {v['loom_best_same_precision']}: {v['same_precision_ratio']:.3f}×"
                if v.get("loom_best_same_precision") and v["loom_best_same_precision"] != v["loom_best"] else "")
        out.append(f"- {v['peer']} best = {v['peer_best']}: torchloom best ({v['loom_best']}) "
                   f"{v['best_ratio']:.3f}×{prec}{same}")
    return out


def plot(section: dict, path: str) -> None:
    """One PNG: tokens/s (error bars: quartiles), median step time, peak RSS and tracked peak per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in section["rows"] if "error" not in r]
    if not rows:
        return
    names = [r["contender"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(17, 0.38 * len(rows) + 2.2), sharey=True)
    y = range(len(rows))
    tok = [r["tokens_per_s"] for r in rows]
    tq = [[t - section["tokens_per_step"] / r["step_s_q3"] for t, r in zip(tok, rows)],
          [section["tokens_per_step"] / r["step_s_q1"] - t for t, r in zip(tok, rows)]]
    colors = ["tab:red" if r["checks"] else ("tab:green" if r["family"] == "loom" else "tab:blue") for r in rows]
    axes[0].barh(y, tok, xerr=tq, color=colors)
    axes[0].set_xlabel("tokens/s (median, quartile bars)")
    axes[1].barh(y, [r["step_s_median"] for r in rows], color=colors)
    axes[1].set_xlabel("step time s (median)")
    axes[2].barh([i - 0.2 for i in y], [r["train_peak_rss"] / MiB for r in rows], height=0.4, label="peak RSS")
    axes[2].barh([i + 0.2 for i in y], [(r["tracked_peak"] or 0) / MiB for r in rows], height=0.4,
                 label="tracked tensor peak")
    axes[2].set_xlabel("MiB per rank (largest rank)")
    axes[2].legend(loc="lower right", fontsize=8)
    axes[0].set_yticks(list(y), names)
    axes[0].invert_yaxis()
    fig.suptitle(f"{section['model']} ({section['n_params'] / 1e6:.1f} M params), {section['world']} gloo ranks, "
                 f"global batch {section['global_batch']} x {section['seq_len']}  (green: torchloom, red: a "
                 f"check failed)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write(result: dict, stem: str) -> list[str]:
    """Writes ``stem.json``, ``stem.md`` and ``stem_{model}_w{world}.png``; returns the paths."""
    paths = [stem + ".json", stem + ".md"]
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1)
    env = result["environment"]
    load = " / ".join(" ".join(f"{x:.1f}" for x in env.get(k) or []) for k in ("loadavg_at_start", "loadavg_at_end"))
    md = [f"# Training throughput and memory: torchloom vs peers", "",
          f"Command: `{result['command']}`  ", f"Started {result['started']}, finished {result['finished']} (UTC).  ",
          f"Machine: {env['cpu']}, {env['cores']} cores, {_f(env['mem_bytes'] / 2**30 if env['mem_bytes'] else None, '.0f')} GiB, "
          f"Linux {env['kernel']}, Python {env['python']}; load average (1, 5, 15 min) at the start / end {load}.  ",
          "Versions: " + ", ".join(f"{k} {v}" for k, v in env["versions"].items()) + ".", ""]
    for sec in result["sections"]:
        md += [f"## {sec['model']} ({sec['n_params'] / 1e6:.2f} M parameters), {sec['world']} processes", "",
               f"Global batch {sec['global_batch']} x {sec['seq_len']} tokens, AdamW, {sec['steps']} timed steps after "
               f"{sec['warmup']} warm-up per launch, {sec['rounds']} interleaved rounds (reversed every other), "
               f"{sec['threads']} torch thread(s) per rank. Step time: the slowest rank's, median and quartiles "
               f"over all timed steps of all rounds.", ""]
        md += table(sec["rows"]) + [""] + headline_lines(sec["headlines"]) + [""]
        png = f"{stem}_{sec['model']}_w{sec['world']}.png"
        plot(sec, png)
        if os.path.exists(png):
            paths.append(png)
            md += [f"![{sec['model']} w{sec['world']}]({os.path.basename(png)})", ""]
        fails = [r for r in sec["rows"] if "error" in r]
        for r in fails:
            md += [f"<details><summary>{r['contender']} failed: {r['error'].splitlines()[0][:200]}</summary>", "",
                   "```", (r.get("traceback") or r.get("stderr_tail") or "")[-2500:], "```", "</details>", ""]
    with open(stem + ".md", "w") as f:
        f.write("\n".join(md) + "\n")
    return paths
