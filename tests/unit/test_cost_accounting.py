"""Accounting rules of issue [12] on hand-computed cases: ops that move no bytes, fused chains' traffic,
causal attention FLOPs (model vs hardware), FSDP gathers under pipelining, loss-parallel logits, pipeline
sends in the residual dtype, asynchronous launch on CUDA, and compile's fusion.

The trace cases run the real :class:`~torchloom.cost.op_trace.OpRecorder` under fake tensors on tiny inputs;
the cost cases use the toy model of test_search_cost.py."""
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_search_cost import L, S, cand, toy_hw, toy_info  # noqa: E402

from torchloom.cost.model_info import Matmul, PartInfo, PassCost  # noqa: E402
from torchloom.cost.op_trace import FlashAttentionMode, OpRecorder, causal_share, causal_tile_share  # noqa: E402
from torchloom.search.pricing import compose, predict  # noqa: E402


def _trace(fn, *shapes, backward=False):
    """Run ``fn`` on fake fp32 tensors of ``shapes`` under a recorder; the recorder and the output."""
    with FakeTensorMode():
        xs = [torch.empty(s, requires_grad=backward) for s in shapes]
        rec = OpRecorder([])
        with rec, rec.saving():
            out = fn(*xs)
        if backward:
            rec.phase = "bwd"
            with rec:
                out.sum().backward()
        return rec, out


def test_ops_without_kernels_move_no_bytes():
    """``x.device`` (prim.device), views, detach and empty move no bytes: only the add's are counted (read
    2 x 4 KiB, write 4 KiB); ``empty_like`` still goes through the dispatcher (an op, no kernel)."""
    def fn(x):
        y = x + x
        _ = y.device
        z = y.view(-1).detach()
        torch.empty_like(z)
        return z

    rec, _ = _trace(fn, (32, 32))
    c = rec.cost("fwd")
    assert c.ops == 2 and c.other_bytes == 3 * 32 * 32 * 4
    assert c.fused_kernels == 1  # one fused chain (the add), no kernel for the allocation


def test_a_fused_chain_reads_its_inputs_once_and_writes_what_leaves_it():
    """(x * 2 + 1).relu() @ w: eager moves 3 x (read + write) of x's size; fused, the chain reads x once and
    writes its result once (the matmul reads it); the matmul ends the chain."""
    n = 64 * 64 * 4

    def fn(x, w):
        return ((x * 2 + 1).relu()) @ w

    rec, _ = _trace(fn, (64, 64), (64, 64))
    c = rec.cost("fwd")
    assert c.other_bytes == 3 * 2 * n
    assert c.fused_bytes == 2 * n
    assert c.ops == 4 and c.fused_kernels == 2  # one fused chain + the matmul


def test_a_tensor_used_after_a_matmul_is_written_once_and_read_again():
    """a = x.relu(); b = a @ w; c = a + b: the chain after the matmul reads a (made by the first chain) and b."""
    n = 64 * 64 * 4

    def fn(x, w):
        a = x.relu()
        return a + a @ w

    rec, _ = _trace(fn, (64, 64), (64, 64))
    c = rec.cost("fwd")
    # chain 1: read x, write a (leaves: the matmul reads it); chain 2: read a and b, write the result (alive)
    assert c.fused_bytes == 2 * n + 3 * n


def test_causal_shares():
    assert causal_share(4, 4) == 10 / 16  # 1+2+3+4 of 16 entries
    assert causal_share(8192, 8192) == pytest.approx(0.5, abs=1e-4)
    assert causal_tile_share(8192, 8192) == 65 / 128  # 64 x 64 tiles of 128: the diagonal ones whole
    assert causal_tile_share(100, 100) == 1.0  # one tile
    assert causal_share(2, 4) == 3 / 8  # more keys than queries: row i sees i + 1 keys (top-left)


