# Ported from ATorch (https://github.com/intelligent-machine-learning/atorch),
# atorch/tests/common_tests/zero_optimization_test.py. Copyright the ATorch authors, Apache License 2.0.
# Changes: the import path (`atorch` -> `torchloom.compat.atorch`; toy modules -> tests.compat.toy_modules).
# Ported: test_fsdp (single process: fsdp is dropped with ATorch's log line). ATorch skips it without a GPU
# although it "tests fsdp in cpu mode"; it runs on CPU here. Assertions are ATorch's, unchanged.
# Not ported: the tests of ATorch's internal Zero1/Zero2/FSDPOptimization classes, to_module_class_by_name and
# the fairscale patches (internals compat does not mirror), and test_deepcopy (tests Python's copy semantics
# only, nothing of auto_accelerate).
import unittest
from unittest.mock import patch

from torch import nn

from tests.compat.toy_modules.toy_module import create_model_context
from torchloom.compat.atorch.auto import auto_accelerate


class ZeroOptimizationTest(unittest.TestCase):
    def test_fsdp(self):
        model_context = create_model_context(data_size=4, batch_size=1)
        # test fsdp in cpu mode
        from torchloom.compat.atorch.common.log_utils import default_logger as logger

        old_info_fn = logger.info

        def new_info_fn(*args, **kwargs):
            old_info_fn(*args, **kwargs)

        with patch.object(logger, "info", side_effect=new_info_fn) as mock_obj:
            auto_accelerate(
                model_context.model,
                load_strategy=[
                    (
                        "fsdp",
                        {
                            "atorch_wrap_cls": (nn.Linear,),
                        },
                    )
                ],
            )
        found = False
        for call_args_kwargs in mock_obj.call_args_list:
            args = call_args_kwargs[0]
            if args[0] == ("These distributed optimization methods are ignored in non-distributed case: %s"):
                found = True
                self.assertListEqual(args[1], ["fsdp"])
                break
        self.assertTrue(found)
