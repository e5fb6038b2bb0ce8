"""EPL-style ``replicate``/``split`` annotations: what the scopes record, how they translate into a Strategy,
and the errors. Single process; the distributed runs are in tests/distributed/test_annotations.py."""
from __future__ import annotations

import copy
import pickle
from collections import OrderedDict

import pytest
import torch
from torch import nn

import torchloom
from tests.models import tiny_gpt2, tiny_llama
from torchloom import StrategyError, Strategy
from torchloom.strategy.annotations import (ATTR, clear_annotations, has_annotations, plan_from_annotations,
                                            strategy_from_annotations)


class TwoStageNet(nn.Sequential):
    """Embedding + MLP in stage 0; MLP + a split classifier head in stage 1 (context-manager form)."""

    def __init__(self, vocab: int = 64, hidden: int = 32, split_head: bool = True, annotate: bool = True):
        super().__init__()
        rep0 = torchloom.replicate(1, name="stage0") if annotate else _Null()
        rep1 = torchloom.replicate(1, name="stage1") if annotate else _Null()
        with rep0:
            self.add_module("embed", nn.Embedding(vocab, hidden))
            self.add_module("fc1", nn.Linear(hidden, 4 * hidden))
            self.add_module("act1", nn.ReLU())
            self.add_module("fc2", nn.Linear(4 * hidden, hidden))
        with rep1:
            self.add_module("fc3", nn.Linear(hidden, hidden))
            with (torchloom.split(device_count=2) if annotate and split_head else _Null()):
                self.add_module("head", nn.Linear(hidden, vocab))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return None


def _scopes(module):
    return {k: v.label for k, v in getattr(module, ATTR, {}).items()}


def test_context_manager_records_modules_and_nesting():
    net = TwoStageNet()
    assert _scopes(net) == {}  # the root is never recorded
    for name in ("embed", "fc1", "act1", "fc2"):
        assert _scopes(net.get_submodule(name)) == {"replicate": "stage0"}, name
    assert _scopes(net.fc3) == {"replicate": "stage1"}
    assert _scopes(net.head)["replicate"] == "stage1" and _scopes(net.head)["split"].startswith("split#")
    plan = plan_from_annotations(net)
    assert plan.stages == ["stage0", "stage1"] and plan.split_points == ["fc3"]
    assert plan.tp == 2 and plan.tp_plan == {"head": "colwise_gather"}
    # scopes are closed: later modules are not recorded
    assert not has_annotations(nn.Linear(2, 2))


def test_modules_built_in_scope_but_attached_later():
    """Modules constructed inside a scope and handed to ``nn.Sequential.__init__`` afterwards: those with
    parameters are recorded when their parameters register; a container whose children all share one scope
    belongs to it."""

    class Net(nn.Sequential):
        def __init__(self):
            with torchloom.replicate(1, name="a"):
                first = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
            with torchloom.replicate(1, name="b"):
                second = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
            super().__init__(OrderedDict(first=first, second=second))

    plan = plan_from_annotations(Net())
    assert plan.stages == ["a", "b"] and plan.split_points == ["second"]


def test_split_point_is_the_first_module_after_the_previous_stage():
    """A stage may begin with a parameterless module; one left between the previous stage's parameters
    (re-entering scope a) stays in front and the stage begins at its first module after them."""
    a, b = torchloom.replicate(1, name="a"), torchloom.replicate(1, name="b")
    net = nn.Sequential()
    with a:
        net.add_module("fc1", nn.Linear(4, 4))
    with b:
        net.add_module("act1", nn.ReLU())
    with a:
        net.add_module("fc2", nn.Linear(4, 4))
    with b:
        net.add_module("act2", nn.ReLU())
        net.add_module("fc3", nn.Linear(4, 4))
    assert plan_from_annotations(net).split_points == ["act2"]


def test_function_forms_on_hf_llama():
    model = tiny_llama(layers=4)
    torchloom.replicate(model.model.layers[:2])  # a ModuleList slice: its layers are annotated
    torchloom.replicate(device_count=1, name="late")(model.model.layers[2], model.model.layers[3])
    head = torchloom.split(model.lm_head, device_count=2)
    assert head is model.lm_head
    plan = plan_from_annotations(model)
    assert plan.split_points == ["model.layers.2"] and plan.stages[1] == "late"
    assert plan.tp_plan == {"lm_head": "lm_head"}  # the built-in Llama plan's style for the output head
    s = strategy_from_annotations(model, 8)
    assert s.config("parallel_mode").dp == 2
    assert s.config("pipeline_parallel").split_points == ["model.layers.2"]


