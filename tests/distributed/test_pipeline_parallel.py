"""Pipeline parallel against a single-process reference (tiny 4-layer Llama / tied GPT-2, SGD with momentum,
3 steps, global batch 8).

The reference averages the same "atoms" the pipeline averages (each train_step batch cut into
num_microbatches equal row chunks; see ``_pp_workers``). Tolerances:
- losses rtol 1e-5; parameters atol 2e-5. The forward of every atom is the same computation in both; only
  the order in which gradient contributions are summed differs (per micro-batch accumulation, data-parallel
  reduction), i.e. fp32 rounding.
- the eval loss rtol 1e-5 (forward only).
"""
from __future__ import annotations

import pytest
import torch

from tests.distributed import _pp_workers as W
from torchloom.testing import run_ranks

STEPS, GB = 3, 8
LOSS_RTOL, PARAM_ATOL = 1e-5, 2e-5


def _pp(*extra, **cfg):
    return [("pipeline_parallel", {"size": 2, **cfg}), *extra]


def _check(tag, ranks, ref, params=True):
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0,
                               msg=lambda m: f"{tag} losses: {m}")
    for r in ranks[1:]:
        assert r["losses"] == ranks[0]["losses"], f"{tag}: ranks report different losses"
    if params:
        got = W.merge_params(ranks)
        assert set(got) == set(ref["params"]), set(got) ^ set(ref["params"])
        for k, v in ref["params"].items():
            torch.testing.assert_close(got[k], v, atol=PARAM_ATOL, rtol=0, msg=lambda m: f"{tag} {k}: {m}")


@pytest.mark.distributed
def test_schedules_accumulation_balancing_and_eval_match_reference_2ranks():
    """gpipe, 1f1b, interleaved 1F1B and both zero-bubble schedules; accumulation over train_step calls; split
    points and profiled balancing; forward_loss; SumLoss. One launch."""
    data = W.token_data(STEPS, GB, 4)               # 2 train_step calls per step (grad_accum_steps=2)
    data_accum4 = W.token_data(STEPS, GB, 2)        # 4 calls per step
    eval_batch = W.token_data(1, 4, 4, seq=24)[0][0]
    configs = {
        "gpipe": dict(strategy=_pp(schedule="gpipe"), data=data, eval_batch=eval_batch),
        "1f1b": dict(strategy=_pp(schedule="1f1b"), data=data, eval_batch=eval_batch),
        "interleaved_1f1b": dict(strategy=_pp(schedule="interleaved_1f1b"), data=data, eval_batch=eval_batch),
        "zero_bubble": dict(strategy=_pp(schedule="zero_bubble", num_microbatches=2), data=data,
                            eval_batch=eval_batch),
        "zbv": dict(strategy=_pp(schedule="zbv", num_microbatches=2), data=data),
        "accum4": dict(strategy=_pp(num_microbatches=2), data=data_accum4),
        "split_points": dict(strategy=_pp(split_points=["model.layers.3"]), data=data),
        "profile": dict(strategy=_pp(balance="profile", schedule="interleaved_1f1b"), data=data),
        "sum_loss": dict(strategy=_pp(), data=data, loss="sum"),
    }
    outs = run_ranks(W.pp_train_many, 2, [dict(tag=k, **v) for k, v in configs.items()], timeout=600)
    runs = {k: [o[i] for o in outs] for i, k in enumerate(configs)}
    atoms2 = W.reference("llama", data, 2, eval_batch=eval_batch)
    atoms4 = W.reference("llama", data, 4, eval_batch=eval_batch)  # interleaved: 4 micro-batches of 1 row
    for tag in configs:
        if tag == "sum_loss":
            continue  # its per-call reports are means over different token counts; parameters checked below
        ref = atoms4 if tag in ("interleaved_1f1b", "profile") else atoms2
        if tag == "accum4":
            ref = W.reference("llama", data_accum4, 2)
        _check(tag, runs[tag], ref)
        if configs[tag].get("eval_batch") is not None:
            for r in runs[tag]:
                assert r["eval"] == pytest.approx(ref["eval"], rel=LOSS_RTOL), tag
    # SumLoss: the count reaches the stage-0 rank (its gradients are normalised by the same global count)
    got = W.merge_params(runs["sum_loss"])
    for k, v in W.reference("llama", data, 2, loss="sum")["params"].items():
        torch.testing.assert_close(got[k], v, atol=PARAM_ATOL, rtol=0, msg=lambda m: f"sum_loss {k}: {m}")
    # placements and splits
    assert [r["stages"] for r in runs["interleaved_1f1b"]] == [[0, 2], [1, 3]]
    assert [r["stages"] for r in runs["zbv"]] == [[0, 3], [1, 2]]
    notes = " ".join(runs["split_points"][0]["notes"])
    assert "by split_points" in notes and "0=model.embed_tokens..model.layers.2" in notes, notes
    assert "by balance=profile" in " ".join(runs["profile"][0]["notes"])
    assert "by balance=params" in " ".join(runs["1f1b"][0]["notes"])
    assert "PipelinedModel(" in runs["1f1b"][0]["repr"] and "stages [0] of 2" in runs["1f1b"][0]["repr"]


