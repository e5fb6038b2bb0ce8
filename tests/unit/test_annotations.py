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
from tests.models import tiny_llama
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
    assert plan.tp_plan == {"lm_head": "colwise_gather"}
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