def test_split_rule_pairs_chained_linears():
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.split(device_count=4):
                self.tok = nn.Embedding(64, 16)
                self.up = nn.Linear(16, 64)
                self.down = nn.Linear(64, 16)
                self.odd = nn.Linear(32, 8)  # does not chain with `down` (16 != 32): alone
                self.norm = nn.LayerNorm(8)  # not a Linear/Embedding: replicated

    plan = plan_from_annotations(Head())
    assert plan.tp_plan == {"tok": "vocab_embedding", "up": "colwise", "down": "rowwise", "odd": "colwise_gather"}
    assert plan.tp == 4 and plan.pp == 1


def _split_each(layers, pick, n: int = 2):
    for layer in layers:
        torchloom.split(pick(layer), device_count=n)


def test_split_rule_uses_the_builtin_plan_of_a_known_family():
    """Rule (a): a Llama MLP or whole decoder layer gets the built-in Llama entries (gate/up colwise, down
    rowwise; q/k/v colwise, o rowwise), the head 'lm_head'; GPT-2's Conv1D layers get the GPT-2 plan."""
    model = tiny_llama(layers=1)
    _split_each(model.model.layers, lambda l: l.mlp)
    mlp = {"model.layers.0.mlp.gate_proj": "colwise", "model.layers.0.mlp.up_proj": "colwise",
           "model.layers.0.mlp.down_proj": "rowwise"}
    assert plan_from_annotations(model).tp_plan == mlp

    model = tiny_llama(layers=1)
    _split_each(model.model.layers, lambda l: l)  # norms, rotary and activations inside stay replicated
    torchloom.split(model.lm_head, device_count=2)
    attn = {f"model.layers.0.self_attn.{p}_proj": "colwise" for p in "qkv"}
    assert plan_from_annotations(model).tp_plan == {**attn, "model.layers.0.self_attn.o_proj": "rowwise", **mlp,
                                                    "lm_head": "lm_head"}

    gpt2 = tiny_gpt2(layers=1)
    _split_each(gpt2.transformer.h, lambda b: b.mlp)
    assert plan_from_annotations(gpt2).tp_plan == {"transformer.h.0.mlp.c_fc": "colwise",
                                                   "transformer.h.0.mlp.c_proj": "rowwise"}
    gpt2 = tiny_gpt2(layers=1)
    _split_each(gpt2.transformer.h, lambda b: b.attn)
    assert plan_from_annotations(gpt2).tp_plan == {"transformer.h.0.attn.c_attn": "fused_qkv",
                                                   "transformer.h.0.attn.c_proj": "rowwise"}

    class Wrapper(nn.Module):  # a family model inside a custom module: its names get the wrapper's prefix
        def __init__(self):
            super().__init__()
            self.backbone = tiny_llama(layers=1).model
            self.score = nn.Linear(64, 3)

    w = Wrapper()
    torchloom.split(w.backbone.layers[0].mlp, w.score, device_count=2)
    assert plan_from_annotations(w).tp_plan == {**{k.replace("model.", "backbone.", 1): v for k, v in mlp.items()},
                                                "score": "colwise_gather"}


