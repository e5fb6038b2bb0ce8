# Ported from ATorch (https://github.com/intelligent-machine-learning/atorch),
# atorch/tests/common_tests/optimizations_test.py. Copyright the ATorch authors, Apache License 2.0.
# Changes: the import path (`atorch` -> `torchloom.compat.atorch`; toy modules -> tests.compat.toy_modules).
# ATorch builds the strategy with its internal `model_transform(mc, strategy, OptimizationLibrary())`, which
# compat does not mirror; the same strategy goes through the public
# `auto_accelerate(..., load_strategy=strategy, ignore_dryrun_on_load_strategy=True)` here, and the result is
# used exactly as ATorch uses model_transform's (model, dataloader, optim, prepare_input, loss_func). ATorch
# skips test_half without a GPU ("half is only supported by gpu"); torchloom's `half` runs on CPU, so it runs.
# Assertions are ATorch's, unchanged (plus `assert status` on auto_accelerate's result).
import copy
import unittest

import torch

from tests.compat.toy_modules.toy_module import create_model_context, run_train
from torchloom.compat.atorch.auto.accelerate import auto_accelerate
from torchloom.compat.atorch.auto.strategy import Strategy


def model_transform(mc, strategy):
    """ATorch's model_transform(mc, strategy, opt_lib), through the public auto_accelerate."""
    status, result, _ = auto_accelerate(
        mc.model,
        mc.optim_func,
        mc.dataset,
        mc.loss_func,
        mc.prepare_input,
        mc.model_input_format,
        mc.optim_args,
        mc.optim_param_func,
        mc.dataloader_args,
        load_strategy=strategy,
        ignore_dryrun_on_load_strategy=True,
    )
    assert status
    return result


class OptimizationsTest(unittest.TestCase):
    def setUp(self):
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
        data_size = 8
        batch_size = 2
        model_context = create_model_context(data_size=data_size, batch_size=batch_size, use_optim_param_func=True)
        model_context.model.to(device)
        self.mc = model_context
        self.data_size = data_size
        self.batch_size = batch_size
        self.device = device

    def run_test(self, mc, strategy, input_dtype=torch.float32):
        model_context = model_transform(mc, strategy)
        num = run_train(
            model_context.model,
            model_context.dataloader,
            model_context.optim,
            model_context.prepare_input,
            model_context.loss_func,
            self.device,
            input_dtype=input_dtype,
        )
        self.assertEqual(num, self.data_size // self.batch_size)

    def test_checkpoint(self):
        module_type = "ToyCustomModule"
        mc = copy.deepcopy(self.mc)
        strategy = Strategy([("checkpoint", module_type, False)])
        self.run_test(mc, strategy)

    def test_half(self):
        mc = copy.deepcopy(self.mc)
        config = "fp16"
        strategy = Strategy([("half", config, False)])
        self.run_test(mc, strategy, torch.float16)

        mc = copy.deepcopy(self.mc)
        config = "bf16"
        strategy = Strategy([("half", config, False)])
        self.run_test(mc, strategy, torch.bfloat16)