def _save_plain_gpt2(path):
    """A plain single-process tied GPT-2 checkpoint (weights halved, so it differs from a fresh model; SGD
    momentum state present). Returns the model."""
    from torchloom import checkpoint as ckpt

    plain = W.build_model("gpt2")
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(0.5)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    ckpt.save(path, step=7, model=plain, optimizer=plain_opt)
    return plain


def _check_checkpoint_runs(outs, plain):
    """``W.pp_checkpoint`` results: the plain checkpoint's model loads exactly; its optimizer is refused on
    every rank with a clear error (the last stage's untied ``lm_head.weight`` has its state under the tied
    ``transformer.wte.weight`` in the plain checkpoint); after the pipelined save -> load, parameters and momentum are
    bit-identical and training continues identically (same losses, same final parameters)."""
    for o in outs:
        assert "no parameter group for ['lm_head.weight']" in o["plain_error"], o["plain_error"]
        assert "optimizer=None" in o["plain_error"]
        for k, v in o["from_plain"].items():
            assert torch.equal(v, plain.state_dict()[k]), k
    for o in outs:
        assert o["step"] == 2
        for what in ("params", "momentum"):
            assert set(o["saved"][what]) == set(o["loaded"][what])
            for k, v in o["saved"][what].items():
                assert torch.equal(o["loaded"][what][k], v), (what, k)
        assert o["after_a"] == o["after_b"]
        for k, v in o["final_a"].items():
            assert torch.equal(o["final_b"][k], v), k


