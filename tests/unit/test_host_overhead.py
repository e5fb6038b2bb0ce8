"""Host time of eager code ([12] item 5, the online check on small models): the calibrated seconds per op of
eager model code by code style, the optimizer's per-tensor host work, and how the cost model prices both.

Hand-computed cases on the toy model of test_search_cost.py (no memory or GEMM cost besides what is named),
plus the measuring functions run against a scripted timer (the real reference decoders, only the clock
scripted) and the analysis's code-style and tensor counts on real models."""
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_search_cost import cand, toy_hw, toy_info  # noqa: E402

from torchloom.cost import eager_overhead  # noqa: E402
from torchloom.cost.analysis import analyze_model, eager_code_style  # noqa: E402
from torchloom.search.pricing import predict  # noqa: E402


def _info(ops_f=10, ops_b=20, tensors=(3, 2), code="modules"):
    info = toy_info()
    block, rest = info.parts
    block.fwd = dataclasses.replace(block.fwd, ops=ops_f, fused_kernels=2)
    block.bwd = dataclasses.replace(block.bwd, ops=ops_b, fused_kernels=4)
    rest.fwd = dataclasses.replace(rest.fwd, ops=0, fused_kernels=0)
    rest.bwd = dataclasses.replace(rest.bwd, ops=0, fused_kernels=0)
    block.tensors, rest.tensors = tensors
    info.eager_code = code
    return info


def _cpu_hw(**kw):
    hw = toy_hw(ranks=1, device="cpu")
    hw.fingerprint = {"cores": 8}  # no oversubscription: colocated share 1
    for k, v in kw.items():
        setattr(hw, k, v)
    return hw


def _host(pred):
    return pred.time["forward"] + pred.time["backward"]


def test_eager_passes_pay_the_measured_seconds_per_op_of_their_code_style():
    """fwd 10 + bwd 20 ops per block, L blocks, micro-batch 2, accumulation 1: 30 L ops at the style's rate
    (zero compute: the toy GEMM rate is set so large it does not count)."""
    base = predict(cand([], mb=2), _info(), _cpu_hw(op_overhead_s=0.0)).step_time_s
    hw = _cpu_hw(op_overhead_s=1e-6, eager_op_overhead_s={"modules": 5e-6, "transformers": 9e-6})
    info = _info()
    L = info.parts[0].count
    for code, per_op in (("modules", 5e-6), ("transformers", 9e-6), ("unknown-style", 1e-6)):
        p = predict(cand([], mb=2), _info(code=code), hw)
        assert p.step_time_s - base == pytest.approx(30 * L * per_op, rel=1e-9), code


def test_compiled_passes_pay_the_bare_dispatch_per_fused_kernel():
    """compile fuses the blocks: their 2 + 4 kernels launch at ``op_overhead_s``, not the eager rate."""
    hw = _cpu_hw(op_overhead_s=1e-6, eager_op_overhead_s={"modules": 5e-6})
    info = _info()
    L = info.parts[0].count
    zero = predict(cand([("compile", {})], mb=2), _info(), _cpu_hw(op_overhead_s=0.0))
    p = predict(cand([("compile", {})], mb=2), info, hw)
    assert _host(p) - _host(zero) == pytest.approx(6 * L * 1e-6, rel=1e-9)


def test_methods_extra_ops_are_bare_dispatches():
    """A method's ``ops_add`` (here amp's casts: 2 per block GEMM per forward, twice in backward) is priced
    at ``op_overhead_s`` even where the eager rate is higher."""
    info = _info(ops_f=0, ops_b=0)
    hw_eager = _cpu_hw(op_overhead_s=1e-6, eager_op_overhead_s={"modules": 50e-6})
    hw_bare = _cpu_hw(op_overhead_s=1e-6)
    a = predict(cand([("amp", {"dtype": "bfloat16"})], mb=2), info, hw_eager)
    b = predict(cand([("amp", {"dtype": "bfloat16"})], mb=2), info, hw_bare)
    assert _host(a) == pytest.approx(_host(b), rel=1e-12) and _host(b) > 0


def test_optimizer_step_adds_host_time_per_parameter_tensor_on_the_rank():
    """3 tensors per block x L + 2 in the rest, at 40 us each; under pp=2 the most loaded rank holds half
    the blocks (and the rest: the embedding/head side is counted whole)."""
    info = _info(ops_f=0, ops_b=0)
    L = info.parts[0].count
    hw = _cpu_hw(optimizer_tensor_s=40e-6)
    off = predict(cand([], mb=2), info, _cpu_hw()).time["optimizer"]
    on = predict(cand([], mb=2), info, hw).time["optimizer"]
    assert on - off == pytest.approx((3 * L + 2) * 40e-6, rel=1e-9)
    pp = cand([("pipeline_parallel", {"schedule": "gpipe"})], mb=1, accum=2, pp=2)
    on_pp = predict(pp, info, hw).time["optimizer"] - predict(pp, info, _cpu_hw()).time["optimizer"]
    assert on_pp == pytest.approx((3 * L / 2 + 2) * 40e-6, rel=1e-9)


