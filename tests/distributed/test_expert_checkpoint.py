"""Checkpoints of expert-parallel models: save at ep=2, load at ep=1 and ep=4 (resharding the experts).

The model is a tiny Mixtral (4 fused experts, top-2, 2 layers; ``tests.models.tiny_moe``) whose experts are
DTensors ``Shard(0)`` over ``mesh["ep"]`` (see ``_ep_ckpt_workers``). Saved (uninterrupted runs, 4 steps,
checkpoint after step 2, both tiers: DCP disk and flash with its savers):

* ``f2``: 2 ranks, FSDP, ep=2 (edp=1);
* ``f4``: 4 ranks, FSDP, dp=4, ep=2 (experts FSDP over edp=2: ``(_StridedShard(0), Shard(0))``);
* ``d4``: 4 ranks, DDP, dp=4, ep=2 (experts left out of DDP, reduced over edp);
* ``t4``: 4 ranks, FSDP, dp_shard=2 x tp=2, ep=2: each rank's (edp, ep) mesh holds other ranks than its
  tp peer's, so a mesh rebuilt from one rank's view (the flash tier's old way) is wrong;
* ``a4``: 4 ranks, ``auto_accelerate`` with ``expert_parallel`` (all-to-all dispatch) and ``fsdp``, ep=2.

Loaded into a differently initialised model: ep=4 on 4 ranks (FSDP), ep=1 on 2 ranks (FSDP) and on 1
process (plain), from disk, from flash (memory at the same world size, else the savers' disk copy), SGD
(momentum) and AdamW. Checks, and why the tolerances are what they are:

* loaded weights and optimizer state are *bitwise* equal to the saved full values (fp32, no arithmetic);
* step 4 after the resume equals step 4 of the uninterrupted run: losses rel 1e-5, parameters abs 1e-6
  (SGD and AdamW; only the reduction order changes with the layout);
* every uninterrupted run equals the one-process reference that runs the same micro-batches with
  gradient accumulation (losses rel 1e-5, parameters abs 1e-6 SGD / 3e-4 AdamW, see ``REF_ABS``), so the
  resumed runs are compared with correct training;
* a wrong resume lands more than 10x the tolerances away (checked: optimizer state lost, or no resume);
  a permuted expert row is off by the weights' own scale (~1e-2);
* consolidated export (``export_from_dcp``, what ``loom ckpt export`` writes) holds full ``[E, ...]``
  experts equal to the saved values; a checkpoint whose expert bytes are damaged is never loaded.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.distributed import _ep_ckpt_workers as W
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed

OPTIMS = ("sgd", "adamw")
SAVES = {  # name: (world, layout, ep, tp)
    "f2": (2, "fsdp", 2, 1),
    "f4": (4, "fsdp", 2, 1),
    "d4": (4, "ddp", 2, 1),
    "t4": (4, "fsdp", 2, 2),
    "a4": (4, "auto-fsdp", 2, 1),  # auto_accelerate: expert_parallel (all-to-all) + fsdp
}
LOSS_REL = 1e-5
# Parameters after step 4. Resumed vs uninterrupted: only the reduction order differs (measured: SGD
# <= 7.5e-9, AdamW <= 1.2e-7). Uninterrupted vs the one-process reference: the same for SGD (1.5e-8); AdamW's
# first steps divide by sqrt(v) of a single gradient, which turns rounding of gradients that nearly cancel
# into visible steps (measured <= 6e-5 at lr 1e-2). A wrong resume lands at >= 2e-2 (measured: optimizer
# state lost 2.4e-2 SGD / 3.5e-2 AdamW; no resume 2e-2 / 3.3e-2): test_a_wrong_resume_is_far_outside_the_tolerance.
RESUME_ABS = {"sgd": 1e-6, "adamw": 1e-6}
REF_ABS = {"sgd": 1e-6, "adamw": 3e-4}


def _save(name, optim):
    world, layout, ep, tp = SAVES[name]
    return dict(kind="save", name=f"{name}_{optim}", layout=layout, ep=ep, optim=optim, tp=tp)


def _load(source, optim, tier, layout, ep):
    return dict(kind="load", source=f"{source}_{optim}", tier=tier, layout=layout, ep=ep, optim=optim)


# (label, world, job): every load names its source save and where it is loaded
LOADS_4 = [(f"{s}_{o}->ep4_{t}", _load(s, o, t, "fsdp", 4)) for o in OPTIMS
           for s, tiers in (("f4", ("disk", "flash")), ("d4", ("disk", "flash")), ("f2", ("disk", "flash")))
           for t in tiers] + [(f"t4_sgd->ep4_{t}", _load("t4", "sgd", t, "fsdp", 4)) for t in ("flash", "flash-disk")]
LOADS_4 += [(f"a4_{o}->auto-ep4_{t}", _load("a4", o, t, "auto-fsdp", 4)) for o in OPTIMS for t in ("disk", "flash")]
LOADS_4 += [("a4_sgd->auto-ddp-ep2_disk", _load("a4", "sgd", "disk", "auto-ddp", 2))]
LOADS_2 = [(f"{s}_{o}->ep1x2_{t}", _load(s, o, t, "fsdp", 1)) for o in OPTIMS
           for s, tiers in (("f4", ("disk", "flash")), ("d4", ("disk",)), ("f2", ("disk", "flash")), ("a4", ("disk",)))
           for t in tiers]
LOADS_1 = [(f"{s}_{o}->ep1x1_{t}", _load(s, o, t, "plain", 1)) for o in OPTIMS
           for s in ("f2", "f4", "d4", "a4") for t in ("disk", "flash")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from torchloom import checkpoint

    tmp = str(tmp_path_factory.mktemp("ep_ckpt"))
    saves, loads = {}, {}

    def launch(world, jobs, labels):
        results = run_ranks(W.run_jobs, world, tmp, jobs, timeout=1500)[0]
        for label, r in zip(labels, results):
            (saves if label in SAVES_LABELS else loads)[label] = r

    SAVES_LABELS = {f"{n}_{o}" for n in SAVES for o in OPTIMS}
    two = [_save("f2", o) for o in OPTIMS]
    launch(2, two, [j["name"] for j in two])
    four = [_save(n, o) for n in ("f4", "d4", "a4") for o in OPTIMS] + [_save("t4", "sgd")]
    launch(4, four + [j for _l, j in LOADS_4], [j["name"] for j in four] + [lbl for lbl, _j in LOADS_4])
    launch(2, [j for _l, j in LOADS_2], [lbl for lbl, _j in LOADS_2])
    for label, job in LOADS_1:
        job = dict(job)
        job.pop("kind")
        loads[label] = W.load_job(tmp, **job)  # one process, no process group
    refs, wrong = {}, {}
    for o in OPTIMS:
        ref = W.Job("plain", 1, o)
        refs[o] = {"losses": [ref.step(s) for s in range(1, W.STEPS + 1)], "final": ref.full()}
        # a wrong resume: the weights come back but the optimizer state does not
        lost = W.Job("plain", 1, o, seed=5)
        checkpoint.load(Path(tmp) / f"f4_{o}" / "disk", model=lost.model)
        for s in range(W.SAVE_AT + 1, W.STEPS + 1):
            lost.step(s)
        wrong[o] = lost.full()
    return {"tmp": Path(tmp), "saves": saves, "loads": loads, "refs": refs, "wrong": wrong}


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_saving_runs_use_the_expert_layouts_and_match_the_reference(runs):
    s = runs["saves"]
    assert s["f4_sgd"]["placements"] == ["DTensor:('edp', 'ep'):(_StridedShard(dim=0, sf=2), Shard(dim=0))"]
    assert s["d4_sgd"]["placements"] == ["DTensor:('ep',):(Shard(dim=0),)"]
    assert s["t4_sgd"]["placements"] == s["f2_sgd"]["placements"] == s["f4_sgd"]["placements"]
    assert s["a4_sgd"]["placements"] == s["f4_sgd"]["placements"]  # expert_parallel + fsdp: the same layout
    for name, r in s.items():
        optim = name.rsplit("_", 1)[1]
        ref = runs["refs"][optim]
        assert r["losses"] == pytest.approx(ref["losses"], rel=LOSS_REL), name
        diff = _max_diff(r["final"], ref["final"])
        print(f"{name}: step {W.STEPS} vs the one-process reference: max |param diff| {diff:.2e}")
        assert diff < REF_ABS[optim], name


@pytest.mark.parametrize("optim", OPTIMS)
def test_a_wrong_resume_is_far_outside_the_tolerance(runs, optim):
    """The tolerance sits far below what a wrong resume produces: weights loaded but optimizer state lost,
    or no resume at all (the two steps after the save)."""
    s = runs["saves"][f"f4_{optim}"]
    lost, none = _max_diff(runs["wrong"][optim], s["final"]), _max_diff(s["saved"], s["final"])
    tol = max(RESUME_ABS[optim], REF_ABS[optim])
    print(f"{optim}: optimizer state lost -> {lost:.2e}; no resume -> {none:.2e} (tolerance {tol:.0e})")
    assert lost > 10 * tol and none > 10 * tol


@pytest.mark.parametrize("label", [lbl for lbl, _j in LOADS_4 + LOADS_2 + LOADS_1])
def test_resume_in_another_expert_layout(runs, label):
    src = runs["saves"][label.split("->")[0]]
    r = runs["loads"][label]
    assert r["step"] == W.SAVE_AT
    if label.endswith("_flash"):  # memory at the snapshot's world size, else the savers' disk copy
        target = label.split("->")[1].rsplit("_", 1)[0]
        same_world = SAVES[label.split("_")[0]][0] == {"ep4": 4, "auto-ep4": 4, "ep1x2": 2, "ep1x1": 1}[target]
        assert r["source"] == ("memory" if same_world else "disk"), label
    bad = sorted(k for k in src["saved"] if not torch.equal(src["saved"][k], r["loaded"][k]))
    assert not bad, f"{label}: loaded weights differ from the saved ones: {bad}"
    assert r["loaded_optim"].keys() == src["saved_optim"].keys()
    bad = sorted(k for k in src["saved_optim"] if not torch.equal(src["saved_optim"][k], r["loaded_optim"][k]))
    assert not bad, f"{label}: loaded optimizer state differs: {bad}"
    assert r["losses"] == pytest.approx(src["losses"][W.SAVE_AT:], rel=LOSS_REL), label
    diff = _max_diff(r["final"], src["final"])
    print(f"{label}: step {W.STEPS} after the resume vs uninterrupted: max |param diff| {diff:.2e}")
    assert diff < RESUME_ABS[label.split("->")[0].rsplit("_", 1)[1]], label


def test_export_consolidates_the_experts(runs, tmp_path):
    from safetensors.torch import load_file

    from torchloom.checkpoint import export_from_dcp

    for name in ("f2_sgd", "f4_adamw", "d4_sgd", "t4_sgd", "a4_adamw"):
        for tier in ("disk", "flash", "live"):
            if tier == "live":  # export_safetensors of the sharded live model, at the save
                out = runs["tmp"] / name / "live.safetensors"
            else:  # export_from_dcp, offline (loom ckpt export)
                out = export_from_dcp(runs["tmp"] / name / tier, tmp_path / f"{name}_{tier}.safetensors")
            got = load_file(str(out))
            saved = runs["saves"][name]["saved"]
            assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
            assert got.keys() == saved.keys() and all(torch.equal(got[k], saved[k]) for k in saved), (name, tier)


def test_damaged_expert_bytes_are_never_loaded(runs, tmp_path):
    """Copy f4's checkpoint as a newer step and flip bytes inside the region of one expert shard: the
    resume skips it (its checksum differs from the COMPLETE marker) and loads the good one."""
    import shutil

    from torchloom import checkpoint
    from torchloom.checkpoint.state import read_metadata_safely

    root = tmp_path / "root"
    good = runs["tmp"] / "f4_sgd" / "disk" / f"step_{W.SAVE_AT:08d}"
    shutil.copytree(good, root / good.name)
    bad = root / f"step_{W.SAVE_AT + 1:08d}"
    shutil.copytree(good, bad)
    marker = json.loads((bad / "COMPLETE").read_text())
    marker["step"] = W.SAVE_AT + 1
    (bad / "COMPLETE").write_text(json.dumps(marker))
    md = read_metadata_safely(bad / ".metadata")
    idx, info = next((i, v) for i, v in md.storage_data.items() if "experts.gate_up_proj" in i.fqn
                     and i.fqn.startswith("model."))
    with open(bad / info.relative_path, "r+b") as f:
        f.seek(info.offset + info.length // 2)
        f.write(b"\xff" * 16)
    job = W.Job("plain", 1, "sgd", seed=5)
    info = checkpoint.load(root, model=job.model, optimizer=job.opt)
    assert info["path"].name == good.name
    assert torch.equal(job.full()["model.layers.0.mlp.experts.gate_up_proj"],
                       runs["saves"]["f4_sgd"]["saved"]["model.layers.0.mlp.experts.gate_up_proj"])
    with pytest.raises(checkpoint.CorruptCheckpointError, match="SHA-256|different bytes"):
        checkpoint.check(bad)