@pytest.mark.distributed
def test_pp_with_data_parallel_checkpointing_and_tensor_parallel_4ranks(tmp_path):
    """pp=2 x ddp over dp=2 and x fsdp over dp_shard=2, with activation checkpointing and accumulation; zero
    bubble with ZeRO-2; tied GPT-2 under fsdp with clipping, and built on the meta device; bf16 amp; pp=2 x
    tp=2 (Llama, and tied GPT-2 whose head is untied on the last stage; an MLP-only plan that leaves the last
    stage without tensor-parallel modules). Checkpoints under pp=2 x tp=2 of GPT-2, whose fused ``c_attn`` is a strided
    (multi-block) shard: save -> load round trip and a plain checkpoint loaded into that layout, exact."""
    data = W.token_data(STEPS, GB, 2)  # dp=2 x 2 train_step calls of 2 rows per step
    tp = [("parallel_mode", {"pp": 2, "tp": 2}), "pipeline_parallel", "tensor_parallel"]
    plain = _save_plain_gpt2(tmp_path / "plain")
    mlp_plan = {"model.layers.*.mlp.gate_proj": "colwise", "model.layers.*.mlp.up_proj": "colwise",
                "model.layers.*.mlp.down_proj": "rowwise"}  # matches nothing on the last stage (norm + head)
    configs = {
        "ddp_ac": dict(strategy=_pp("ddp", "checkpoint"), data=data),
        "fsdp_ac": dict(strategy=_pp("fsdp", "checkpoint"), data=data),
        "zero2_zero_bubble": dict(strategy=_pp("zero2", schedule="zero_bubble", num_microbatches=2), data=data),
        "fsdp_gpt2_clip": dict(strategy=_pp("fsdp", schedule="interleaved_1f1b", num_microbatches=2), data=data,
                               model="gpt2", max_grad_norm=0.5),
        "fsdp_meta_gpt2": dict(strategy=_pp("fsdp"), data=data, model="gpt2", meta=True),
        "ddp_amp_bf16": dict(strategy=_pp("ddp", ("amp", {"dtype": "bfloat16"})), data=data),
        "tp": dict(strategy=tp, data=W.token_data(STEPS, GB, 4)),
        "tp_gpt2_clip": dict(strategy=tp, data=W.token_data(STEPS, GB, 4), model="gpt2", max_grad_norm=0.5),
        "tp_mlp_only_head_stage": dict(strategy=[tp[0], ("pipeline_parallel", {"split_points": ["model.norm"]}),
                                                 ("tensor_parallel", {"plan": mlp_plan})],
                                       data=W.token_data(STEPS, GB, 4)),
        "tp_gpt2_checkpoint": dict(kind="checkpoint", root=str(tmp_path / "pp_tp"), strategy=tp, model="gpt2",
                                   plain_root=str(tmp_path / "plain")),
    }
    outs = run_ranks(W.pp_train_many, 4, [dict(tag=k, **v) for k, v in configs.items()], timeout=900)
    runs = {k: [o[i] for o in outs] for i, k in enumerate(configs)}
    for tag, cfg in configs.items():
        if tag in ("fsdp_meta_gpt2", "ddp_amp_bf16", "tp_gpt2_checkpoint"):
            continue  # checked below
        ref = W.reference(cfg.get("model", "llama"), cfg["data"], 2, max_grad_norm=cfg.get("max_grad_norm"))
        _check(tag, runs[tag], ref)
        if cfg.get("max_grad_norm"):
            for r in runs[tag]:
                torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
    # meta-device model, stages materialised per rank by fsdp: the tied copies start (and stay) identical, dp
    # replicas agree (merge_params checks), and the initial loss is sane (~ln(vocab))
    meta = runs["fsdp_meta_gpt2"]
    params = W.merge_params(meta)
    assert torch.equal(params["transformer.wte.weight"], params["lm_head.weight"])
    assert abs(meta[0]["losses"][0] - torch.log(torch.tensor(128.0)).item()) < 0.5, meta[0]["losses"]
    # bf16 autocast per stage: close to the fp32 reference (rtol 2e-3, as the other amp tests)
    torch.testing.assert_close(torch.tensor(runs["ddp_amp_bf16"][0]["losses"]),
                               torch.tensor(W.reference("llama", data, 2)["losses"]), rtol=2e-3, atol=0)
    assert runs["ddp_ac"][0]["mesh"]["dp_replicate"] == 2 and runs["fsdp_ac"][0]["mesh"]["dp_shard"] == 2
    assert runs["tp"][0]["mesh"]["tp"] == 2
    notes = " ".join(runs["fsdp_ac"][0]["notes"])
    assert "checkpoint: 2/2 blocks" in notes and "fsdp: ZeRO-3" in notes
    head_stage = {r["stages"][0]: " ".join(r["notes"]) for r in runs["tp_mlp_only_head_stage"]}
    assert "custom plan over 1 part(s): no planned modules on this rank's stage(s)" in head_stage[1], head_stage[1]
    assert "custom plan over 1 part(s): 8 colwise, 4 rowwise" in head_stage[0], head_stage[0]
    _check_checkpoint_runs(runs["tp_gpt2_checkpoint"], plain)