def test_causal_sdpa_counts_the_computed_tiles_and_the_model_half():
    """A causal SDPA over 1024 tokens: the hardware count is the computed tiles' share of the full product
    (36/64 for 8 x 8 tiles), the model count the exact causal half; backward's model count leaves out the
    recomputed scores (4 of the 5 products)."""
    b, h, s, d = 1, 2, 1024, 64
    full_fwd = 2 * (2 * b * h * s * s * d)  # Q K^T and P V

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    rec, _ = _trace(fn, (b, h, s, d), (b, h, s, d), (b, h, s, d), backward=True)
    fwd, bwd = rec.cost("fwd"), rec.cost("bwd")
    assert fwd.matmul_flops == pytest.approx(full_fwd * 36 / 64)
    assert fwd.model_flops == pytest.approx(full_fwd * causal_share(s, s))
    assert bwd.matmul_flops == pytest.approx(2.5 * full_fwd * 36 / 64)
    assert bwd.model_flops == pytest.approx(2 * full_fwd * causal_share(s, s))
    assert all(m.attention for m in fwd.matmuls) and all(m.share == 36 / 64 for m in fwd.matmuls)


def test_flash_trace_replaces_a_materialised_attention():
    """With dropout the CPU dispatch runs SDPA's math path (scores materialised: bytes of b x h x s x s); traced
    as the flash kernel a GPU runs, nothing of that size moves and a causal LM's mask counts as causal."""
    b, h, s, d = 1, 2, 512, 32
    mask_shape = (b, 1, s, s)

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.1)

    native, _ = _trace(fn, (b, h, s, d), (b, h, s, d), (b, h, s, d), mask_shape)
    notes: list[str] = []
    with FakeTensorMode():
        xs = [torch.empty(sh) for sh in ((b, h, s, d),) * 3 + (mask_shape,)]
        flash = OpRecorder([])
        with flash, FlashAttentionMode(causal_lm=True, notes=notes):
            fn(*xs)
    scores = b * h * s * s * 4
    assert native.cost("fwd").other_bytes > 2 * scores
    assert flash.cost("fwd").other_bytes < scores / 4
    assert flash.cost("fwd").model_flops == pytest.approx(4 * b * h * s * s * d * causal_share(s, s))
    assert notes and "causal" in notes[0]


