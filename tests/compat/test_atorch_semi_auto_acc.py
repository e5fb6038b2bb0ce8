# Ported from ATorch (https://github.com/intelligent-machine-learning/atorch),
# atorch/tests/common_tests/semi_auto_acc_test.py. Copyright the ATorch authors, Apache License 2.0.
# Changes: the import path (`atorch` -> `torchloom.compat.atorch`; toy modules -> tests.compat.toy_modules);
# `mp.spawn` on 2 GPUs -> torchloom's `run_ranks` on 2 CPU gloo ranks (tests/compat/_ranks.py; it sets
# RANK/LOCAL_RANK/WORLD_SIZE and creates the default process group, so the os.environ lines and the port are
# not needed; `rank`, mp.spawn's first argument, is read from torch.distributed.get_rank()); the parameters of
# the branches not ported (bf16_only, wrap_test_only, use_fp8, use_te_impl) are removed; sizes shrunk for
# CPU: hidden_size 256 -> 64, seq_length 512 -> 64 (head_num, layer_num, data_size, batch_size kept);
# `use_fa = torch.cuda.get_device_capability()[0] >= 8` raises without CUDA, so it is guarded by
# `torch.cuda.is_available()` (False on CPU: ATorch's own no-flash-attention branch is taken); fp8 is never
# available on CPU (`is_fp8_available` is False here, ATorch's helper is internal); compat provides no
# `BF16Optimizer` (atorch.optimizers.BF16Optimizer raises ImportError naming the `amp` bf16 strategy instead),
# so the `bf16_only` branch (which asserts result.optim is one) is not ported and the non-bf16_only check
# `not isinstance(result.optim, BF16Optimizer)` holds by construction and is left out.
# Not ported: test_gpt2_strategy_multi_instance (4 ranks, zero_size), test_gpt2_bf16_only (BF16Optimizer),
# test_gpt2_use_te_impl / test_gpt2_fp8 (TransformerEngine / fp8 GPUs), test_fsdp_wraps (asserts FSDP1
# FullyShardedDataParallel instances; torchloom shards with FSDP2), test_ds_zero_bf16 (DeepSpeed; skipped
# upstream too), test_gpt2_strategy_sp2 (ATorch's sequence_parallel).
# Assertions are ATorch's, unchanged.
import pytest
import torch

import torchloom.compat.atorch as atorch
from tests.compat.toy_modules.toy_module import create_model_context, get_gpt2_module_type, run_train
from torchloom.compat.atorch.auto.accelerate import auto_accelerate
from torchloom.compat.atorch.distributed.distributed import (
    parallel_instance_index,
    parallel_instance_num,
    world_size,
)
from tests.compat._ranks import RankCodes


def is_fp8_available():
    """fp8 needs an sm89+ GPU; these CPU tests never have one."""
    return False


def run_gpt2_with_strategy(
    hidden_size,
    head_num,
    layer_num,
    seq_length,
    data_size,
    batch_size,
    use_bf16=False,
    use_sp=False,
    zero_size=None,
    no_reentrant=False,
):
    rank = torch.distributed.get_rank()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    res = atorch.init_distributed(backend, set_cuda_device_using_local_rank=True)
    if not res:
        raise Exception("init failed")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    use_fa = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    use_fp8 = False
    model_context = create_model_context(
        data_size=data_size,
        batch_size=batch_size,
        use_gpt2=True,
        hidden_size=hidden_size,
        head_num=head_num,
        layer_num=layer_num,
        seq_length=seq_length,
    )

    gpt2block_cls = get_gpt2_module_type(module="block")

    amp_config = {"dtype": torch.bfloat16 if use_bf16 else torch.float16}

    fsdp_config = {
        "sync_module_states": True,
        "limit_all_gathers": True,
        "atorch_wrap_cls": (gpt2block_cls,),
    }
    fsdp_config["use_orig_params"] = True  # ATorch: if torch_version() >= (2, 0, 0)
    checkpoint_config = {"wrap_class": (gpt2block_cls,), "no_reentrant": no_reentrant}

    if zero_size is not None:
        p_config = ([("data", zero_size)], None, True)
    else:
        p_config = None
    # new transformers version does not comparible with atorch fa
    if use_fa and not use_fp8:
        strategy = [
            ("parallel_mode", p_config),
            "module_replace",
            ("amp_native", amp_config),
            ("fsdp", fsdp_config),
            ("checkpoint", checkpoint_config),
            "auto_ddp",
        ]
    else:
        strategy = [
            ("parallel_mode", p_config),
            ("amp_native", amp_config),
            ("fsdp", fsdp_config),
            ("checkpoint", checkpoint_config),
        ]

    status, result, best_strategy = auto_accelerate(
        model_context.model,
        model_context.optim_func,
        model_context.dataset,
        model_context.loss_func,
        model_context.prepare_input,
        model_context.model_input_format,
        model_context.optim_args,
        model_context.optim_param_func,
        model_context.dataloader_args,
        load_strategy=strategy,
        ignore_dryrun_on_load_strategy=True,
    )
    assert status
    diff_method_num = 0
    if use_fp8 and not is_fp8_available():
        diff_method_num += 1
    if atorch.world_size() == 1:
        diff_method_num += 1
        if "auto_ddp" in strategy:
            diff_method_num += 1
    assert len(best_strategy) == len(strategy) - diff_method_num
    m_model = result.model
    m_dataloader = result.dataloader
    m_optim = result.optim
    m_prepare_input = result.prepare_input
    m_loss_func = result.loss_func
    input_dtype = torch.float32

    num = run_train(
        m_model, m_dataloader, m_optim, m_prepare_input, m_loss_func, device, input_dtype=input_dtype, gpt2_model=True
    )
    assert num == data_size // batch_size, f"num={num}"
    if zero_size is None:
        assert parallel_instance_num() == 1
        assert parallel_instance_index() == 0
    else:
        assert parallel_instance_num() == world_size() // zero_size
        assert parallel_instance_index() == rank // zero_size
        assert m_model.world_size == zero_size
        assert m_model.rank == rank % zero_size

    atorch.reset_distributed()


def _gpt2_args(batch_size, use_bf16):
    hidden_size = 64  # ATorch: 256
    head_num = 4
    layer_num = 3
    seq_length = 64  # ATorch: 512
    data_size = 16
    return (hidden_size, head_num, layer_num, seq_length, data_size, batch_size, use_bf16)


# both tests' codes run in one 2-rank launch (tests/compat/_ranks.py)
_CODES = RankCodes({
    "test_gpt2_strategy": (run_gpt2_with_strategy, _gpt2_args(batch_size=2, use_bf16=False), {}),
    "test_gpt2_strategy_bf16": (run_gpt2_with_strategy, _gpt2_args(batch_size=4, use_bf16=True), {}),
})


@pytest.mark.distributed
def test_gpt2_strategy():
    _CODES.result("test_gpt2_strategy")


@pytest.mark.distributed
def test_gpt2_strategy_bf16():
    _CODES.result("test_gpt2_strategy_bf16")
