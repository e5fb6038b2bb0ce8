"""Tensor, sequence and loss parallelism against single-process references (tiny Hugging Face models,
3 steps, global batch 8, sequence 16): one 2-rank and one 4-rank launch, checked by several tests.

Tolerances (fp32, differences come only from the order of sums: split matmuls, all-reduces):
- SGD + momentum: losses rtol 1e-5, parameters atol 2e-5 (as tests/distributed/test_methods_equivalence.py).
- AdamW / Adam: losses rtol 1e-5; parameters atol 1e-3 (a tenth of one lr=1e-2 update) and at most 0.1% of
  them beyond 2e-5 (the update divides by sqrt(v), amplifying rounding where gradients are tiny).
- amp bf16: losses rtol 2e-3 of the bf16-autocast reference.
- C13 fixed gradients: norm rtol 1e-6, clipped gradients rtol 1e-6 / atol 1e-9; C13 training: norms rtol 1e-5,
  parameters rtol 1e-5 / atol 1e-6 (tests/cases/test_c13_grad_norm_clipping.py).
- DCP round trip: parameters bit-identical after load.
"""
import functools

import pytest
import torch

from tests.cases._workers import C13_MAX_NORM, c13_reference
from tests.distributed._tp_workers import reference, suite
from torchloom.testing import run_ranks

TP2 = ("parallel_mode", {"tp": 2})
TP = [TP2, "tensor_parallel"]
SP, LP = "sequence_parallel", "loss_parallel"

# name: (train() kwargs, reference() kwargs)
TWO_RANKS = {
    "tp": (dict(strategy=TP), dict()),
    "tp_sp": (dict(strategy=TP + [SP]), dict()),
    "tp_lp": (dict(strategy=TP + [LP]), dict()),
    "tp_sp_lp_accum": (dict(strategy=TP + [SP, LP], micro_batch=2, eval_loss=True), dict(eval_batch=2)),
    "tp_lp_user_loss": (dict(strategy=TP + [LP], loss="logits_ce"), dict(loss="logits_ce")),
    "tp_checkpoint": (dict(strategy=TP + [SP, "checkpoint"]), dict()),
    "tp_sp_padding_mask": (dict(strategy=TP + [SP], micro_batch=8, padded=True), dict(padded=True)),
    "tp_adamw": (dict(strategy=TP, optim="adamw"), dict(optim="adamw")),
    "tp_adam": (dict(strategy=TP, optim="adam"), dict(optim="adam")),
    "tp_clip": (dict(strategy=TP + [SP, LP], max_grad_norm=0.5), dict(max_grad_norm=0.5)),
    "tp_amp_bf16": (dict(strategy=TP + ["amp"]), dict(autocast_dtype=torch.bfloat16)),
    "llama_tied_sp": (dict(strategy=TP + [SP], model="llama_tied"), dict(model="llama_tied")),
    "gpt2": (dict(strategy=TP, model="gpt2"), dict(model="gpt2")),
    "gpt2_lp": (dict(strategy=TP + [LP], model="gpt2"), dict(model="gpt2")),
    "bert": (dict(strategy=TP + [LP], model="bert"), dict(model="bert")),
    "mistral_sp": (dict(strategy=TP + [SP], model="mistral"), dict(model="mistral")),
    "mixtral": (dict(strategy=TP, model="mixtral"), dict(model="mixtral")),
    "mixtral_sp_lp": (dict(strategy=TP + [SP, LP], model="mixtral"), dict(model="mixtral")),
}

