"""Context parallelism (ring attention) and Ulysses against single-process references: one 2-rank and one
4-rank launch, checked by several tests.

Attention (``tests/distributed/_cp_workers.attention_cases``): each rank's output and q/k/v gradient shards
against a float64 whole-sequence reference with independently built masks (causal or not, key padding with
rows that see no key, packed documents, GQA): max abs error <= 5e-6 in fp32 (the reference differs only by
fp32 rounding of the blockwise sums); with bf16 inputs at most 3x the error of PyTorch's own bf16 SDPA on the
whole sequence in one process (each block's output is rounded to bf16 by the fused kernel before the merge).
Training (``train_cases``): 3 SGD + momentum steps of tiny HF models (global batch 8, 16 tokens) under a
strategy with cp, beside the same model trained in one process: losses within 2e-6, parameters within 1e-6
(fp32; the order of sums differs); bf16 amp within 5e-4 / 5e-4 of the bf16-autocast reference. With pipeline
parallelism each rank holds its stages' parameters (compared by name, max over ranks).
"""
import functools

import pytest
import torch

from tests.distributed._cp_workers import suite
from torchloom.testing import run_ranks


def P(**d):
    return ("parallel_mode", d)


CP2 = [P(cp=2), "context_parallel", "fsdp"]


def PP(schedule):
    return ("pipeline_parallel", {"schedule": schedule, "num_microbatches": 2})


UL2 = [P(cp=2), "ulysses", "fsdp"]

ATTN = {f"{k}_{'causal' if c else 'full'}_{m}": dict(kind=k, causal=c, padded=m in ("padded", "both"),
                                                     docs=m in ("docs", "both"), hkv=4)
        for k in ("ring", "ulysses") for c in (True, False) for m in ("plain", "padded", "docs", "both")}
ATTN_2 = {**ATTN, "ring_gqa_contiguous": dict(kind="ring", causal=True, load_balance=False),
          "ring_gqa": dict(kind="ring", causal=True, hkv=2), "ulysses_gqa": dict(kind="ulysses", causal=True, hkv=2),
          "ring_bf16": dict(kind="ring", causal=True, dtype=torch.bfloat16)}
ATTN_4 = {k: v for k, v in ATTN.items() if k.endswith("both") or k.endswith("plain")}
ATTN_4["ring_gqa"] = dict(kind="ring", causal=True, hkv=2)
ATTN_4["ulysses_gqa_replicated_kv"] = dict(kind="ulysses", causal=True, hkv=2)  # 2 kv heads on 4 ranks
ATTN_4.update({f"hybrid_{m}": dict(kind="hybrid", causal=True, padded=m == "both", docs=m == "both", hkv=hkv)
               for m, hkv in (("plain", 2), ("both", 4))})
ATTN_4["ring_bf16"] = dict(kind="ring", causal=True, dtype=torch.bfloat16)

TRAIN_2 = {
    "cp": dict(strategy=CP2),
    "ulysses": dict(strategy=UL2),
    "cp_padded_sumloss_accum": dict(strategy=CP2, kind="padded", loss="sum", micro_batch=2),
    "cp_packed": dict(strategy=CP2, kind="packed"),
    "ulysses_packed_sumloss": dict(strategy=UL2, kind="packed", loss="sum"),
    "cp_checkpoint_accum": dict(strategy=CP2 + ["checkpoint"], micro_batch=2),
    "cp_qwen3": dict(strategy=CP2, model="qwen3"),
    "cp_mistral": dict(strategy=CP2, model="mistral"),
    "cp_mixtral": dict(strategy=CP2, model="mixtral"),
    "cp_amp_bf16": dict(strategy=CP2 + ["amp"], amp=True),
}
TRAIN_4 = {
    "cp4_padded": dict(strategy=[P(cp=4), "context_parallel", "fsdp"], kind="padded"),
    "ring2_x_ulysses2_padded_sumloss": dict(strategy=[P(cp=4), ("context_parallel", {"ulysses": 2}), "fsdp"],
                                            kind="padded", loss="sum"),
    "fsdp2_cp2_sumloss": dict(strategy=[P(dp_shard=2, cp=2), "context_parallel", "fsdp"], loss="sum"),
    "hsdp_ulysses_packed": dict(strategy=[P(dp_replicate=2, cp=2), "ulysses", "fsdp"], kind="packed"),
    "tp2_cp2_padded_sumloss": dict(strategy=[P(cp=2, tp=2), "tensor_parallel", "context_parallel", "fsdp"],
                                   kind="padded", loss="sum"),
    # pipeline stages see one micro-batch at a time: each gets its rows' masks (forward, backward, inference)
    "pp2_cp2_1f1b": dict(strategy=[P(pp=2, cp=2), PP("1f1b"), "context_parallel", "fsdp"]),
    "pp2_cp2_1f1b_padded_sumloss": dict(strategy=[P(pp=2, cp=2), PP("1f1b"), "context_parallel", "fsdp"],
                                        kind="padded", loss="sum"),
    "pp2_ulysses2_gpipe_checkpoint_packed": dict(strategy=[P(pp=2, cp=2), PP("gpipe"), "ulysses", "fsdp", "checkpoint"],
                                                 kind="packed"),
    # (SumLoss with padding: a pipeline's mean loss is the mean of its micro-batch means, as without cp)
    "pp2_cp2_interleaved_padded_sumloss": dict(
        strategy=[P(pp=2, cp=2), PP("interleaved_1f1b"), "context_parallel", "fsdp"], kind="padded", loss="sum"),
}


@functools.cache
def results(world: int) -> dict:
    attn, train = (ATTN_2, TRAIN_2) if world == 2 else (ATTN_4, TRAIN_4)
    out = run_ranks(suite, world, list(attn.values()), list(train.values()), timeout=600)
    return {"attention": {k: [r["attention"][i] for r in out] for i, k in enumerate(attn)},
            "training": {k: {**out[0]["training"][i], "dloss": max(r["training"][i]["dloss"] for r in out),
                             "dparam": max(r["training"][i]["dparam"] for r in out)} for i, k in enumerate(train)}}


@pytest.mark.parametrize("world,name", [(2, k) for k in ATTN_2] + [(4, k) for k in ATTN_4])
def test_attention_matches_whole_sequence(world, name):
    for rank, errs in enumerate(results(world)["attention"][name]):
        tol = 3 * errs["sdpa"] if "bf16" in name else 5e-6
        assert errs["finite"], (name, rank)
        for key in ("out", "dq", "dk", "dv"):
            assert errs[key] <= tol, (name, rank, key, errs[key])


@pytest.mark.parametrize("world,name", [(2, k) for k in TRAIN_2] + [(4, k) for k in TRAIN_4])
def test_training_matches_single_process(world, name):
    r = results(world)["training"][name]
    loss_tol, param_tol = (5e-4, 5e-4) if "amp" in name else (2e-6, 1e-6)
    assert r["dloss"] <= loss_tol, (name, r["losses"], r["ref_losses"])
    assert r["dparam"] <= param_tol, (name, r["dparam"])
    split = "ring attention" if "ulysses" not in name else "Ulysses"
    assert any(split in n for n in r["notes"]), r["notes"]
