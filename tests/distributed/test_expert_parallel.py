"""``expert_parallel`` against the one-process reference (tests/distributed/_ep_workers.py: every rank's
micro-batches run in one process and accumulated, ``output.loss`` including the model's load-balancing loss),
on tiny Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE: 4 experts, top-2, 2 layers) and a tiny
``torchloom.moe.MoE`` model (capacity dropping, shared expert, aux and z losses), 3 SGD+momentum steps;
ddp and fsdp (also zero2 on a meta-device model), activation checkpointing, bf16 autocast, pipeline.

Tolerances (fp32): losses rtol 1e-5, parameters atol 5e-6, router logits of the trained model atol 1e-5,
expert gradients of the first step (as the optimizer sees them) atol 1e-7. Observed: parameters <= 1e-8
(only the order of the sums differs). How far wrong runs are (each test asserts > 10x the tolerance): an
untrained run (lr=0) and a run whose expert gradients are doubled (divided by edp instead of dp, or summed
twice over ep) are computed next to the reference; see ``_assert_wrong_runs_far``.
bf16 autocast: against the one-process bf16 reference with the same tolerances (observed 6e-9: the same bf16
ops per row); the fp32 run is a wrong run there (1.7e-4 away: autocast really ran).
"""
import pytest
import torch

from tests.distributed._ep_workers import pp_train, reference, train_many
from torchloom.testing import run_ranks

pytestmark = pytest.mark.distributed

STEPS = 3
PARAM_ATOL, LOSS_RTOL, ROUTER_ATOL, GRAD_ATOL = 5e-6, 1e-5, 1e-5, 1e-7


def _ep(ep: int, *methods, **mode):
    return [*methods, "expert_parallel", ("parallel_mode", {"ep": ep, **mode})]


def _assert_close(out, ref, param_atol=PARAM_ATOL, loss_rtol=LOSS_RTOL, exact_extras=True):
    torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=loss_rtol, atol=0)
    assert set(out["params"]) == set(ref["params"]), set(out["params"]) ^ set(ref["params"])
    for k, v in ref["params"].items():
        torch.testing.assert_close(out["params"][k], v, atol=param_atol, rtol=0, msg=lambda m: f"{k}: {m}")
    if not exact_extras:
        return
    probe = ref["probe"][out["rank"]]
    torch.testing.assert_close(out["probe"]["router"], probe["router"], atol=ROUTER_ATOL, rtol=0)
    assert out["probe"]["aux"] == pytest.approx(probe["aux"], rel=LOSS_RTOL)
    for k, g in ref["grads"].items():
        torch.testing.assert_close(out["grads"][k], g, atol=GRAD_ATOL, rtol=0, msg=lambda m: f"grad {k}: {m}")


def _max_param_diff(a, b) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in b)


def _assert_wrong_runs_far(ref, wrong: dict, atol: float):
    for name, run in wrong.items():
        d = _max_param_diff(run["params"], ref["params"])
        assert d > 10 * atol, f"wrong run '{name}' is only {d:.3g} from the reference (tolerance {atol})"


def _wrong(family, gb, dp, micro, **kw):
    return {"untrained (lr=0)": reference(family, STEPS, gb, dp, micro, lr=0.0, **kw),
            "2x expert gradient": reference(family, STEPS, gb, dp, micro, expert_grad_scale=2.0, **kw)}


def _check_sharded(out, ep: int):
    """The experts were split over ep (dim 0, the expert dimension) and recorded as the expert group."""
    assert any(n.startswith("expert_parallel:") and f"ep={ep}" in n for n in out["notes"]), out["notes"]
    assert out["groups"]["expert"] == 2  # one experts module per layer
    assert all(out["ep_placements"].values()), out["ep_placements"]


TWO_RANK = {
    "mixtral_ddp": dict(strategy=_ep(2, "ddp"), family="mixtral", micro=2, probe_calls=True),
    "mixtral_ddp_accum_ac": dict(strategy=_ep(2, "ddp", "checkpoint"), family="mixtral", micro=1, probe_calls=True),
    "qwen2_moe_ddp": dict(strategy=_ep(2, "ddp"), family="qwen2_moe", micro=2),
    "qwen3_moe_ddp": dict(strategy=_ep(2, "ddp"), family="qwen3_moe", micro=2),
    "loom_moe_ddp_accum": dict(strategy=_ep(2, "ddp"), family="loom_moe", micro=1),
    "mixtral_ddp_bf16": dict(strategy=_ep(2, "ddp", ("amp", {"dtype": "bfloat16"})), family="mixtral", micro=2),
}
GB2 = 4


@pytest.fixture(scope="module")
def two_rank():
    cfgs = [dict(steps=STEPS, global_batch=GB2, **c) for c in TWO_RANK.values()]
    outs = run_ranks(train_many, 2, cfgs, timeout=1800)
    return {name: [outs[r][i] for r in range(2)] for i, name in enumerate(TWO_RANK)}


@pytest.mark.parametrize("name", ["mixtral_ddp", "mixtral_ddp_accum_ac", "qwen2_moe_ddp", "qwen3_moe_ddp",
                                  "loom_moe_ddp_accum"])
def test_ep2_two_ranks_matches_reference(two_rank, name):
    cfg = TWO_RANK[name]
    ref = reference(cfg["family"], STEPS, GB2, 2, cfg["micro"])
    for out in two_rank[name]:
        _check_sharded(out, 2)
        _assert_close(out, ref)
    _assert_wrong_runs_far(ref, _wrong(cfg["family"], GB2, 2, cfg["micro"]), PARAM_ATOL)