FSDP_2D = [("parallel_mode", {"dp_shard": 2, "tp": 2}), "tensor_parallel", "fsdp"]
FOUR_RANKS = {
    "fsdp_2d": (dict(strategy=FSDP_2D), dict()),
    "hsdp_replicate_tp": (dict(strategy=[("parallel_mode", {"dp_replicate": 2, "tp": 2}), "tensor_parallel", "fsdp"]),
                          dict()),
    "fsdp_2d_sp_lp_ac_accum": (dict(strategy=FSDP_2D + [SP, LP, "checkpoint"], micro_batch=2), dict()),
    "gpt2_tp4": (dict(strategy=[("parallel_mode", {"tp": 4}), "tensor_parallel"], model="gpt2", micro_batch=8),
                 dict(model="gpt2")),
    "bert_tp4": (dict(strategy=[("parallel_mode", {"tp": 4}), "tensor_parallel"], model="bert", micro_batch=8),
                 dict(model="bert")),
    "gpt2_fsdp_2d": (dict(strategy=FSDP_2D, model="gpt2"), dict(model="gpt2")),
    "mixtral_fsdp_2d_sp": (dict(strategy=FSDP_2D + [SP], model="mixtral"), dict(model="mixtral")),
    # dp=2 without a data-parallel method: fsdp over dp_replicate is added (ddp cannot hold DTensors)
    "auto_dp": (dict(strategy=TP), dict()),
}


def _ref(kwargs):
    return _cached_reference(tuple(sorted(kwargs.items())))


@functools.lru_cache(maxsize=None)
def _cached_reference(items):
    return reference(**dict(items))


def _assert_matches(name, out, ref, optim="sgd"):
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=1e-5, atol=0,
                               msg=lambda m: f"{name} losses: {m}")
    assert set(out["params"]) == set(ref["params"]), f"{name}: {set(out['params']) ^ set(ref['params'])}"
    atol = 2e-5 if optim == "sgd" else 1e-3
    off, total = 0, 0
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v.float(), atol=atol, rtol=0, msg=lambda m: f"{name} {k}: {m}")
        off += int(((out["params"][k] - v.float()).abs() > 2e-5).sum())
        total += v.numel()
    assert off <= 1e-3 * total, f"{name}: {off} of {total} parameters differ by more than 2e-5"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    configs = [cfg for cfg, _ in TWO_RANKS.values()]
    ckpt = dict(root=str(tmp_path_factory.mktemp("tp_ckpt")), model="gpt2", strategy=TP + [LP],
                other_strategy=["fsdp"])
    c13 = {"tp2": TP, "tp2_sp": TP + [SP]}
    return run_ranks(suite, 2, configs, c13=c13, checkpoint=ckpt, timeout=900)


@pytest.fixture(scope="module")
def four_ranks():
    configs = [cfg for cfg, _ in FOUR_RANKS.values()]
    configs.append(dict(strategy=FSDP_2D, meta=True))
    c13 = {"tp2_fsdp2": FSDP_2D}
    expect_error = [("parallel_mode", {"dp": 2, "tp": 2}), "tensor_parallel", "ddp"]
    return run_ranks(suite, 4, configs, c13=c13, expect_error=expect_error, timeout=900)