def test_split_rule_shape_rule_for_other_models():
    """Rule (b): siblings d -> w read by exactly one later sibling w -> * are colwise + rowwise (also when
    the row-wise layer is registered between them); outside an nn.Sequential square layers (d == w) cannot
    be told apart and each is gathered; an nn.Sequential pairs by order; Conv1D counts as a Linear."""

    def plan_of(build):
        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                with torchloom.split(device_count=2):
                    build(self)

        return plan_from_annotations(Net()).tp_plan

    def glu_meta_order(m):  # Meta's Llama registers w1, w2, w3; forward w2(silu(w1(x)) * w3(x))
        m.w1, m.w2, m.w3 = nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 16)

    assert plan_of(glu_meta_order) == {"w1": "colwise", "w2": "rowwise", "w3": "colwise"}

    def chain(m):
        m.seq = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))

    assert plan_of(chain) == {"seq.0": "colwise", "seq.2": "rowwise", "seq.4": "colwise_gather"}

    def square(m):
        m.a, m.b = nn.Linear(8, 8), nn.Linear(8, 8)

    assert plan_of(square) == {"a": "colwise_gather", "b": "colwise_gather"}

    def square_sequential(m):  # the order is the data flow; a norm (parameters) between stops the pairing
        m.seq = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8))

    assert plan_of(square_sequential) == {"seq.0": "colwise", "seq.2": "rowwise", "seq.4": "colwise_gather"}

    def two_readers(m):  # fc1's width is read by fc2 and by other: which one reads fc1 is unknown; fc2 -> fc1
        # (32 -> 8 -> 32) is not taken either, fc1 being registered first
        m.fc1, m.fc2, m.other = nn.Linear(8, 32), nn.Linear(32, 8), nn.Linear(32, 4)

    assert plan_of(two_readers) == {"fc1": "colwise_gather", "fc2": "colwise_gather", "other": "colwise_gather"}

    def conv1d(m):
        from transformers.pytorch_utils import Conv1D
        m.c, m.d = Conv1D(16, 8), Conv1D(8, 16)  # Conv1D(nf=out, nx=in)

    assert plan_of(conv1d) == {"c": "colwise", "d": "rowwise"}

    def tied(m):
        m.emb, m.out = nn.Embedding(16, 8), nn.Linear(8, 16, bias=False)
        m.out.weight = m.emb.weight

    assert plan_of(tied) == {"emb": "vocab_embedding", "out": "colwise_gather"}  # both Shard(0): the tie holds


def test_split_rule_refuses_what_it_cannot_classify():
    """Rule (c): a StrategyError at plan time naming the modules, for part of a built-in group, a tied
    weight split on one side, attention under the shape rule, nn.MultiheadAttention and an empty scope."""
    model = tiny_llama(layers=1)
    torchloom.split(model.model.layers[0].mlp.gate_proj, device_count=2)
    with pytest.raises(StrategyError, match=r"built-in llama .* splits model\.layers\.0\.mlp\.gate_proj \(colwise, "
                                            r"split scope 'split#\d+'\), model\.layers\.0\.mlp\.up_proj \(colwise, no "
                                            r"split scope\).*torchloom\.split\(model\.layers\.0\.mlp, .*explicit plan"):
        plan_from_annotations(model)

    model = tiny_llama(tie=True)
    torchloom.split(model.lm_head, device_count=2)
    with pytest.raises(StrategyError, match="lm_head shares a parameter with model.embed_tokens"):
        plan_from_annotations(model)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = 2
            self.q, self.k, self.v, self.o = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)

    net = nn.Sequential()
    net.add_module("attn", torchloom.split(Attention(), device_count=2))
    with pytest.raises(StrategyError, match=r"attn counts heads \(num_heads\).* attn\.q, attn\.k, attn\.v column-wise "
                                            r"and attn\.o row-wise.*explicit plan"):
        plan_from_annotations(net)

    net = nn.Sequential()
    net.add_module("mha", torchloom.split(nn.MultiheadAttention(8, 2), device_count=2))
    with pytest.raises(StrategyError, match="mha is an nn.MultiheadAttention"):
        plan_from_annotations(net)

    model = tiny_llama(layers=1)
    torchloom.split(model.model.norm, device_count=2, name="norm")
    with pytest.raises(StrategyError, match=r"split scope 'norm' gives no tensor-parallel plan entry: it holds "
                                            r"model\.norm \(LlamaRMSNorm\), and the built-in llama .* keeps"):
        plan_from_annotations(model)
    # an explicit plan replaces the derived one, so the rule is not consulted
    s = strategy_from_annotations(model, 2, [("tensor_parallel", {"plan": {"lm_head": "lm_head"}})])
    assert s.config("tensor_parallel").plan == {"lm_head": "lm_head"} and s.config("tensor_parallel").size == 2

    net = nn.Sequential()
    net.add_module("n", torchloom.split(nn.LayerNorm(8), device_count=2, name="ln"))
    with pytest.raises(StrategyError, match="'ln' gives no .* splits only nn.Linear, Conv1D and nn.Embedding"):
        plan_from_annotations(net)


