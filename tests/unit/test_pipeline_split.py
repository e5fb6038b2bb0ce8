"""Pipeline parallel without processes: stage assignment, name-preserving stage modules, the per-family stage
runners (chaining every stage reproduces the model's own forward), tied-weight untying, input binding and
config validation.

Tolerance: the chained stages run the very same modules and ops as the model's forward, so logits must be
bit-identical (``torch.equal``); the one exception is stated where it occurs.
"""
from __future__ import annotations

import functools
import inspect

import pytest
import torch
from torch import nn

from tests.models import tiny_gpt2, tiny_llama, tiny_t5
from torchloom.api import plan_dims
from torchloom.errors import StrategyError
from torchloom.parallel.pipeline.families import detect_family
from torchloom.parallel.pipeline.placement import stage_ranks
from torchloom.parallel.pipeline.schedule import slice_rows
from torchloom.parallel.pipeline.split import StageSpec, Unit, balance_by_cost, split_by_cost, split_by_points
from torchloom.parallel.pipeline.stage import prune
from torchloom.parallel.pipeline.tied import untie_across_stages

LLAMA_UNITS = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "lm_head"]


def _units(names):
    return [Unit(n, (n,), "block", i) for i, n in enumerate(names)]


# ----------------------------------------------------------------------------------------------- split points
def test_split_points_cut_before_each_named_unit():
    units = detect_family(tiny_llama(layers=4)).units(tiny_llama(layers=4))
    assert [u.name for u in units] == LLAMA_UNITS
    runs = split_by_points(units, ["model.layers.2"], 2)
    assert [[u.name for u in r] for r in runs] == [LLAMA_UNITS[:3], LLAMA_UNITS[3:]]
    runs = split_by_points(units, ["model.layers.1", "model.layers.3", "model.norm"], 4)
    assert [len(r) for r in runs] == [2, 2, 1, 2]


@pytest.mark.parametrize("points, stages, match", [
    (["model.layer.2"], 2, "Did you mean 'model.layers.2'"),
    (["model.layers.2"], 3, "give 2 split points"),
    (["model.embed_tokens"], 2, "first stage cannot be empty"),
    (["model.layers.3", "model.layers.1"], 3, "distinct and in model order"),
    (["model.layers.2", "model.layers.2"], 3, "distinct and in model order"),
])
def test_split_points_errors_name_the_fix(points, stages, match):
    with pytest.raises(StrategyError, match=match):
        split_by_points(_units(LLAMA_UNITS), points, stages)


# ----------------------------------------------------------------------------------------------- balancing
def test_balance_minimises_the_largest_stage():
    assert balance_by_cost([1, 1, 1, 1], 2) == [2]
    assert balance_by_cost([5, 1, 1, 1, 1, 1], 2) == [1]        # the heavy unit alone
    assert balance_by_cost([1, 1, 1, 1, 1, 5], 2) == [5]
    assert balance_by_cost([3, 3, 3, 3, 3, 3, 3, 3], 4) == [2, 4, 6]
    assert balance_by_cost([1, 2, 3], 3) == [1, 2]
    # exact optimum against brute force on a small irregular case
    costs = [4, 1, 7, 2, 2, 9, 1, 3]
    starts = balance_by_cost(costs, 3)
    bounds = [0, *starts, len(costs)]
    best = max(sum(costs[a:b]) for a, b in zip(bounds[:-1], bounds[1:]))
    brute = min(max(sum(costs[:i]), sum(costs[i:j]), sum(costs[j:]))
                for i in range(1, len(costs)) for j in range(i + 1, len(costs)))
    assert best == brute


def test_balance_errors_with_more_stages_than_units():
    with pytest.raises(StrategyError, match="only 2 units"):
        balance_by_cost([1.0, 2.0], 3)


def test_param_balance_on_llama_counts_embedding_and_head():
    model = tiny_llama(layers=4)
    units = detect_family(model).units(model)
    costs = [sum(p.numel() for m in u.modules for p in model.get_submodule(m).parameters()) for u in units]
    runs = split_by_cost(units, costs, 2)
    assert [[u.name for u in r] for r in runs] == [LLAMA_UNITS[:3], LLAMA_UNITS[3:]]
    # embedding (8192) + head (8192) ~ a quarter block each: 4 stages put them with a block
    runs = split_by_cost(units, costs, 4)
    assert [[u.name for u in r] for r in runs] == [LLAMA_UNITS[:2], LLAMA_UNITS[2:3], LLAMA_UNITS[3:4],
                                                   LLAMA_UNITS[4:]]


