# Ported from ATorch (https://github.com/intelligent-machine-learning/atorch),
# atorch/tests/toy_modules/toy_module.py. Copyright the ATorch authors, Apache License 2.0.
# Changes for torchloom's compat tests:
# - `atorch.common.util_func.data_to_device` is imported from `torchloom.compat.atorch` (import path only).
# - ATorch's `ModelContext` is an internal class of its acceleration engine that compat does not mirror; the
#   tests use it only as a bag of arguments for `auto_accelerate` plus `get_loss_from_loss_func_output`, so a
#   small stand-in with those attributes is defined here (`ToyModelContext`, exported as `ModelContext`).
# - `recursively_apply` is defined here (ATorch's util helper, used only by `change_dtype` below).
# - Kept only what the ported tests use: the Llama chunk / pipeline helpers and ToyGPT2Model's sequence-parallel
#   patch (`set_sp`, which needs ATorch's `seq_all_to_all`, and the sp branch of its forward) are left out.
import collections.abc as collections_abc
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import Dataset
from transformers.models.gpt2.configuration_gpt2 import GPT2Config
from transformers.models.gpt2.modeling_gpt2 import GPT2MLP, GPT2Attention, GPT2Block, GPT2Model

from torchloom.compat.atorch.common.util_func import data_to_device


def recursively_apply(func, data, *args, **kwargs):
    """Apply ``func`` to every tensor in a nested list/tuple/dict (ATorch's util_func.recursively_apply)."""
    if isinstance(data, (tuple, list)):
        return type(data)(recursively_apply(func, o, *args, **kwargs) for o in data)
    if isinstance(data, collections_abc.Mapping):
        return type(data)({k: recursively_apply(func, v, *args, **kwargs) for k, v in data.items()})
    if isinstance(data, torch.Tensor):
        return func(data, *args, **kwargs)
    return data


@dataclass
class ToyModelContext:
    """Stand-in for ATorch's internal ``ModelContext``: the arguments the tests hand to ``auto_accelerate``."""

    model: nn.Module
    optim_func: Optional[Callable] = None
    dataset: Any = None
    loss_func: Optional[Callable] = None
    prepare_input: Optional[Callable] = None
    model_input_format: Optional[str] = None
    optim_args: Optional[dict] = None
    optim_param_func: Optional[Callable] = None
    dataloader_args: Optional[dict] = None
    distributed_sampler_cls: Any = None
    extra_args: Optional[dict] = field(default=None)

    @staticmethod
    def get_loss_from_loss_func_output(output):
        """The loss of a loss_func result: its first item when it returns a sequence (as ATorch does)."""
        if isinstance(output, collections_abc.Sequence):
            return output[0]
        return output


ModelContext = ToyModelContext


def get_gpt2_module_type(module="block"):
    if module == "block":
        return GPT2Block
    elif module == "attn":
        return GPT2Attention
    elif module == "mlp":
        return GPT2MLP
    return None


class ToyCustomModule(nn.Module):
    def __init__(self, in_features=16, out_features=4, layer_num=8):
        super().__init__()
        self.linears = torch.nn.ModuleList([nn.Linear(out_features, out_features) for _ in range(layer_num)])

    def forward(self, inputs, test_kwargs=True):
        for op in self.linears:
            inputs = op(inputs)
        return inputs


class ToyModel(nn.Module):
    def __init__(self, in_features=16, out_features=4, use_custom_module=False, layer_num=8):
        """
        Args:
            in_feature (int): size of input feature.
            out_feature (int): size of output feature.
        """
        super(ToyModel, self).__init__()
        self.use_custom_module = use_custom_module
        self.linear = torch.nn.Linear(in_features, out_features)
        if use_custom_module:
            self.linears = ToyCustomModule(in_features, out_features, layer_num=layer_num)
        else:
            self.linears = torch.nn.ModuleList([nn.Linear(out_features, out_features) for _ in range(layer_num)])

    def forward(self, inputs):
        data = self.linear(inputs[0])
        if self.use_custom_module:
            data = self.linears(data, test_kwargs=True)
        else:
            for op in self.linears:
                data = op(data)
        return data


def optim_func(model_parameters, **kwargs):
    return optim.Adam(model_parameters, **kwargs)


def optim_param_func(model):
    no_decay = "bias"
    parameters = [
        {
            "params": [p for n, p in model.named_parameters() if no_decay not in n],
            "weight_decay": 0.01,
        },
        {
            "params": [p for n, p in model.named_parameters() if no_decay in n],
            "weight_decay": 0.0,
        },
    ]
    return parameters


def loss_func(inputs, output):
    loss = nn.MSELoss()
    return loss(inputs[1], output)


def prepare_input(data, device):
    return data_to_device(data, device)


class ToyDataset(Dataset):
    def __init__(self, size, data_size=(16,), output_size=(4,)):
        """
        Args:
            size (int): the of samples.
            data_size (tuple): the shape of one input, data_size[-1] must match the in_features
                in ToyModule
            output_size (tuple): the shape of output, output_size[-1] must match the out_feautes
                in ToyModule
        """
        self.size = size
        self.data_size = data_size
        self.output_size = output_size

    def __len__(self):
        return self.size

    def __getitem__(self, idx):
        return np.ones(self.data_size, dtype=np.float32) * idx, np.ones(self.output_size, dtype=np.float32)