def test_scopes_with_one_name_are_one_scope():
    """Reopening replicate(name="A") after B is the same contiguity error as the function form; reopening
    it right after continues stage A; one name with two device counts is refused."""

    class ABA(nn.Sequential):
        def __init__(self, names=("A", "B", "A")):
            super().__init__()
            for i, name in enumerate(names):
                with torchloom.replicate(1, name=name):
                    self.add_module(f"l{i}", nn.Linear(4, 4))

    msg = r"replicate scope 'A' continues at '{}' after scope 'B' began: a pipeline stage must be contiguous"
    with pytest.raises(StrategyError, match=msg.format("l2")):
        plan_from_annotations(ABA())
    fn = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    torchloom.replicate(fn[0], fn[2], name="A")
    torchloom.replicate(fn[1], name="B")
    with pytest.raises(StrategyError, match=msg.format("2")):
        plan_from_annotations(fn)
    fn = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    torchloom.replicate(fn[0], name="A")
    torchloom.replicate(fn[1], name="B")
    torchloom.replicate(fn[2], name="A")  # a second call with the same name joins scope A
    with pytest.raises(StrategyError, match=msg.format("2")):
        plan_from_annotations(fn)

    plan = plan_from_annotations(ABA(("A", "A", "B")))
    assert plan.stages == ["A", "B"] and plan.split_points == ["l2"]

    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    torchloom.replicate(net[0], name="A")
    torchloom.replicate(net[1], device_count=2, name="A")
    with pytest.raises(StrategyError, match="two replicate scopes are named 'A' but have device_count 1 and 2"):
        plan_from_annotations(net)


def test_strategy_translation_and_equality_with_method_list(tmp_path):
    net = TwoStageNet()
    s = strategy_from_annotations(net, 8)  # 2 stages x tp 2 -> dp 2
    hand = Strategy([("parallel_mode", {"dp": 2}), ("pipeline_parallel", {"size": 2, "split_points": ["fc3"]}),
                     ("tensor_parallel", {"size": 2, "plan": {"head": "colwise_gather"}}), "fsdp"])
    assert s == hand  # fsdp: tensor parallelism with 2 replicas (DDP cannot hold DTensor parameters)
    for suffix in (".json", ".yaml"):
        assert Strategy.load(s.save(tmp_path / f"s{suffix}")) == s
    no_split = strategy_from_annotations(TwoStageNet(split_head=False), 4)
    assert no_split == Strategy([("parallel_mode", {"dp": 2}),
                                 ("pipeline_parallel", {"size": 2, "split_points": ["fc3"]})])
    assert "tensor_parallel" not in no_split


def test_merge_with_a_given_strategy():
    net = TwoStageNet()
    s = strategy_from_annotations(net, 4, ["fsdp", ("pipeline_parallel", {"schedule": "gpipe"})])
    assert s.names[:3] == ["parallel_mode", "pipeline_parallel", "tensor_parallel"] and "fsdp" in s
    pp = s.config("pipeline_parallel")
    assert pp.schedule == "gpipe" and pp.split_points == ["fc3"]  # given key wins, derived ones stay
    override = strategy_from_annotations(net, 4, [("tensor_parallel", {"plan": {"head": "colwise"}})])
    assert override.config("tensor_parallel").plan == {"head": "colwise"}
    dp_given = strategy_from_annotations(net, 4, [("parallel_mode", {"dp_shard": 1})])
    assert dp_given.config("parallel_mode").dp is None and dp_given.config("parallel_mode").dp_shard == 1
    assert strategy_from_annotations(net, 4, s) == s  # merging the derived strategy again changes nothing


def test_annotations_leave_the_model_unchanged():
    torch.manual_seed(0)
    plain = TwoStageNet(annotate=False)
    torch.manual_seed(0)
    annotated = TwoStageNet()
    assert list(plain.state_dict()) == list(annotated.state_dict())
    for (k, a), b in zip(plain.state_dict().items(), annotated.state_dict().values()):
        assert torch.equal(a, b), k
    x = torch.randint(0, 64, (3, 5))
    assert torch.equal(plain(x), annotated(x))
    assert type(annotated).forward is nn.Sequential.forward
    for clone in (copy.deepcopy(annotated), pickle.loads(pickle.dumps(annotated))):
        assert plan_from_annotations(clone) == plan_from_annotations(annotated)
        assert strategy_from_annotations(clone, 8) == strategy_from_annotations(annotated, 8)
    clear_annotations(annotated)
    assert not has_annotations(annotated)


