"""Workers for test_moe_layer_parallel: torchloom.moe.MoE under expert and pipeline parallelism."""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

V, D = 32, 16


def ep_data(steps: int = 2) -> list[list[torch.Tensor]]:
    """``[step][rank]`` micro-batches of shape (2, 6)."""
    g = torch.Generator().manual_seed(5)
    return [[torch.randint(0, V, (2, 6), generator=g) for _ in range(2)] for _ in range(steps)]


def ep_worker(strategy, capacity_factor) -> dict:
    import torchloom
    from tests.models import full_params
    from tests.unit.test_moe_aux_train_step import TinyMoELM, mean_loss

    res = torchloom.auto_accelerate(TinyMoELM(capacity_factor=capacity_factor), torch.optim.SGD, None, mean_loss,
                                    strategy=strategy, optim_args={"lr": 0.5},
                                    dataloader_args={"batch_size": 4, "micro_batch_size": 2})
    r = dist.get_rank()
    for step in ep_data():
        res.train_step(step[r])
    return {"params": full_params(res.model), "metrics": res.train_step.last_moe_metrics}


def ep_reference(capacity_factor, expert_scale: float = 1.0) -> dict:
    """One process running both ranks' micro-batches with gradient accumulation; ``expert_scale`` multiplies
    the expert gradients before each step (a wrongly scaled run, to show the tolerance separates it)."""
    from tests.unit.test_moe_aux_train_step import TinyMoELM, mean_loss
    from torchloom.train_step import TrainStep

    m = TinyMoELM(capacity_factor=capacity_factor)

    def scale(_params):
        for n, p in m.named_parameters():
            if ".experts." in n and p.grad is not None:
                p.grad.mul_(expert_scale)

    ts = TrainStep(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.5), loss_func=mean_loss,
                   device=torch.device("cpu"), grad_accum_steps=2, pre_step_hooks=[scale])
    for step in ep_data():
        for b in step:
            ts(b)
    return {k: v.detach().clone() for k, v in m.named_parameters()}


class Res(nn.Module):
    def __init__(self):
        super().__init__()
        from torchloom.moe import MoE, MoEConfig

        self.moe = MoE(MoEConfig(dim=D, hidden_dim=24, num_experts=4, top_k=2, aux_loss_weight=0.5,
                                 z_loss_weight=0.1, init_std=0.3))

    def forward(self, h):
        return h + self.moe(h)


def pp_build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, D), Res(), Res(), nn.Linear(D, V, bias=False))


def pp_loss(batch, logits):
    return F.cross_entropy(logits[:, :-1].reshape(-1, V), batch[:, 1:].reshape(-1))


def pp_data() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, V, (4, 6), generator=g) for _ in range(2)]


def pp_worker() -> dict:
    import torchloom
    from tests.models import full_params

    res = torchloom.auto_accelerate(pp_build(), torch.optim.SGD, None, pp_loss,
                                    strategy=[("pipeline_parallel", {"size": 2, "num_microbatches": 2})],
                                    optim_args={"lr": 0.5}, dataloader_args={"batch_size": 4})
    for b in pp_data():
        res.train_step(b)
    return {"params": full_params(res.model)}


def pp_reference(aux_factor_one: bool = False) -> dict:
    """One process, the two pipeline micro-batches accumulated; ``aux_factor_one``: the aux gradient not
    divided by the micro-batch count (the wrong run)."""
    from torchloom.train_step import TrainStep

    m = pp_build()
    ts = TrainStep(model=m, optimizer=torch.optim.SGD(m.parameters(), lr=0.5), loss_func=pp_loss,
                   device=torch.device("cpu"), grad_accum_steps=2)
    if aux_factor_one:
        ts._aux_factor = lambda count, n=1: 1.0
    for b in pp_data():
        for half in (b[:2], b[2:]):
            ts(half)
    return {k: v.detach().clone() for k, v in m.named_parameters()}


class _Out:
    """A plain output class torch.utils._pytree cannot look into."""


class HiddenOutputNet(nn.Module):
    def __init__(self):
        super().__init__()
        from torchloom.moe import MoE, MoEConfig

        self.embed = nn.Embedding(V, D)
        self.moe = MoE(MoEConfig(dim=D, hidden_dim=24, num_experts=4, top_k=2))
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        out = _Out()
        out.loss = F.cross_entropy(self.head(h + self.moe(h)).flatten(0, 1), tokens.flatten())
        return out


def hidden_output_worker() -> str:
    import torchloom

    torch.manual_seed(0)
    res = torchloom.auto_accelerate(HiddenOutputNet(), torch.optim.SGD, None, lambda b, o: o.loss,
                                    strategy=["fsdp"], optim_args={"lr": 0.1})
    try:
        res.train_step(torch.randint(0, V, (2, 6)))
    except TypeError as e:
        return str(e)
    return "no error"