@pytest.mark.distributed
def test_tp_sp_lp_families_match_reference_2ranks(two_ranks):
    """Every 2-rank configuration (except amp) equals the reference; every rank holds the same full
    parameters, including the plain (norm) ones: their gradients are identical on the tp ranks."""
    for (name, (cfg, ref_kw)), o0, o1 in zip(TWO_RANKS.items(), two_ranks[0]["train"], two_ranks[1]["train"]):
        for k, v in o0["params"].items():
            assert torch.equal(v, o1["params"][k]), f"{name}: {k} differs across tp ranks"
        if name == "tp_amp_bf16":
            continue
        ref = _ref(ref_kw)
        _assert_matches(name, o0, ref, cfg.get("optim", "sgd"))
        if "eval_loss" in ref:  # AccelerateResult.forward_loss under loss parallel
            assert o0["eval_loss"] == pytest.approx(ref["eval_loss"], rel=1e-5)
        if "max_grad_norm" in ref_kw:
            torch.testing.assert_close(torch.tensor(o0["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
            assert ref["norms"][0] > 0.5  # really clipped


@pytest.mark.distributed
def test_tp_amp_bf16_2ranks(two_ranks):
    out = dict(zip(TWO_RANKS, two_ranks[0]["train"]))["tp_amp_bf16"]
    ref = _ref(dict(autocast_dtype=torch.bfloat16))
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=2e-3, atol=0)
    assert "amp: forward runs under torch.autocast" in " ".join(out["notes"])


@pytest.mark.distributed
def test_layouts_ties_and_notes_2ranks(two_ranks):
    out = dict(zip(TWO_RANKS, two_ranks[0]["train"]))
    llama = out["tp"]["layouts"]
    assert llama["placements"]["model.layers.0.self_attn.q_proj.weight"] == ("S(0)",)
    assert llama["placements"]["model.layers.0.self_attn.o_proj.weight"] == ("S(1)",)
    assert llama["placements"]["model.embed_tokens.weight"] == ("S(0)",)
    assert llama["placements"]["model.norm.weight"] is None  # plain without SP
    assert llama["local_shapes"]["model.layers.0.self_attn.k_proj.weight"] == (16, 64)  # 1 of 2 kv heads
    assert out["tp_sp"]["layouts"]["placements"]["model.norm.weight"] == ("R",)
    # GPT-2: fused q/k/v strided over the ranks, original layout kept; tied wte/lm_head still one parameter
    gpt2 = out["gpt2"]["layouts"]
    assert gpt2["placements"]["transformer.h.0.attn.c_attn.weight"] == ("_S(1, 3)",)
    assert gpt2["local_shapes"]["transformer.h.0.attn.c_attn.weight"] == (64, 96)
    assert ["lm_head.weight", "transformer.wte.weight"] in gpt2["tied"]
    assert ["lm_head.weight", "model.embed_tokens.weight"] in out["llama_tied_sp"]["layouts"]["tied"]
    bert_tied = out["bert"]["layouts"]["tied"]
    assert ["bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"] in bert_tied
    assert ["cls.predictions.bias", "cls.predictions.decoder.bias"] in bert_tied
    mixtral = out["mixtral"]["layouts"]
    assert mixtral["placements"]["model.layers.0.mlp.experts.gate_up_proj"] == ("_S(1, 2)",)
    assert mixtral["local_shapes"]["model.layers.0.mlp.experts.down_proj"] == (4, 64, 64)
    assert mixtral["placements"]["model.layers.0.mlp.gate.weight"] is None  # router replicated
    # optimizers get foreach=False for lists mixing DTensor and plain parameters (SGD, AdamW, Adam); with
    # sequence parallelism every Llama parameter is a DTensor on the tp mesh, and the default stays
    for name in ("tp", "tp_adamw", "tp_adam", "mixtral", "mixtral_sp_lp"):
        assert out[name]["optimizer_foreach"] is False, name
        assert any("foreach=False" in n for n in out[name]["notes"]), name
    assert out["tp_sp"]["optimizer_foreach"] is None
    assert "sequence parallel, loss parallel" in " ".join(out["tp_clip"]["notes"])


@pytest.mark.distributed
def test_c13_tp_grad_norm_clipping(two_ranks, four_ranks):
    """C13, tensor-parallel part: the clipping norm is global over DTensor (sharded, replicated) and plain
    gradients; equal on every rank and to torch.nn.utils.clip_grad_norm_ on the plain model."""
    ref = c13_reference()
    for results in (two_ranks, four_ranks):
        for tag in results[0]["c13"]:
            for rank, r in enumerate(results):
                got = r["c13"][tag]
                for norm_type in (2.0, float("inf")):
                    total, grads = got[norm_type]
                    ref_total, ref_grads = ref[norm_type]
                    assert torch.equal(total, results[0]["c13"][tag][norm_type][0]), f"{tag} rank {rank}"
                    torch.testing.assert_close(total, ref_total, rtol=1e-6, atol=0)
                    assert ref_total > 5 * C13_MAX_NORM
                    for n, g in ref_grads.items():
                        torch.testing.assert_close(grads[n], g, rtol=1e-6, atol=1e-9,
                                                   msg=lambda m: f"{tag} {norm_type} {n}: {m}")
                norms, params = got["train"]
                torch.testing.assert_close(norms, ref["train"][0], rtol=1e-5, atol=0)
                for n, p in ref["train"][1].items():
                    torch.testing.assert_close(params[n], p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{tag} {n}: {m}")


@pytest.mark.distributed
def test_dcp_round_trip_and_load_into_non_tp_run(two_ranks):
    """GPT-2 (fused, strided q/k/v) with TP + loss parallel: the checkpoint loads into a fresh TP run and
    into a plain fsdp run (DCP reshards); both continue exactly like the saving run (optimizer state too)."""
    for r in two_ranks:
        ck = r["checkpoint"]
        for tag in ("tp", "other"):
            assert any(not torch.equal(ck[f"{tag}_before_load"][k], v) for k, v in ck["saved"].items())
            for k, v in ck["saved"].items():
                assert torch.equal(ck[f"{tag}_loaded"][k], v), f"{tag}: {k} differs after load"
            assert ck[f"{tag}_steps"] == 3
            assert ck[f"{tag}_next_loss"] == pytest.approx(ck["next_loss"], rel=1e-6)
            for k, v in ck["after_step"].items():
                torch.testing.assert_close(ck[f"{tag}_after_step"][k], v, atol=2e-6, rtol=0,
                                           msg=lambda m: f"{tag} {k}: {m}")


@pytest.mark.distributed
def test_dp_x_tp_and_tp4_match_reference_4ranks(four_ranks):
    """FSDP2 over dp_shard with TP DTensor parameters (2-D, torchtitan), HSDP replicas x TP, SP + loss
    parallel + activation checkpointing with accumulation, TP=4 (GPT-2, BERT), fused GPT-2 q/k/v and
    Mixtral experts under 2-D sharding."""
    outs = four_ranks[0]["train"]
    for (name, (cfg, ref_kw)), out in zip(FOUR_RANKS.items(), outs):
        _assert_matches(name, out, _ref(ref_kw))
        for r in range(1, 4):
            for k, v in out["params"].items():
                assert torch.equal(v, four_ranks[r]["train"][list(FOUR_RANKS).index(name)]["params"][k]), (name, k)
    notes = dict(zip(FOUR_RANKS, outs))
    assert "dp_shard=2" in " ".join(notes["fsdp_2d"]["notes"])
    assert notes["fsdp_2d"]["layouts"]["placements"]["model.layers.0.self_attn.q_proj.weight"] == ("_S(0, 2)", "S(0)")
    assert "tp=4" in " ".join(notes["gpt2_tp4"]["notes"])
    assert "added fsdp over dp_replicate" in " ".join(notes["auto_dp"]["notes"])


@pytest.mark.distributed
def test_meta_init_and_ddp_refusal_4ranks(four_ranks):
    """A meta-device model is sharded by TP and FSDP, then materialised shard by shard (sane init, same on
    every rank); dp > 1 with tensor_parallel and an explicit ddp is refused with the fix."""
    meta = four_ranks[0]["train"][len(FOUR_RANKS)]
    losses = torch.tensor(meta["losses"])
    assert torch.isfinite(losses).all() and abs(losses[0] - torch.log(torch.tensor(128.0))) < 0.5
    for r in range(1, 4):
        for k, v in meta["params"].items():
            assert torch.equal(v, four_ranks[r]["train"][len(FOUR_RANKS)]["params"][k])
    assert "'tensor_parallel' and 'ddp' cannot be combined" in four_ranks[0]["error"]
    assert "Use fsdp" in four_ranks[0]["error"]
