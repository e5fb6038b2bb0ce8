"""Trainable-only checkpoints of a peft LoRA Llama on 2 ranks: bitwise resume (FSDP and DDP, disk tier; FSDP
flash tier from memory) and the load errors; and a 2-stage pipeline with frozen layers (each stage holds
part of the trainable set). One launch (``trainable_only_rank``) does all of it.

A run trains 4 AdamW steps (2 micro-batches each, StepLR, the elastic dataloader) and saves at step 2
with ``trainable_only=True``; a fresh model (base rebuilt from the same seed, adapters re-initialised) loads
it and trains steps 3-4. Bitwise equality (``torch.equal``, losses ``==``) is expected: the resumed run
replays the same float operations on the same bits (same adapters, AdamW state and step, learning rate,
data position and RNG; CPU kernels and gloo reductions are deterministic).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed._trainable_only_workers import trainable_only_rank
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trainable_only")
    return tmp, run_ranks(trainable_only_rank, 2, str(tmp), env={"HF_HUB_OFFLINE": "1"})


@pytest.mark.parametrize("name", ["fsdp", "ddp"])
def test_resume_from_trainable_only_checkpoint_is_bitwise(ranks, name):
    _tmp, results = ranks
    for r in results:
        case = r[name]
        assert case["disk_step"] == 2
        assert case["disk_tail_equal"], f"rank {r['rank']}: resumed losses differ"
        assert case["disk_diff"] == [], f"rank {r['rank']}: final params differ: {case['disk_diff'][:5]}"


def test_flash_tier_trainable_only(ranks):
    tmp, results = ranks
    for r in results:
        case = r["fsdp"]
        assert (case["flash_source"], case["flash_step"]) == ("memory", 2)
        assert case["flash_tail_equal"] and case["flash_diff"] == []
    persisted = Path(results[0]["fsdp"]["flash_persisted"])  # what the savers wrote is trainable-only too
    disk = tmp / "fsdp" / "ckpt" / "step_00000002"
    assert json.loads((persisted / "trainer_state.json").read_text())["trainable_only"]["params"] == \
        json.loads((disk / "trainer_state.json").read_text())["trainable_only"]["params"]
    assert not any("base_layer" in k for k in _model_keys(persisted))
    assert _model_keys(persisted) == _model_keys(disk)


def _model_keys(ckpt: Path) -> set[str]:
    from torchloom.checkpoint.state import read_metadata_safely

    return {k for k in read_metadata_safely(ckpt / ".metadata").state_dict_metadata if k.startswith("model.")}


def test_fsdp_checkpoint_loads_into_ddp(ranks):
    """Another wrapping shards the frozen base differently: its fingerprint (float64 sums) still agrees."""
    for r in ranks[1]:
        assert r["ddp_from_fsdp_diff"] == []


def test_load_errors_name_the_keys_on_every_rank(ranks):
    for r in ranks[1]:
        err = r["err_trainable"]  # v_proj adapters saved, the model has none
        assert err and "failed on 2 rank(s)" in err and "saved trainable parameters are not in the model" in err
        assert "layers.0.self_attn.v_proj.lora_A.default.weight" in err
        err = r["err_untrained_adapter"]  # a k_proj adapter the checkpoint lacks: it would stay untrained
        assert err and "trainable in the model but not in the checkpoint" in err and "k_proj.lora_A" in err
        err = r["err_base"]  # another base (seed 1)
        assert err and "frozen parameters hold other values" in err and "strict=False" in err
        assert r["lenient_warnings"] and "hold other values" in r["lenient_warnings"][0]
        assert r["lenient_adapters_loaded"]  # strict=False: warned, adapters loaded onto that base


def test_pipeline_stages_resume_bitwise_and_check_the_union(ranks):
    for r in ranks[1]:
        pp = r["pipeline"]
        assert pp["tail_equal"] and pp["diff"] == []
        assert pp["saved_trainable"] == 8  # q/v of 4 layers over both stages
        assert pp["error"] and "failed on 2 rank(s)" in pp["error"]
        assert "['model.layers.3.self_attn.k_proj.weight']" in pp["error"]