class _Clock:
    """A Timer stand-in: ``per_call`` runs ``fn`` once (so the work is real) and answers ``seconds``."""

    def __init__(self, seconds):
        self.seconds, self.device, self.calls = seconds, torch.device("cpu"), 0

    def per_call(self, fn, target_s):
        fn()
        self.calls += 1
        return self.seconds


def test_measure_divides_the_timed_step_by_the_ops_the_analysis_counts():
    """Seconds per op = one forward + backward's time / the analysis's op count of the same model, for each
    style present (``transformers`` only when installed)."""
    ops = eager_overhead.counted_ops(eager_overhead.ReferenceDecoder(), lambda batch, out: out)
    assert ops > 100  # 2 blocks of norm, rotary attention and SwiGLU, forward and backward
    got = eager_overhead.measure(_Clock(0.01), 0.0)
    assert got["modules"] == pytest.approx(0.01 / ops)
    try:
        import transformers  # noqa: F401
    except ImportError:
        assert set(got) == {"modules"}
    else:
        assert set(got) == {"modules", "transformers"} and got["transformers"] < got["modules"] * 10


def test_optimizer_tensor_seconds_times_a_clipped_adamw_step_per_tensor():
    clock = _Clock(0.0064)
    assert eager_overhead.optimizer_tensor_seconds(clock, 0.0, tensors=64) == pytest.approx(1e-4)
    assert clock.calls == 1


def test_the_reference_decoder_trains():
    torch.manual_seed(0)
    m = eager_overhead.ReferenceDecoder()
    ids = torch.randint(0, eager_overhead.VOCAB, (2, eager_overhead.TOKENS))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    first = None
    for _ in range(20):
        loss = m(input_ids=ids, labels=ids)
        first = float(loss) if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < first * 0.7


def test_analysis_records_code_style_and_trainable_tensors():
    m = eager_overhead.ReferenceDecoder()
    for layer in m.layers:  # per instance, as ``trainable`` is: one instance stands for all of its class
        layer.mlp.up.weight.requires_grad_(False)
    ids = torch.zeros(1, 8, dtype=torch.long)
    info = analyze_model(m, seq_len=8, sample_input={"input_ids": ids, "labels": ids}, input_format="unpack_dict",
                         loss_func=lambda b, o: o)
    assert info.eager_code == "modules"
    # a block: 2 norms + q,k,v,o + gate,up,down = 9 tensors, one of them frozen
    blocks = [p for p in info.parts if p.name != "rest"]
    assert sum(p.tensors * p.count for p in blocks) == 2 * (9 - 1)
    assert info.rest.tensors == 3  # embedding, final norm, head
    assert eager_code_style(nn.Linear(2, 2)) == "modules"
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2)
    assert eager_code_style(transformers.LlamaForCausalLM(cfg)) == "transformers"


# -- fsdp accumulate_sharded (torchtitan's gradient accumulation) ------------------------------------------------
def test_accumulate_sharded_keeps_gradients_sharded_for_more_reduce_scatters():
    """dp_shard 4, 4 micro-batches: the default accumulates a whole gradient per rank (the peak's grads are the
    unsharded model) and reduce-scatters once per step; accumulate_sharded keeps 1/4 and reduce-scatters 4x."""
    from test_search_cost import toy_hw as hw_of
    info, hw = toy_info(), hw_of()
    nb = info.parts[0].count
    plain = predict(cand([("fsdp", {})], mb=1, accum=4, dp_shard=4), info, hw)
    sharded = predict(cand([("fsdp", {"accumulate_sharded": True})], mb=1, accum=4, dp_shard=4), info, hw)
    assert plain.memory["grads"] == pytest.approx(info.n_trainable * 4)
    assert sharded.memory["grads"] == pytest.approx(info.n_trainable * 4 / 4)
    calls = {p: next(r["calls"] for r in x.collectives if r["label"] == "fsdp.reduce_scatter")
             for p, x in (("plain", plain), ("sharded", sharded))}
    assert calls == {"plain": nb + 1, "sharded": 4 * (nb + 1)}
    # without accumulation the option changes nothing
    one = [predict(cand([("fsdp", c)], mb=4, accum=1, dp_shard=4), info, hw) for c in ({}, {"accumulate_sharded": True})]
    assert one[0].step_time_s == one[1].step_time_s and one[0].peak_memory_bytes == one[1].peak_memory_bytes