def test_stage_placement_loop_and_v():
    assert stage_ranks(2, 4, "loop") == [0, 1, 0, 1]
    assert stage_ranks(2, 4, "v") == [0, 1, 1, 0]
    assert stage_ranks(4, 8, "v") == [0, 1, 2, 3, 3, 2, 1, 0]


# ----------------------------------------------------------------------------------------------- stage modules
def _chain(model, points, inputs):
    """Run ``model`` as consecutive stage modules in one process (what the pipeline does across ranks)."""
    family = detect_family(model)
    units = family.units(model)
    runs = split_by_points(units, points, len(points) + 1)
    specs = [StageSpec(i, len(runs), tuple(r)) for i, r in enumerate(runs)]
    inputs = dict(inputs)
    x = inputs.pop(family.primary)
    names = []
    for spec in specs:
        part = prune(model, [*spec.module_names, *family.always_kept])
        part.forward = functools.partial(family.forward, part, spec)
        names.append([n for n, _ in part.named_parameters()])
        x = part(x, **{k: v for k, v in inputs.items() if k in family.inputs_for(spec)})
    return x, names


def _batch(seq=12):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (3, seq), generator=g)
    mask = torch.ones_like(ids)
    mask[1, seq - 4:] = 0
    pos = (torch.arange(seq) * 2 + 3).expand(3, seq).clone()  # non-default and not a mere offset
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}


def _hf(model_type):
    import transformers

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    cfg = {
        "mistral": lambda: transformers.MistralConfig(sliding_window=4, **common),
        "qwen2": lambda: transformers.Qwen2Config(use_sliding_window=True, sliding_window=4, max_window_layers=2,
                                                  **common),
        "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **common),
        "mixtral": lambda: transformers.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, **common),
    }[model_type]()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


@pytest.mark.parametrize("name, points", [
    ("llama", ["model.layers.2"]),
    ("llama", ["model.layers.1", "model.layers.3", "lm_head"]),
    ("mistral", ["model.layers.2"]),
    ("qwen2", ["model.layers.1", "model.layers.3"]),
    ("qwen3", ["model.layers.2"]),
    ("mixtral", ["model.layers.2"]),
    ("gpt2", ["transformer.h.1", "transformer.ln_f"]),
])
def test_chained_stages_reproduce_the_model_forward(name, points):
    model = {"llama": lambda: tiny_llama(layers=4), "gpt2": lambda: tiny_gpt2(layers=4)}.get(
        name, lambda: _hf(name))().eval()
    batch = _batch()
    with torch.no_grad():
        ref = model(**batch).logits
        got, names = _chain(model, points, batch)
    assert torch.equal(got, ref), (got - ref).abs().max()
    # the stages partition the parameters under the original names
    flat = [n for ns in names for n in ns]
    assert sorted(flat) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert len(flat) == len(set(flat))


def test_sequential_family_and_sparse_stage_lists():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    x = torch.randn(5, 8)
    got, names = _chain(model, ["2", "4"], {"input": x})
    assert torch.equal(got, model(x))
    assert names == [["0.weight", "0.bias"], ["2.weight", "2.bias"], ["4.weight", "4.bias"]]
    stage = prune(model, ["2", "3"])
    assert list(stage._modules) == ["2", "3"] and stage._modules["2"] is model[2]


def test_pruned_copy_keeps_names_and_leaves_the_original_intact():
    model = tiny_llama(layers=4)
    stage = prune(model, ["model.layers.2", "model.layers.3", "model.norm", "lm_head", "model.rotary_emb"])
    assert stage is not model and stage.model is not model.model
    assert stage.model.layers._modules["2"] is model.model.layers[2]
    assert stage.model.embed_tokens is None and len(model.model.layers) == 4
    assert {n.split(".")[2] for n, _ in stage.named_parameters() if n.startswith("model.layers.")} == {"2", "3"}
    # hooks registered on the copy do not leak into the original
    stage.register_forward_pre_hook(lambda m, a: None)
    assert not model._forward_pre_hooks


