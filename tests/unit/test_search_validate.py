"""The methods' ``validate`` hooks (via ``torchloom.search.validate.validate_strategy``) raise exactly when
``auto_accelerate`` would: in one process by running ``auto_accelerate`` itself (degrees 1), and for larger
degrees against the pre-launch checks (``plan_dims`` + ``check_model_fits``: the same functions ``apply``
runs) on tiny Llama / GPT-2 meta models. Combination checks that only ``apply`` makes (sequence-parallel
plan, fused q/k/v under fsdp) are compared with the message ``apply``'s shared check function gives."""
import pytest
import torch

import torchloom
from torchloom import StrategyError
from torchloom.api import plan_dims
from torchloom.parallel.fit import check_model_fits
from torchloom.parallel.mesh import ParallelDims
from torchloom.cost.model_info import ModelInfo
from torchloom.search.validate import validate_strategy

from ..models import lm_loss, tiny_gpt2, tiny_llama, token_batches


def meta(build, **kw):
    with torch.device("meta"):
        return build(**kw)


def info_of(model) -> ModelInfo:
    """What validate reads: the meta module and the block count."""
    n = sum(p.numel() for p in model.parameters())
    layers = model.config.num_hidden_layers
    return ModelInfo(type(model).__name__, 16, [], [], layers, n, n, module=model)


def outcome(fn):
    try:
        fn()
    except StrategyError as e:
        return str(e)
    return None


GRID_METHODS = [
    ["tensor_parallel", "fsdp"],
    ["tensor_parallel", ("fsdp", {"reshard_after_forward": False})],
    ["pipeline_parallel", "ddp"],
    [("pipeline_parallel", {"schedule": "interleaved_1f1b"}), "fsdp"],
    [("pipeline_parallel", {"split_points": ["model.layers.7"]})],
    [("pipeline_parallel", {"schedule": "zero_bubble"}), "ddp"],
    ["pipeline_parallel", "tensor_parallel", "fsdp"],
    ["fsdp"],
    ["ddp"],
    ["tensor_parallel"],  # dp > 1 without a data-parallel method: a replicating fsdp is added
]
GRID_DIMS = [dict(tp=2, dp_shard=2), dict(tp=4), dict(tp=3), dict(pp=2, dp_replicate=2), dict(pp=3),
             dict(pp=6), dict(pp=2, tp=2), dict(dp_shard=4), dict(dp_replicate=4)]


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_validate_matches_the_pre_launch_checks_on_a_grid(build):
    """Every (methods, degrees) pair: validate raises iff plan_dims/check_model_fits raise, same message."""
    model = meta(build)
    info = info_of(model)
    raised = 0
    for methods in GRID_METHODS:
        for d in GRID_DIMS:
            dims = ParallelDims(**d)
            world = dims.pp * dims.dp * dims.tp
            if dims.pp == 1 and any("pipeline_parallel" in str(m) for m in methods):
                continue  # check_pipeline_fits skips pp=1, apply does not: the one-process test covers it
            strategy = [("parallel_mode", dims.as_dict()), *methods]

            def reference():
                resolved = plan_dims(strategy, world)
                check_model_fits(model, strategy, tp=resolved.tp, pp=resolved.pp)

            want = outcome(reference)
            got = outcome(lambda: validate_strategy(strategy, info, dims))
            assert got == want, (methods, d)
            raised += want is not None
    assert 10 < raised < len(GRID_METHODS) * len(GRID_DIMS) - 10  # the grid has both kinds


def _apply(model, strategy):
    torchloom.auto_accelerate(model, torch.optim.SGD, None, lm_loss, strategy=strategy, optim_args={"lr": 0.1},
                              model_input_format="unpack_dict")