@pytest.mark.distributed
def test_checkpoint_roundtrip_and_load_into_unpipelined_model(tmp_path):
    """Each rank saves its stages under the original names; a fresh pp=2 job (other initialisation) loads
    parameters and momentum exactly and continues identically; the same checkpoint loads into a plain
    single-process tied GPT-2 (DCP reshards by name; the tie holds); a plain model's checkpoint loads into
    the pipelined job (model only: its optimizer state is stored per group index, which a pipelined
    optimizer cannot take: a clear error)."""
    from torchloom import checkpoint as ckpt

    plain = _save_plain_gpt2(tmp_path / "plain")
    outs = run_ranks(W.pp_checkpoint, 2, str(tmp_path / "pp"), _pp(), "gpt2", plain_root=str(tmp_path / "plain"),
                     timeout=600)
    _check_checkpoint_runs(outs, plain)
    model = W.build_model("gpt2")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert ckpt.load(tmp_path / "pp", model=model, optimizer=opt)["step"] == 2
    saved = {k: v for o in outs for k, v in o["saved"]["params"].items()}
    momentum = {k: v for o in outs for k, v in o["saved"]["momentum"].items()}
    sd = model.state_dict()
    assert set(sd) == set(saved)
    for k, v in saved.items():
        assert torch.equal(sd[k], v), k
    assert model.transformer.wte.weight is model.lm_head.weight
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        assert torch.equal(opt.state[p]["momentum_buffer"], momentum[names[id(p)]])


@pytest.mark.distributed
def test_pp_x_dp_x_tp_8ranks():
    """The full 3-D product on 8 gloo processes (pp=2 x dp=2 x tp=2): FSDP2 over dp_shard with TP DTensors in
    each pipeline stage (with sequence parallel and activation checkpointing), and dp over dp_replicate
    without a data-parallel method (fsdp is added). Same tolerances as above."""
    data = W.token_data(STEPS, GB, 2)  # dp=2 x 2 train_step calls of 2 rows per step
    mode = {"pp": 2, "tp": 2}
    configs = {
        "pp_fsdp_tp_sp_ac": dict(strategy=[("parallel_mode", {**mode, "dp_shard": 2}), "pipeline_parallel",
                                           "tensor_parallel", "sequence_parallel", "checkpoint", "fsdp"], data=data),
        "pp_replicate_tp": dict(strategy=[("parallel_mode", {**mode, "dp_replicate": 2}), "pipeline_parallel",
                                          "tensor_parallel"], data=data, max_grad_norm=0.5),
    }
    outs = run_ranks(W.pp_train_many, 8, [dict(tag=k, **v) for k, v in configs.items()], timeout=900)
    runs = {k: [o[i] for o in outs] for i, k in enumerate(configs)}
    for tag, cfg in configs.items():
        ref = W.reference("llama", cfg["data"], 2, max_grad_norm=cfg.get("max_grad_norm"))
        _check(tag, runs[tag], ref)
        assert runs[tag][0]["mesh"] == {"pp": 2, "dp_replicate": 2 if "replicate" in tag else 1,
                                        "dp_shard": 1 if "replicate" in tag else 2, "ep": 1, "tp": 2, "cp": 1}
    for r in runs["pp_replicate_tp"]:
        torch.testing.assert_close(torch.tensor(r["norms"]), torch.tensor(
            W.reference("llama", data, 2, max_grad_norm=0.5)["norms"]), rtol=1e-5, atol=0)


def test_zero1_is_refused_under_pipelining():
    """zero1's checkpoints cannot be loaded under pipelining (its state is consolidated on global rank 0 per
    group index): the strategy is refused up front, pointing to zero2. No process launch."""
    from torchloom.errors import StrategyError
    from torchloom.strategy.strategy import Strategy

    for methods in ([("pipeline_parallel", {"size": 2}), "zero1"], ["zero1", ("pp", {"size": 2})]):
        with pytest.raises(StrategyError, match=r"cannot be combined: zero1 trains under pipelining.*'zero2'"):
            Strategy(methods)