def test_unknown_model_family_names_the_supported_ones():
    with pytest.raises(StrategyError, match="Supported: Hugging Face causal LMs.*GPT2LMHeadModel.*nn.Sequential"):
        detect_family(tiny_t5())


def test_bind_inputs_rejects_what_a_stage_cannot_route():
    model = tiny_llama()
    family = detect_family(model)
    sig = inspect.signature(model.forward)
    ids = torch.zeros(2, 4, dtype=torch.long)
    got = family.bind_inputs(sig, {"input_ids": ids, "labels": ids, "use_cache": False}, "unpack_dict")
    assert set(got) == {"input_ids", "labels"}
    assert set(family.bind_inputs(sig, ids, None)) == {"input_ids"}
    with pytest.raises(ValueError, match="cannot route the model input 'inputs_embeds'"):
        family.bind_inputs(sig, {"input_ids": ids, "inputs_embeds": torch.zeros(2, 4, 64)}, "unpack_dict")


def test_slice_rows_keeps_structure_and_broadcast_tensors():
    batch = {"a": torch.arange(6).view(3, 2), "b": [torch.arange(3), 7], "pos": torch.arange(2).view(1, 2)}
    out = slice_rows(batch, 1, 3, 3)
    assert torch.equal(out["a"], torch.tensor([[2, 3], [4, 5]])) and torch.equal(out["b"][0], torch.tensor([1, 2]))
    assert out["b"][1] == 7 and torch.equal(out["pos"], batch["pos"])


# ----------------------------------------------------------------------------------------------- tied weights
def test_untie_gives_later_stages_an_equal_copy():
    model = tiny_gpt2(layers=4)
    assert model.lm_head.weight is model.transformer.wte.weight
    stage_of = {n: (0 if n.startswith("transformer.wte") or ".h.0." in n or ".h.1." in n else 1)
                for n, _ in model.named_parameters(remove_duplicate=False)}
    groups = untie_across_stages(model, stage_of)
    assert [g.names for g in groups] == [["transformer.wte.weight", "lm_head.weight"]] and groups[0].owner == 0
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert torch.equal(model.lm_head.weight, model.transformer.wte.weight)
    # both owners on one stage: an ordinary tie, left alone
    model = tiny_gpt2(layers=4)
    assert untie_across_stages(model, {n: 0 for n, _ in model.named_parameters(remove_duplicate=False)}) == []
    assert model.lm_head.weight is model.transformer.wte.weight


# ----------------------------------------------------------------------------------------------- config
def test_plan_dims_and_config_validation():
    dims = plan_dims([("pipeline_parallel", {"size": 2})], 4)
    assert (dims.pp, dims.dp_replicate) == (2, 2)
    dims = plan_dims([("parallel_mode", {"pp": 2, "dp_shard": 2}), ("pp", {"schedule": "zero_bubble"}),
                      "zero2"], 4)
    assert (dims.pp, dims.dp_shard) == (2, 2)
    cases = [
        ([("parallel_mode", {"pp": 4}), ("pipeline_parallel", {"size": 2})], "size=2 but parallel_mode sets pp=4"),
        (["pipeline_parallel"], "needs its degree"),
        ([("pipeline_parallel", {"size": 2, "schedule": "gpipe", "stages_per_rank": 2})], "one stage per rank"),
        ([("pipeline_parallel", {"size": 2, "schedule": "zbv", "stages_per_rank": 3})], "exactly 2 stages"),
        ([("pipeline_parallel", {"size": 4, "num_microbatches": 2})], "num_microbatches >= the number of stages"),
        ([("pipeline_parallel", {"size": 2, "schedule": "interleaved_1f1b", "num_microbatches": 5})], "multiple"),
        ([("pipeline_parallel", {"size": 2, "schedule": "zero_bubble"}), "ddp"], "DDP's gradient hooks never fire"),
        ([("pipeline_parallel", {"size": 2, "schedule": "zbv"}), "fsdp"], "reshard_after_forward"),
        ([("pipeline_parallel", {"size": 2, "schedule": "fast"})], "schedule"),
        ([("pipeline_parallel", {"size": 0})], "size must be >= 1"),
    ]
    for strategy, match in cases:
        with pytest.raises(StrategyError, match=match):
            plan_dims(strategy, 4)
