"""A few FSDP steps of a tiny model on gloo, ending through `clean_exit` (run by `loom run`).

``--natural-exit`` leaves through the interpreter's normal shutdown instead (the path that sometimes
aborts with SIGABRT on gloo after FSDP; add ``--destroy`` to destroy the process group first), for
comparisons by hand.
"""
import sys

import torch
from torch import nn

import torchloom
from torchloom.elastic.shutdown import clean_exit


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self, d: int = 32):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 1)

    def forward(self, x, y):
        for b in self.blocks:
            x = b(x)
        return self.head(x).sum(-1)


def loss_fn(batch, out):
    return ((out - batch["y"]) ** 2).mean()


def main() -> None:
    g = torch.Generator().manual_seed(0)
    xs, ys = torch.randn(64, 32, generator=g), torch.randn(64, generator=g)
    data = [{"x": xs[i], "y": ys[i]} for i in range(64)]
    res = torchloom.auto_accelerate(Net(), torch.optim.AdamW, data, loss_fn, strategy=["fsdp"],
                                    dataloader_args={"batch_size": 8}, model_input_format="unpack_dict")
    losses = [float(res.train_step(b)) for b in res.dataloader]
    if torch.distributed.get_rank() == 0:
        print(f"fsdp probe: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}", flush=True)
    if "--natural-exit" in sys.argv:
        if "--destroy" in sys.argv:
            torch.distributed.destroy_process_group()
        return
    clean_exit(0)


if __name__ == "__main__":
    main()