def test_accumulate_sharded_is_refused_under_pipeline_parallelism():
    from torchloom.errors import StrategyError
    from torchloom.search.validate import validate_strategy
    info = toy_info()
    c = cand([("fsdp", {"accumulate_sharded": True}), ("pipeline_parallel", {"schedule": "gpipe"})], mb=1, accum=4,
             pp=2, dp_shard=2)
    with pytest.raises(StrategyError, match="accumulate_sharded"):
        validate_strategy(c.strategy(), info, c.dims)


def test_the_search_tries_sharded_accumulation_for_fsdp_with_accumulation_only():
    from torchloom.search.options import SearchOptions
    from torchloom.search.space import enumerate_space
    info = toy_info()
    space = enumerate_space(info, 4, 16, SearchOptions.parse({}))
    fsdp = [c for c in space.bases if c.config("fsdp") is not None and c.dims.dp_shard > 1 and c.dims.pp == 1]
    with_rs = [c for c in fsdp if c.config("fsdp").get("accumulate_sharded")]
    assert with_rs and all(c.grad_accum > 1 for c in with_rs)
    assert {(repr(c.dims), c.micro_batch) for c in with_rs} == {(repr(c.dims), c.micro_batch) for c in fsdp
                                                          if c.grad_accum > 1 and not c.config("fsdp").get("accumulate_sharded")}
    assert all("/rs" in c.label() for c in with_rs)


def test_the_label_shows_sharded_accumulation_only_when_there_is_accumulation():
    # published plans set accumulate_sharded whatever the batch; with one micro-batch it changes nothing
    assert "zero3/rs" in cand([("fsdp", {"accumulate_sharded": True})], mb=1, accum=4, dp_shard=2).label()
    label = cand([("fsdp", {"accumulate_sharded": True})], mb=4, accum=1, dp_shard=2).label()
    assert "zero3" in label and "/rs" not in label


# ---- DTensor optimizer, FSDP2's own work per unit, TrainStep per call (calibration method 5) --------------
def test_dtensor_parameters_pay_the_dtensor_rate_per_tensor_only_under_fsdp_and_tp():
    """FSDP2 and tensor parallelism hand the optimizer DTensors: 3 L + 2 tensors at ``optimizer_dtensor_s``;
    DDP's plain tensors keep ``optimizer_tensor_s``; an uncalibrated DTensor rate falls back to it."""
    info = _info(ops_f=0, ops_b=0)
    L = info.parts[0].count
    base = _cpu_hw()
    hw = _cpu_hw(optimizer_tensor_s=40e-6, optimizer_dtensor_s=300e-6)
    for methods, dims, per in (([("ddp", {})], {"dp_replicate": 2}, 40e-6),
                               ([("fsdp", {})], {"dp_shard": 2}, 300e-6),
                               ([("tensor_parallel", {})], {"tp": 2}, 300e-6)):
        c = cand(methods, mb=2, **dims)
        extra = predict(c, info, hw).time["optimizer"] - predict(c, info, base).time["optimizer"]
        assert extra == pytest.approx((3 * L + 2) * per, rel=1e-9), methods
    c = cand([("fsdp", {})], mb=2, dp_shard=2)
    fallback = _cpu_hw(optimizer_tensor_s=40e-6)
    assert predict(c, info, fallback).time["optimizer"] - predict(c, info, base).time["optimizer"] == \
        pytest.approx((3 * L + 2) * 40e-6, rel=1e-9)


def test_fsdp_units_pay_the_calibrated_work_per_unit_and_tensor_in_each_micro_batch():
    """Per micro-batch every block unit (3 tensors) costs unit + 3 tensor seconds and the root (2 tensors)
    unit + 2 tensor; the reducing micro-batch adds ``fsdp_unit_reduce_s`` per unit: with accumulation 2,
    host = 2 (L (u + 3 t) + (u + 2 t)) + (L + 1) r (forward and backward together)."""
    info = _info(ops_f=0, ops_b=0)
    L = info.parts[0].count
    u, t, r = 1e-3, 1e-4, 5e-4
    hw = _cpu_hw(op_overhead_s=1e-6, fsdp_unit_s=u, fsdp_tensor_s=t, fsdp_unit_reduce_s=r)
    c = cand([("fsdp", {})], mb=1, accum=2, dp_shard=2)
    zero = _cpu_hw(op_overhead_s=1e-6)  # uncalibrated: the dozen bare dispatches per block unit
    got = _host(predict(c, info, hw)) - _host(predict(c, info, zero))
    want = 2 * (L * (u + 3 * t) + (u + 2 * t)) + (L + 1) * r - 2 * 3 * 12 * L * 1e-6
    assert got == pytest.approx(want, rel=1e-9)
    # sharded accumulation reduces in every micro-batch: the reduce share doubles
    rs = cand([("fsdp", {"accumulate_sharded": True})], mb=1, accum=2, dp_shard=2)
    got_rs = _host(predict(rs, info, hw)) - _host(predict(rs, info, zero))
    assert got_rs - got == pytest.approx((L + 1) * r, rel=1e-9)