def test_ep_with_activation_checkpointing_recomputes_the_dispatch(two_rank):
    """Recomputation in backward dispatches again (2 calls per MoE layer per forward/backward, 1 without
    checkpointing) and routes the same way (the gradients match the reference above)."""
    assert two_rank["mixtral_ddp"][0]["dispatches"] == [1, 1]
    for out in two_rank["mixtral_ddp_accum_ac"]:
        assert out["dispatches"] == [2, 2]
        assert any(n.startswith("checkpoint:") for n in out["notes"])


def test_ep_bf16_autocast_matches_bf16_reference(two_rank):
    ref = reference("mixtral", STEPS, GB2, 2, 2, autocast_dtype=torch.bfloat16)
    for out in two_rank["mixtral_ddp_bf16"]:
        _check_sharded(out, 2)
        _assert_close(out, ref, exact_extras=False)
    wrong = {**_wrong("mixtral", GB2, 2, 2, autocast_dtype=torch.bfloat16),
             "fp32": reference("mixtral", STEPS, GB2, 2, 2)}
    _assert_wrong_runs_far(ref, wrong, PARAM_ATOL)


FOUR_RANK = {
    "ddp": dict(strategy=_ep(2, "ddp", dp=4), family="mixtral", micro=1),
    "fsdp": dict(strategy=_ep(2, "fsdp", dp=4), family="mixtral", micro=1),
    "fsdp_ac_qwen2": dict(strategy=_ep(2, "fsdp", "checkpoint", dp=4), family="qwen2_moe", micro=1),
    "zero2_meta": dict(strategy=_ep(2, "zero2", dp=4), family="mixtral", micro=2, meta=True),
    "hsdp_2x2": dict(strategy=_ep(2, "fsdp", dp_replicate=2, dp_shard=2), family="qwen3_moe", micro=2),
}
#: attention split over tp, the experts modules left whole (replicated over tp, split over ep)
ATTENTION_ONLY_PLAN = {"model.layers.*.self_attn.q_proj": "colwise", "model.layers.*.self_attn.k_proj": "colwise",
                       "model.layers.*.self_attn.v_proj": "colwise", "model.layers.*.self_attn.o_proj": "rowwise"}
TP_FOUR_RANK = {
    "tp2_dp2_fsdp": dict(strategy=["fsdp", ("tensor_parallel", {"plan": ATTENTION_ONLY_PLAN}), "expert_parallel",
                                   ("parallel_mode", {"tp": 2, "dp": 2, "ep": 2})], family="mixtral", micro=2),
}
GB4 = 8


@pytest.fixture(scope="module")
def four_rank():
    runs = {**FOUR_RANK, **TP_FOUR_RANK}
    cfgs = [dict(steps=STEPS, global_batch=GB4, **c) for c in runs.values()]
    outs = run_ranks(train_many, 4, cfgs, timeout=2400)
    return {name: [outs[r][i] for r in range(4)] for i, name in enumerate(runs)}


@pytest.mark.parametrize("name", list(FOUR_RANK))
def test_ep2_dp4_matches_reference(four_rank, name):
    """dp=4 = edp 2 x ep 2: dense gradients averaged over 4 ranks, expert gradients summed over the ep
    all-to-all and over edp=2, divided by 4 (a run averaging experts over edp only is the 2x wrong run)."""
    cfg = FOUR_RANK[name]
    ref = reference(cfg["family"], STEPS, GB4, 4, cfg["micro"])
    for out in four_rank[name]:
        _check_sharded(out, 2)
        _assert_close(out, ref)
    _assert_wrong_runs_far(ref, _wrong(cfg["family"], GB4, 4, cfg["micro"]), PARAM_ATOL)


def test_tp2_dp2_ep2_matches_reference(four_rank):
    """tp=2 (no SP) x dp=2 x ep=2 on 4 ranks with fsdp (edp=1): attention split over tp by a plan that leaves
    the experts whole; each tp rank dispatches its (tp-replicated) tokens over its own ep group, so the
    experts see dp=2 ranks' tokens and their gradients are the dp mean, as the dense ones."""
    ref = reference("mixtral", STEPS, GB4, 2, 2)
    outs = four_rank["tp2_dp2_fsdp"]
    for out in outs:
        _check_sharded(out, 2)
        assert out["dp"] == 2 and any(n.startswith("tensor_parallel:") for n in out["notes"]), out["notes"]
        _assert_close(out, ref)
    _assert_wrong_runs_far(ref, _wrong("mixtral", GB4, 2, 2), PARAM_ATOL)


def test_pp2_dp2_ep2_matches_reference():
    """pp=2 x dp=2 x ep=2 on 4 ranks (ddp; each stage's experts split over its 2 dp ranks, edp=1): 1F1B with
    2 pipeline micro-batches per call and 2 accumulation steps; the model without its aux loss (router logits
    do not cross stages). Every stage's parameters against the reference."""
    outs = run_ranks(pp_train, 4, STEPS, GB4, 2, timeout=1800)
    ref = reference("mixtral", STEPS, GB4, 2, 2, output_router_logits=False)
    seen = set()
    for out in outs:
        assert any(n.startswith("expert_parallel:") for n in out["notes"]), out["notes"]
        assert out["ep_placements"] and all(out["ep_placements"].values()), out["ep_placements"]
        torch.testing.assert_close(torch.tensor(out["losses"]), torch.tensor(ref["losses"]), rtol=LOSS_RTOL, atol=0)
        for k, v in out["params"].items():
            torch.testing.assert_close(v, ref["params"][k], atol=PARAM_ATOL, rtol=0, msg=lambda m: f"{k}: {m}")
        seen |= set(out["params"])
    assert seen == set(ref["params"]), set(ref["params"]) ^ seen
    wrong = {"untrained (lr=0)": reference("mixtral", STEPS, GB4, 2, 2, output_router_logits=False, lr=0.0)}
    _assert_wrong_runs_far(ref, wrong, PARAM_ATOL)