def test_world_size_and_device_count_errors():
    net = TwoStageNet()  # 2 stages x tp 2 = 4 devices per replica
    with pytest.raises(StrategyError, match=r"4 devices per model replica .* does not divide the world size 6"):
        strategy_from_annotations(net, 6)
    with pytest.raises(StrategyError, match="world_size must be a positive int"):
        strategy_from_annotations(net, 0)
    for bad in (0, -1, 2.5, True, "2"):
        with pytest.raises(StrategyError, match="replicate: device_count must be an int >= 1"):
            torchloom.replicate(bad)
    with pytest.raises(StrategyError, match=r"split\(1\) splits nothing"):
        torchloom.split(device_count=1)
    with pytest.raises(StrategyError, match="split needs device_count"):
        torchloom.split()
    with pytest.raises(StrategyError, match="given twice"):
        torchloom.split(2, device_count=2)

    class TooWide(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.replicate(3, name="wide"):
                self.a = nn.Linear(4, 4)
            with torchloom.split(device_count=2):
                self.b = nn.Linear(4, 4)

    with pytest.raises(StrategyError, match=r"'wide' has device_count=3,.* 1 or 2 \(the split degree\)"):
        plan_from_annotations(TooWide())

    class TwoDegrees(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.split(device_count=2, name="s2"):
                self.a = nn.Linear(4, 4)
            with torchloom.split(device_count=4, name="s4"):
                self.b = nn.Linear(4, 4)

    with pytest.raises(StrategyError, match=r"different device counts \('s2': 2, 's4': 4\)"):
        plan_from_annotations(TwoDegrees())


def test_colocated_replicate_and_split():
    """EPL's image-classification layout: replicate(2) body colocated with a split(2) head -> one stage, tp 2."""

    class Classifier(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.replicate(device_count=2):
                self.body = nn.Linear(8, 8)
            with torchloom.split(device_count=2):
                self.fc = nn.Linear(8, 16)

    s = strategy_from_annotations(Classifier(), 2)
    assert s == Strategy([("parallel_mode", {"dp": 1}),
                          ("tensor_parallel", {"size": 2, "plan": {"fc": "colwise_gather"}})])
    assert strategy_from_annotations(Classifier(), 4).names == ["parallel_mode", "tensor_parallel", "fsdp"]
    with pytest.raises(StrategyError, match="'tensor_parallel' and 'ddp' cannot be combined"):
        strategy_from_annotations(Classifier(), 4, ["ddp"])  # a given data-parallel method is kept as is


def test_nesting_and_overlap_errors():
    with pytest.raises(StrategyError, match="opened inside replicate scope"):
        with torchloom.replicate(1):
            with torchloom.replicate(1):
                pass
    with pytest.raises(StrategyError, match="opened inside split scope"):
        with torchloom.split(device_count=2):
            with torchloom.replicate(1):
                pass
    # the failed scopes closed cleanly: nothing is recorded afterwards
    assert not has_annotations(nn.Linear(2, 2))
    lin = torchloom.replicate(1, name="x")(nn.Linear(2, 2))
    with pytest.raises(StrategyError, match="already in replicate scope 'x'"):
        torchloom.replicate(1, name="y")(lin)
    with pytest.raises(TypeError, match="annotates nn.Module"):
        torchloom.replicate(1)("layer")

    model = tiny_llama(layers=3)
    torchloom.replicate(model.model.layers[0], model.model.layers[2])  # one scope ...
    torchloom.replicate(model.model.layers[1])  # ... interrupted by another
    with pytest.raises(StrategyError, match="must be contiguous"):
        plan_from_annotations(model)


def test_exception_inside_scope_removes_the_hooks():
    with pytest.raises(RuntimeError):
        with torchloom.replicate(1):
            raise RuntimeError("boom")
    assert not has_annotations(nn.Sequential(nn.Linear(2, 2)))


def test_auto_accelerate_uses_annotations_single_process():
    """One process: a replicate-only model becomes data parallelism of degree 1 (auto_accelerate's hook)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            with torchloom.replicate(1):
                self.fc = nn.Linear(4, 2)

        def forward(self, x):
            return self.fc(x)

    res = torchloom.auto_accelerate(Net(), torch.optim.SGD, loss_func=lambda b, o: o.sum(), optim_args={"lr": 0.1})
    assert res.strategy == Strategy([("parallel_mode", {"dp": 1})])
    assert any(n.startswith("annotations:") for n in res.notes)
    loss = res.train_step(torch.ones(2, 4))
    assert torch.isfinite(loss)