def test_fsdp_gathers_once_per_step_under_pipelining():
    """ZeRO-2 under 1F1B with 8 micro-batches gathers each unit once per step (the pipeline keeps them
    unsharded); ZeRO-3 in the warm-up forwards (min(m, p)) and every backward; without pipelining every
    micro-batch's forward gathers."""
    info, hw = toy_info(), toy_hw(ranks=8)
    pp = ("pipeline_parallel", {"schedule": "1f1b"})

    def gathers(methods, **dims):
        p = predict(cand(methods, mb=1, accum=8, **dims), info, hw)
        return {r["label"]: r["calls"] for r in p.collectives if r["label"].startswith("fsdp.all_gather")}

    units = L // 2 + 1  # blocks of the pipeline rank + its root unit
    assert gathers([pp, ("fsdp", {"reshard_after_forward": False})], pp=2, dp_shard=4) == {"fsdp.all_gather": units}
    z3 = gathers([pp, ("fsdp", {})], pp=2, dp_shard=4)
    assert z3 == {"fsdp.all_gather": 2 * units, "fsdp.all_gather_bwd": 8 * (L // 2)}
    assert gathers([("fsdp", {"reshard_after_forward": False})], dp_shard=8)["fsdp.all_gather"] == 8 * (L + 1)


def test_loss_parallel_shards_the_logits_temporary():
    """The loss's transient (logits and log-softmax over the vocabulary) is the largest: tensor parallel alone
    keeps it whole (the logits are gathered), loss_parallel divides it by tp."""
    info, hw = toy_info(), toy_hw(ranks=4)
    big = 10_000_000.0
    info.parts[-1].peak_extra_bytes = big
    info.parts[0].peak_extra_bytes = big / 100
    base = compose(cand([], mb=1), info, hw).memory["temporary"]
    tp = compose(cand([("tensor_parallel", {})], mb=1, tp=4), info, hw).memory["temporary"]
    lp = compose(cand([("tensor_parallel", {}), ("loss_parallel", {})], mb=1, tp=4), info, hw).memory["temporary"]
    assert base == tp == big
    assert lp == pytest.approx(big / 4)


def test_pipeline_sends_the_residual_dtype():
    """fsdp's mixed precision computes in bf16, so stages send bf16 hidden states; plain fp32 sends fp32."""
    info, hw = toy_info(), toy_hw(ranks=2)
    pp = ("pipeline_parallel", {"schedule": "1f1b"})

    def send_bytes(methods):
        p = predict(cand([pp, *methods], mb=1, accum=2, pp=2), info, hw)
        return next(r["bytes"] for r in p.collectives if r["label"] == "pp.send_recv")

    assert send_bytes([]) == S * 64 * 4
    assert send_bytes([("fsdp", {}), ("amp", {"dtype": "bfloat16"})]) == S * 64 * 2


def test_cuda_overlaps_dispatch_with_the_device_cpu_adds_them():
    """Per-op host cost hides behind the device's work where kernels launch asynchronously: one op of 1 ms
    per block forward against 0.31 ms of matmuls costs 1 ms on CUDA and 1.31 ms on CPU."""
    info = toy_info()
    blk = info.parts[0]
    blk.fwd.ops = blk.bwd.ops = 1
    cuda, cpu = toy_hw(ranks=1), toy_hw(ranks=1, device="cpu")
    cuda.op_overhead_s = cpu.op_overhead_s = 1e-3
    mm = 2 * blk.fwd.matmul_flops / 1e10  # mb=2 at the toy rate: 0.31 ms < 1 ms of dispatch
    assert mm < 1e-3
    t_cuda = predict(cand([], mb=2), info, cuda).time["forward"]
    t_cpu = predict(cand([], mb=2), info, cpu).time["forward"]
    assert t_cpu - t_cuda == pytest.approx(L * mm, rel=1e-9)


def test_compile_prices_the_fused_chains():
    """compile (inductor) swaps the blocks' eager traffic and op count for the fused chains'; aot_eager does not
    fuse."""
    info = toy_info()
    blk = info.parts[0]
    for pc in (blk.fwd, blk.bwd):
        pc.other_bytes, pc.fused_bytes, pc.ops, pc.fused_kernels = 4e9, 1e9, 40, 10
    hw = toy_hw(ranks=1)
    hw.mem_bw, hw.op_overhead_s = 1e9, 0.0
    eager = predict(cand([], mb=1), info, hw).time["forward"]
    fused = predict(cand([("compile", {})], mb=1), info, hw).time["forward"]
    same = predict(cand([("compile", {"backend": "aot_eager"})], mb=1), info, hw).time["forward"]
    assert eager - fused == pytest.approx(L * 3e9 / 1e9)
    assert same == eager


def test_model_flops_per_token_follow_the_palm_convention():
    """MFU counts ``model_flops`` (no recomputation); HFU adds checkpointing's recomputed forward."""
    info, hw = toy_info(), toy_hw(ranks=1)
    plain = predict(cand([], mb=2), info, hw)
    ac = predict(cand([("checkpoint", {})], mb=2), info, hw)
    per_token = info.flops_per_sample() / S
    assert plain.model_flops_per_token == pytest.approx(per_token)
    assert ac.model_flops_per_token == pytest.approx(per_token)
    assert ac.hardware_flops_per_token == pytest.approx(per_token + L * info.parts[0].fwd.matmul_flops / S)
    assert ac.hfu > ac.mfu


def test_hand_built_pass_costs_default_their_new_fields():
    pc = PassCost(100.0, [Matmul(2, 5, 5)], other_bytes=7.0, ops=3)
    assert (pc.model_flops, pc.fused_bytes, pc.fused_kernels) == (100.0, 7.0, 3)
    assert PartInfo("x", 1, 0, 0, 0, pc, pc, {}, 0).fwd.model_flops == 100.0


def test_context_parallel_splits_the_tokens_and_prices_the_ring():
    """cp=2 under fsdp: every pass's FLOPs halve; per block the forward sends the rank's key/value chunk
    (2 x S/cp tokens x kv heads x head dim x 4 B) cp-1 times, the backward twice as often; FSDP shards over
    dp_shard x cp."""
    info, hw = toy_info(), toy_hw(ranks=4)
    heads, hd = 4, 64 // 4
    one = predict(cand([("fsdp", {})], mb=2, dp_shard=2), info, hw)
    two = predict(cand([("fsdp", {}), ("context_parallel", {})], mb=2, dp_shard=2, cp=2), info, hw)
    assert two.time["forward"] == pytest.approx(one.time["forward"] / 2)
    recs = {r["label"]: r for r in two.collectives}
    chunk = 2 * (2 * S / 2) * heads * hd * 4
    assert recs["cp.ring_kv"]["bytes"] == chunk and recs["cp.ring_kv"]["calls"] == L * 1
    assert recs["cp.ring_kv_bwd"]["calls"] == 2 * L and recs["cp.ring_kv"]["group"] == 2
    assert recs["fsdp.all_gather"]["view"] == "dp_shard_cp" and recs["fsdp.all_gather"]["group"] == 4
    mem1, mem2 = compose(cand([("fsdp", {})], mb=2, dp_shard=2), info, hw).memory, compose(
        cand([("fsdp", {}), ("context_parallel", {})], mb=2, dp_shard=2, cp=2), info, hw).memory
    assert mem2["params"] == pytest.approx(mem1["params"] / 2)  # sharded over 4 ranks instead of 2
    assert mem2["activations"] == pytest.approx(mem1["activations"] / 2)


def test_context_parallel_refusals():
    from torchloom.errors import StrategyError
    from torchloom.methods.context_parallel import ContextParallel, ContextParallelConfig
    from torchloom.parallel.mesh import ParallelDims

    info = toy_info()  # 16 tokens: 2 x cp chunks must divide them
    ContextParallel(ContextParallelConfig()).validate(info, ParallelDims(dp_shard=2, cp=8))
    with pytest.raises(StrategyError, match="not a multiple of 32"):
        ContextParallel(ContextParallelConfig()).validate(info, ParallelDims(dp_shard=1, cp=16))
    assert ParallelDims(pp=2, dp_shard=2, cp=4, tp=2).world == 32
    assert ParallelDims(dp_shard=-1, cp=4).resolve(16).dp_shard == 4


def test_float8_runs_the_block_gemms_at_the_fp8_rate_and_is_refused_without_fp8():
    from torchloom.cost.accelerators import cluster
    from torchloom.errors import StrategyError

    info = toy_info()
    hw = toy_hw(ranks=1)
    hw.matmul_flops["float8"] = [(1.0, 4e10)]  # twice the toy bf16 rate
    hw.peak_flops["float8"] = 8e10
    bf16 = predict(cand([("amp", {"dtype": "bfloat16"})], mb=2), info, hw)
    fp8 = predict(cand([("float8", {})], mb=2), info, hw)
    blocks_bf16 = 2 * L * info.parts[0].fwd.matmul_flops / 2e10
    blocks_fp8 = 2 * L * info.parts[0].fwd.matmul_flops / 4e10
    assert bf16.time["forward"] - fp8.time["forward"] == pytest.approx(blocks_bf16 - blocks_fp8)
    assert fp8.time["float8.casts"] > 0
    with pytest.raises(StrategyError, match="no FP8 tensor cores.*h100-sxm"):
        predict(cand([("float8", {})], mb=2), info, cluster("a100", 8))



def test_is_causal_is_read_by_name_for_every_sdpa_kernel():
    """The flag sits at a different position in each kernel's schema (flash 4, efficient/cuDNN 6, backwards 7,
    11, 14): a causal cuDNN/efficient op must not be priced full-square."""
    from torchloom.cost.op_trace import _SDPA_BWD, _SDPA_FWD, _sdpa_causal

    for packet in (*_SDPA_FWD, *_SDPA_BWD):
        names = [a.name for a in packet.default._schema.arguments]
        i = names.index("is_causal")
        args = [None] * i + [True]
        assert _sdpa_causal(packet, args, {}), packet
        assert not _sdpa_causal(packet, [None] * i + [False], {}), packet
    assert _sdpa_causal(next(iter(_SDPA_FWD)), [], {"is_causal": True})