def test_train_step_calls_are_priced_per_micro_batch_and_per_schedule_call_under_pipelining():
    info = _info(ops_f=0, ops_b=0)
    hw = _cpu_hw(train_step_call_s=1e-3)
    assert predict(cand([], mb=1, accum=4), info, hw).time["train_step"] == pytest.approx(4e-3)
    assert "train_step" not in predict(cand([], mb=1, accum=4), info, _cpu_hw()).time
    pp = cand([("pipeline_parallel", {"schedule": "gpipe"})], mb=1, accum=4, pp=2)
    assert predict(pp, info, hw).time["train_step"] == pytest.approx(1e-3)  # one call runs the 4 micro-batches


def test_new_measurements_subtract_the_bare_work_and_the_priced_collectives():
    """The measuring functions on a scripted clock, one process (no group: 0 for the FSDP terms; the
    optimizer over DTensors on a 1-rank mesh and TrainStep are real calls)."""
    import os

    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("gloo", rank=0, world_size=1)
        made = True
    else:
        made = False
    try:
        assert eager_overhead.fsdp_unit_seconds(_Clock(1.0), 0.0, None, lambda b: 0.0, lambda b: 0.0) == (0, 0, 0)
        assert eager_overhead.optimizer_dtensor_seconds(_Clock(0.0032), 0.0, None, tensors=32) == pytest.approx(1e-4)
        assert eager_overhead.train_step_seconds(_Clock(0.5), 0.0, None) == 0.0  # same clock: nothing on top
        seq = iter([0.010, 0.014])  # bare 10 ms, TrainStep 14 ms for 2 calls: 2 ms per call

        class _Seq(_Clock):
            def per_call(self, fn, target_s):
                fn()
                return next(seq)
        assert eager_overhead.train_step_seconds(_Seq(0), 0.0, None, accum=2) == pytest.approx(2e-3)
    finally:
        if made:
            dist.destroy_process_group()


def test_backward_weight_gemms_pay_the_measured_layout_factor_and_the_forward_does_not():
    """bf16 on a CPU without native bf16: the input gradient's plain ``dY @ W`` runs ~6x slower than the
    forward's ``X @ W^T``; the calibrated factor multiplies the backward's GEMM time only."""
    info = _info(ops_f=0, ops_b=0)
    c = cand([], mb=2)
    plain = predict(c, info, _cpu_hw())
    slow = predict(c, info, _cpu_hw(backward_gemm_factor={"float32": 3.0}))
    assert slow.time["forward"] == pytest.approx(plain.time["forward"], rel=1e-12)
    assert slow.time["backward"] == pytest.approx(3.0 * plain.time["backward"], rel=1e-9)  # toy: GEMMs only
    other = predict(c, info, _cpu_hw(backward_gemm_factor={"bfloat16": 3.0}))  # another dtype's factor
    assert other.time["backward"] == pytest.approx(plain.time["backward"], rel=1e-12)


def test_backward_gemm_factor_compares_the_gradient_layouts_with_the_forward():
    from torchloom.cost import microbench

    seq = iter([1e-3, 5e-3, 1e-3])  # forward, input gradient, weight gradient

    class _Seq(_Clock):
        def per_call(self, fn, target_s, samples=1):
            fn()
            return next(seq)
    assert microbench.backward_gemm_factor(_Seq(0), torch.float32, 8, 0.0) == pytest.approx(3.0)


def test_a_cached_calibration_with_a_bad_host_field_is_refused_not_priced():
    """A torn or hand-edited cache (a string factor, a null or negative seconds) raises ValueError, which the
    cache reader turns into a warning and a new measurement, instead of crashing or pricing nonsense."""
    from torchloom.cost.hardware import Hardware
    good = _cpu_hw(fsdp_unit_s=1e-3, backward_gemm_factor={"bfloat16": 3.0}).to_dict()
    assert Hardware.from_dict(good).fsdp_unit_s == 1e-3
    for k, v in (("backward_gemm_factor", "abc"), ("backward_gemm_factor", {"bfloat16": -1.0}),
                 ("fsdp_unit_s", None), ("train_step_call_s", -1.0), ("optimizer_dtensor_s", float("nan"))):
        with pytest.raises(ValueError, match=k):
            Hardware.from_dict({**good, k: v})