ONE_PROCESS = [
    (tiny_gpt2, {"dropout": 0.1}, [("checkpoint", {"preserve_rng_state": False})]),
    (tiny_gpt2, {"dropout": 0.1}, [("checkpoint", {"preserve_rng_state": False, "every_k": 2})]),
    (tiny_gpt2, {}, [("checkpoint", {"preserve_rng_state": False})]),
    (tiny_llama, {}, [("checkpoint", {"wrap_cls": ["NoSuchBlock"]})]),
    (tiny_llama, {}, [("fsdp", {"wrap_cls": ["LlamaDecoderLayr"]})]),
    (tiny_llama, {}, ["fsdp", "checkpoint"]),
    (tiny_llama, {}, [("pipeline_parallel", {"split_points": ["model.layers.7"]})]),
    (tiny_llama, {}, [("pipeline_parallel", {"schedule": "interleaved_1f1b"})]),
    (tiny_llama, {}, [("pipeline_parallel", {"schedule": "interleaved_1f1b", "stages_per_rank": 6})]),
    (tiny_llama, {}, [("pipeline_parallel", {"num_microbatches": 3, "schedule": "interleaved_1f1b",
                                             "stages_per_rank": 2})]),
    (tiny_llama, {}, [("tensor_parallel", {"plan": {"model.nothing.*": "colwise"}})]),  # tp=1: nothing checked
]


@pytest.mark.parametrize("build,kw,methods", ONE_PROCESS)
def test_validate_matches_auto_accelerate_in_one_process(build, kw, methods):
    """Degrees 1: ``auto_accelerate`` itself is the reference (its error, or none)."""
    dims = ParallelDims()
    strategy = [("parallel_mode", dims.as_dict()), *methods]
    want = outcome(lambda: _apply(build(**kw), strategy))
    got = outcome(lambda: validate_strategy(strategy, info_of(meta(build, **kw)), dims))
    assert got == want


def test_combination_checks_use_apply_s_functions():
    """Sequence parallel needs a plan with a sequence-parallel variant (GPT-2's has none); the messages are
    the ones ``tensor_parallel.apply`` raises (its ``check_resolved``)."""
    from torchloom.methods.tensor_parallel import check_resolved
    from torchloom.parallel.tensor import auto_plan, resolve_plan

    gpt2 = meta(tiny_gpt2)
    plan = auto_plan(gpt2)
    want = outcome(lambda: check_resolved([gpt2], [plan], [resolve_plan(gpt2, plan)], 2, fsdp=True,
                                          sequence_parallel=True))
    assert want and "sequence_parallel" in want
    dims = ParallelDims(dp_shard=2, tp=2)
    strategy = [("parallel_mode", dims.as_dict()), "tensor_parallel", "sequence_parallel", "fsdp"]
    assert outcome(lambda: validate_strategy(strategy, info_of(gpt2), dims)) == want
    llama = meta(tiny_llama)  # Llama's plan has the variant
    assert outcome(lambda: validate_strategy(strategy, info_of(llama), dims)) is None


def test_validate_without_a_module_uses_the_architecture_sizes():
    info = ModelInfo("m", 16, [], [], 2, 1, 1, dims={"num_heads": 4, "num_kv_heads": 2, "vocab_size": 128})
    strategy = [("parallel_mode", {"tp": 4}), "tensor_parallel"]
    with pytest.raises(StrategyError, match="num_kv_heads = 2 is not divisible by tp=4"):
        validate_strategy(strategy, info, ParallelDims(tp=4))
    validate_strategy([("parallel_mode", {"tp": 2}), "tensor_parallel"], info, ParallelDims(tp=2))
    with pytest.raises(StrategyError, match="6 stages"):
        validate_strategy([("parallel_mode", {"pp": 6}), "pipeline_parallel"], info, ParallelDims(pp=6))


def test_degrees_other_than_the_strategy_s_are_refused():
    info = info_of(meta(tiny_llama))
    with pytest.raises(StrategyError, match="resolve to"):
        validate_strategy([("parallel_mode", {"tp": 2, "dp_shard": 2}), "tensor_parallel", "fsdp"], info,
                          ParallelDims(dp_replicate=2, tp=2))


def test_one_process_apply_really_trains_when_validate_passes():
    """The reference run is real: a strategy validate accepts trains one step in one process."""
    strategy = [("parallel_mode", {}), "fsdp", ("checkpoint", {"every_k": 2})]
    validate_strategy(strategy, info_of(meta(tiny_llama)), ParallelDims())
    res = torchloom.auto_accelerate(tiny_llama(), torch.optim.SGD, None, lm_loss, strategy=strategy,
                                    optim_args={"lr": 0.1}, model_input_format="unpack_dict")
    ids = token_batches(2)
    assert torch.isfinite(res.train_step({"input_ids": ids, "labels": ids}))
