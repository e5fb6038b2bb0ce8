"""What the kernels keep, issue [12]'s memory rules on hand-computed cases: weight GEMMs saving FP8 inputs
(Transformer Engine), FP8 weights gathered by FSDP (torchao's float8 all-gather / Megatron's
fp8_param_gather), a compiled (fused) cross-entropy, the rest's transient as lines in the micro-batch (state-
sized weight gradients do not grow with it), and the activation rules composing on what the step's kernels
save (compile + checkpoint keeps the block inputs, not a fused share of them).

The trace cases run the real OpRecorder / analysis under fake tensors; the cost cases use the toy model of
test_search_cost.py."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_search_cost import L, S, cand, toy_hw, toy_info  # noqa: E402

from torchloom.cost.analysis import _peak_lines  # noqa: E402
from torchloom.cost.effects import step_peak  # noqa: E402
from torchloom.cost.op_trace import OpRecorder  # noqa: E402
from torchloom.cost.step import StepShape  # noqa: E402
from torchloom.errors import StrategyError  # noqa: E402
from torchloom.search.pricing import compose  # noqa: E402

GiB = 2.0 ** 30


def _saving(fn, n, d, f):
    """weight_gemm_input_saving of ``fn(x, w1, w2)`` traced on bf16 fakes (w1: f x d, w2: d x f are state)."""
    with FakeTensorMode():
        x = torch.empty(n, d, dtype=torch.bfloat16, requires_grad=True)
        w1 = torch.empty(f, d, dtype=torch.bfloat16, requires_grad=True)
        w2 = torch.empty(d, f, dtype=torch.bfloat16, requires_grad=True)
        rec = OpRecorder([w1, w2])
        with rec, rec.saving():
            out = fn(x, w1, w2)
        return rec.weight_gemm_input_saving([out])


def test_fp8_saved_inputs_halve_what_only_weight_gemms_keep():
    """MLP ``w2(gelu(w1(layer_norm(x))))`` on n tokens: the norm's output (n x d) is kept only by w1, gelu's
    output (n x f) only by w2: both drop to 1 byte per element (bf16 2 -> FP8 1). w1's output is kept by gelu
    (not a weight GEMM): unchanged. The layer norm keeps x itself."""
    n, d, f = 8, 16, 64

    def mlp(x, w1, w2):
        return F.linear(F.gelu(F.linear(F.layer_norm(x, (d,)), w1)), w2)

    assert _saving(mlp, n, d, f) == n * d + n * f


def test_fp8_copy_of_an_input_another_op_keeps_adds_memory():
    """``h = w1(x); y = w2(h) * h``: h is kept by w2 (a weight GEMM) and by the product (for y's gradient): the
    bf16 h stays and Transformer Engine adds its FP8 copy (+1 byte per element); x is kept only by w1."""
    n, d = 8, 16

    def shared(x, w1, w2):
        h = F.linear(x, w1)
        return F.linear(h, w2) * h

    assert _saving(shared, n, d, d) == n * d - n * d


def test_te_fp8_inputs_shrink_the_blocks_activations_torchao_keeps_bf16():
    """save_fp8_inputs subtracts PartInfo.fp8_input_saving per block and sample; torchao's default keeps the
    bf16 inputs; a run asking for TE's behaviour is refused at apply (torchao cannot do it)."""
    from torchloom.methods.float8 import Float8, Float8Config

    info, hw = toy_info(), toy_hw(ranks=1)
    hw.peak_flops["float8"], hw.matmul_flops["float8"] = 8e10, [(1.0, 4e10)]
    saving = 1000.0
    info.parts[0].fp8_input_saving = {"bfloat16": saving}
    base = compose(cand([("float8", {})], mb=2), info, hw).memory["activations"]
    te = compose(cand([("float8", {"save_fp8_inputs": True})], mb=2), info, hw).memory["activations"]
    assert base - te == pytest.approx(2 * L * saving)
    with pytest.raises(StrategyError, match="Transformer Engine.*planning option"):
        Float8(Float8Config(save_fp8_inputs=True)).apply(SimpleNamespace())


def test_fsdp_float8_all_gather_gathers_the_blocks_in_one_byte():
    """ZeRO-2 keeps every block of the rank gathered: bf16 2 bytes per element, FP8 1; the all-gathers carry
    the same; the root unit (embedding, head) stays bf16. Rowwise scaling cannot gather in FP8 (torchao)."""
    info, hw = toy_info(), toy_hw(ranks=4)
    hw.peak_flops["float8"], hw.matmul_flops["float8"] = 8e10, [(1.0, 4e10)]
    z2 = ("fsdp", {"reshard_after_forward": False})

    def run(fp8):
        c = compose(cand([z2, ("float8", fp8)], mb=1, dp_shard=4), info, hw)
        ag = next(x for x in c.collectives if x[1].label == "fsdp.all_gather")[1]
        return c.memory["temporary"], ag.nbytes * ag.calls

    (t16, ag16), (t8, ag8) = run({}), run({"fsdp_float8_all_gather": True})
    block = info.parts[0].params
    assert t16 - t8 == pytest.approx(L * block * (2 - 1))
    assert ag16 - ag8 == pytest.approx(L * block * (2 - 1))
    from torchloom.strategy.strategy import Strategy
    with pytest.raises(StrategyError, match="tensorwise"):
        Strategy.parse([("float8", {"recipe": "rowwise", "fsdp_float8_all_gather": True})])


def test_compile_then_checkpoint_keeps_the_block_inputs():
    """Full checkpointing keeps each block's input whatever the kernels: compiled blocks save less between
    checkpoints but the same inputs, so [checkpoint] and [checkpoint, compile] keep the same activations
    (compile's smaller saves must not shrink the checkpointed inputs too); compile alone keeps the fused
    activations."""
    info, hw = toy_info(), toy_hw(ranks=1)
    blk = info.parts[0]
    blk.act_bytes_fused = {k: v / 4 for k, v in blk.act_bytes.items()}
    mem = {name: compose(cand(m, mb=2), info, hw).memory["activations"] for name, m in {
        "eager": [], "compile": [("compile", {})], "ac": [("checkpoint", {})],
        "ac+compile": [("checkpoint", {}), ("compile", {})]}.items()}
    rest = info.parts[1].act_bytes["float32"] * 2
    assert mem["eager"] - rest == pytest.approx(4 * (mem["compile"] - rest))
    assert mem["ac+compile"] == pytest.approx(mem["ac"])
    assert mem["ac"] == pytest.approx(L * 2 * blk.input_bytes + rest)


def test_peak_lines_take_the_largest_moment_at_each_micro_batch():
    """Two moments: a state-sized buffer (100 bytes whatever the batch) and a per-sample one (30 bytes per
    sample): traced at 2 and 3 samples, the lines give 100 at one sample and 30 x 8 at eight."""
    two = {"curve": [100, 60], "saved": 0}
    three = {"curve": [100, 90], "saved": 0}
    lines = _peak_lines(two, three)
    assert sorted(lines) == [(0.0, 30.0), (100.0, 0.0)]
    part = SimpleNamespace(name="rest", peak_lines={"float32": lines}, peak_lines_fused={}, peak_extra={},
                           peak_extra_fused={}, peak_extra_bytes=0.0)
    step = StepShape(1, 1, S, [], {})
    assert step_peak(part, step, 1) == 100 and step_peak(part, step, 8) == 240
    assert _peak_lines({"curve": [1, 2], "saved": 0}, {"curve": [1], "saved": 0}) == []  # different ops


@pytest.fixture(scope="module")
def tiny_llama_info():
    from transformers import LlamaConfig

    from torchloom.cost.analysis import analyze_config

    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return analyze_config(cfg, seq_len=64, attention="flash")


def test_a_fused_cross_entropy_keeps_the_logits_and_writes_their_gradient_once(tiny_llama_info):
    """Traced rest of a Llama with 512 tokens of vocabulary at 64 tokens: with the loss fused, every extra
    sample adds exactly the logits' gradient in bf16 (64 x 512 x 2 bytes) to the transient at large batch and
    keeps the bf16 logits (not the eager fp32 log-softmax); the eager loss adds its fp32 copies on top."""
    rest = tiny_llama_info.rest
    logits = 64 * 512
    slope = max(b for _, b in rest.peak_lines_fused["bfloat16"])
    assert slope == logits * 2
    assert rest.act_bytes_fused["bfloat16"] < rest.act_bytes["bfloat16"]
    assert max(b for _, b in rest.peak_lines["bfloat16"]) > slope
    eager = StepShape.of(cand([("amp", {})], mb=1))
    fused = StepShape.of(cand([("amp", {}), ("compile", {"components": ["model", "loss"]})], mb=1))
    assert fused.fused_loss and not eager.fused_loss
    for n in (1, 16):
        assert step_peak(rest, fused, n) < step_peak(rest, eager, n)


def test_the_rest_lines_agree_with_the_one_sample_trace(tiny_llama_info):
    """The lines (traced at 2 and 3 samples) reproduce the one-sample trace's transient within a reshape's
    copy (at one sample some reshapes are views); the fp32 trace is the one also run at one sample (its op
    costs price the rest), the others take their one-sample values from the lines."""
    rest = tiny_llama_info.rest
    at_one = max(a + b for a, b in rest.peak_lines["float32"])
    assert at_one == pytest.approx(rest.peak_extra["float32"], rel=0.1)
    assert rest.peak_extra["bfloat16"] == pytest.approx(max(a + b for a, b in rest.peak_lines["bfloat16"]))


def test_compile_components_and_the_loss_function():
    """components names model and/or loss; the loss needs a Hugging Face loss_function (under pipelining it
    stays eager, priced eager); apply
    compiles the model's loss_function in place (aot_eager here) and the loss and gradients do not change."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from torchloom.methods.compile import Compile, CompileConfig
    from torchloom.parallel.mesh import ParallelDims
    from torchloom.strategy.strategy import Strategy

    with pytest.raises(StrategyError, match="components"):
        Strategy.parse([("compile", {"components": ["head"]})])
    loss_only = Compile(CompileConfig(components=["loss"], backend="aot_eager"))
    with pytest.raises(StrategyError, match="has none"):
        loss_only.validate(SimpleNamespace(module=torch.nn.Linear(2, 2)), ParallelDims())
    loss_only.validate(SimpleNamespace(module=torch.nn.Linear(2, 2)), ParallelDims(pp=2))  # left eager there
    assert not StepShape.of(cand([("compile", {"components": ["loss"]})], mb=1, pp=2)).fused_loss

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    ids = torch.randint(0, 64, (2, 12))
    ref = model(input_ids=ids, labels=ids).loss
    ref.backward()
    ref_grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    ctx = SimpleNamespace(model=model, parts=None, model_parts=[model], notes=[])
    ctx.note = ctx.notes.append
    loss_only.apply(ctx)
    assert model.__dict__.get("_loss_function") is not None  # the compiled one, set on the instance
    out = model(input_ids=ids, labels=ids).loss
    out.backward()
    assert out.item() == pytest.approx(ref.item(), abs=1e-6)
    assert torch.allclose(model.lm_head.weight.grad, ref_grad, atol=1e-6)
    assert any("loss_function compiled" in n for n in ctx.notes)


def test_the_planner_adds_compile_with_the_loss_when_included():
    """search configs: the config an included method is added with (aliases resolve; a config for a method not
    included is refused); loom plan's --include compile compiles the blocks and the Hugging Face loss."""
    from torchloom.search.options import SearchOptions
    from torchloom.search.plan_cli import plan
    from torchloom.search.space import user_method_options

    o = SearchOptions.parse({"include": ["compile"], "configs": {"torch_compile": {"components": ["loss"]}}})
    assert o.configs == {"compile": {"components": ["loss"]}}
    assert [("compile", {"components": ["loss"]})] in user_method_options(o)
    with pytest.raises(StrategyError, match="not included"):
        SearchOptions.parse({"configs": {"compile": {}}})
    rep = plan("default", gpu="h100", gpus=8, gpus_per_node=8, global_batch=8,
               search_options={"include": ["compile"]})
    assert all(dict(r.candidate.methods)["compile"] == {"components": ["model", "loss"]} for r in rep.rows)
    assert any("compiles model and loss" in n for n in rep.notes)


def test_context_parallel_splits_the_per_token_transient_not_the_weight_gradients():
    """The rest's transient max(100 fixed, 30 per sample) at micro-batch 8 (240): cp 4 holds 2 samples' worth of
    tokens per rank, so max(100, 60) = 100, not 240 / 4."""
    info, hw = toy_info(), toy_hw(ranks=4)
    info.parts[0].peak_extra = {"float32": 0.0}
    info.parts[1].peak_lines = {"float32": [(100.0, 0.0), (0.0, 30.0)]}
    whole = compose(cand([], mb=8), info, hw).memory["temporary"]
    split = compose(cand([("context_parallel", {}), ("fsdp", {})], mb=8, cp=4), info, hw).memory["temporary"]
    assert whole == 240
    fsdp_only = compose(cand([("fsdp", {})], mb=8, dp_shard=4), info, hw).memory["temporary"]
    assert split - (fsdp_only - 240) == pytest.approx(100)  # fsdp's gathered units add the same on top


def test_loss_owner_needs_a_head_and_components_are_a_list():
    """LlamaModel has PreTrainedModel's loss_function property but no head: nothing would compute a loss, so
    'loss' is refused; a dict is not a components list; duplicates collapse."""
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaModel

    from torchloom.methods.compile import _loss_owner
    from torchloom.strategy.strategy import Strategy

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    assert _loss_owner(LlamaModel(cfg)) is None
    lm = LlamaForCausalLM(cfg)
    assert _loss_owner(lm) is lm
    with pytest.raises(StrategyError, match="components"):
        Strategy.parse([("compile", {"components": {"loss": 0}})])
    s = Strategy.parse([("compile", {"components": ["loss", "loss"]})])
    assert [e.config.components for e in s.entries if e.name == "compile"] == [["loss"]]


def test_memoised_activations_follow_the_loss_kernel(tiny_llama_info):
    """activation_bytes is memoised per model: a candidate with the fused loss after one without (and back)
    reads its own rest activations."""
    from torchloom.cost.effects import activation_bytes

    info = tiny_llama_info
    eager = StepShape.of(cand([("amp", {})], mb=1))
    fused = StepShape.of(cand([("amp", {}), ("compile", {"components": ["loss"]})], mb=1))
    e1, f1, e2 = activation_bytes(info, eager)[1], activation_bytes(info, fused)[1], activation_bytes(info, eager)[1]
    assert f1 < e1 == e2


def test_a_model_that_runs_one_sample_only_keeps_the_one_sample_transient():
    """The rest is also traced at 2 and 3 samples; a model whose forward only takes one sample (a reshape that
    drops the batch dimension) cannot be: the analysis notes it and prices the transient as before
    (the one-sample trace's times the micro-batch) instead of failing."""
    from torchloom.cost import eager_overhead
    from torchloom.cost.analysis import analyze_model

    class OneSample(eager_overhead.ReferenceDecoder):
        def forward(self, input_ids, labels):
            assert input_ids.shape[0] == 1, "one sample only"
            return super().forward(input_ids, labels)

    ids = torch.zeros(1, 8, dtype=torch.long)
    info = analyze_model(OneSample(), seq_len=8, sample_input={"input_ids": ids, "labels": ids},
                         input_format="unpack_dict", loss_func=lambda b, o: o)
    assert not info.rest.peak_lines and any("2 samples" in n for n in info.notes)
    grown = analyze_model(eager_overhead.ReferenceDecoder(), seq_len=8, sample_input={"input_ids": ids, "labels": ids},
                          input_format="unpack_dict", loss_func=lambda b, o: o)
    assert grown.rest.peak_lines