# copy from pytorch/benchmarks/distributed/pipeline/benchmark_dataset.py with some modification
def collate_sentences_lm(samples, input_name="input", label_name="target"):
    if len(samples) == 0:
        return {}

    src_tokens = torch.stack([s["source"] for s in samples], 0)
    tgt_tokens = torch.stack([s["target"] for s in samples], 0)

    batch = {
        input_name: src_tokens,
        label_name: tgt_tokens,
    }
    return batch


# copy from pytorch/benchmarks/distributed/pipeline/benchmark_dataset.py with some modification with modification
class BenchmarkLMDataset(Dataset):
    def __init__(
        self,
        vocab_size=10000,
        max_source_positions=1024,
        total_samples=10000,
    ):
        self.vocab_size = vocab_size
        self.max_source_positions = max_source_positions
        self.total_samples = total_samples

    def __getitem__(self, index):
        length = self.max_source_positions
        torch.manual_seed(index)
        source = torch.randint(1, self.vocab_size, (length,))
        target = source.clone()
        return {
            "source": source,
            "target": target,
        }

    def __len__(self):
        return self.total_samples


class ToyGPT2Model(GPT2Model):
    def __init__(self, hidden_size=256, head_num=4, layer_num=3, seq_length=512):
        config = GPT2Config()
        c_s = f"n_embd={hidden_size},n_head={head_num},n_layer={layer_num},n_positions={seq_length}"
        config.update_from_string(c_s)
        super().__init__(config)
        self.config = config
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids=None, **kwargs):
        transformer_outputs = super().forward(input_ids, **kwargs)
        hidden_states = transformer_outputs[0]
        lm_logits = self.lm_head(hidden_states)
        return lm_logits

    def vocab_size(self):
        return self.config.vocab_size


def decoder_loss_func(inputs, output, vocab_size):
    shift_logits = output[..., :-1, :].contiguous()
    if isinstance(inputs, dict):
        if "labels" in inputs:
            labels = inputs["labels"]
        elif "target" in inputs:
            labels = inputs["target"]
    else:
        labels = inputs
    shift_labels = labels[..., 1:].contiguous()

    criterion = torch.nn.CrossEntropyLoss()
    return criterion(shift_logits.view(-1, vocab_size), shift_labels.view(-1))


def create_model_context(
    data_size=16,
    batch_size=2,
    use_optim_param_func=False,
    dataset=None,
    distributed_sampler_cls=None,
    use_custom_module=False,
    use_gpt2=False,
    hidden_size=256,
    head_num=4,
    layer_num=3,
    seq_length=512,
    extra_args=None,
):
    user_defined_optim_param_func = optim_param_func if use_optim_param_func else None
    dataloader_args = {"batch_size": batch_size, "drop_last": True, "shuffle": True, "num_workers": 1}
    if use_gpt2:
        model = ToyGPT2Model(hidden_size=hidden_size, head_num=head_num, layer_num=layer_num, seq_length=seq_length)
        dataset = BenchmarkLMDataset(
            vocab_size=model.vocab_size(), max_source_positions=seq_length, total_samples=data_size
        )
        dataloader_args["collate_fn"] = collate_sentences_lm
        model_loss_func = functools.partial(decoder_loss_func, vocab_size=model.vocab_size())
    else:
        model = ToyModel(use_custom_module=use_custom_module)
        dataset = ToyDataset(data_size) if dataset is None else dataset
        model_loss_func = loss_func
    model_context = ModelContext(
        model=model,
        optim_func=optim_func,
        dataset=dataset,
        loss_func=model_loss_func,
        prepare_input=prepare_input,
        optim_args={"lr": 0.001},
        optim_param_func=user_defined_optim_param_func,
        dataloader_args=dataloader_args,
        distributed_sampler_cls=distributed_sampler_cls,
        extra_args=extra_args,
    )
    return model_context


def change_dtype(data, dtype, fp32_only=True):
    if data.dtype == torch.float32 or not fp32_only:
        return data.to(dtype)
    else:
        return data


def run_train(
    model,
    dataloader,
    optim,
    prepare_input,
    loss_func,
    device="cpu",
    input_dtype=torch.float32,
    gpt2_model=False,
    use_optim_backward=False,
    inspector=None,
):
    for idx, data in enumerate(dataloader):
        pdata = prepare_input(data, device)
        if input_dtype != torch.float32:
            pdata = recursively_apply(change_dtype, pdata, input_dtype)
        optim.zero_grad()
        if gpt2_model:
            output = model(pdata["input"])
        else:
            output = model(pdata)
        loss = ModelContext.get_loss_from_loss_func_output(loss_func(pdata, output))
        if use_optim_backward:
            optim.backward(loss)
        else:
            loss.backward()
        optim.step()
        if inspector is not None:
            inspector.step()
    return idx + 1
