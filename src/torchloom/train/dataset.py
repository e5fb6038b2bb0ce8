"""Fixed-length windows over a token stream, as a map-style dataset for causal language modelling."""
from __future__ import annotations

import torch
from torch.utils.data import Dataset


class TokenWindows(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens: item ``i`` is ``tokens[i*seq_len : (i+1)*seq_len]``.

    Each item is ``{"input_ids": (seq_len,) int64, "labels": (seq_len,) int64}`` with ``labels`` equal to
    ``input_ids`` (Hugging Face convention: the loss shifts them, position ``t`` predicts token ``t+1``).
    A trailing remainder shorter than ``seq_len`` is dropped.
    """

    def __init__(self, tokens: torch.Tensor, seq_len: int):
        if tokens.dim() != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tuple(tokens.shape)}")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}")
        n = tokens.numel() // seq_len
        if n == 0:
            raise ValueError(f"{tokens.numel()} tokens do not fill one window of seq_len={seq_len}")
        self.seq_len = seq_len
        self.windows = tokens[: n * seq_len].to(torch.int64).view(n, seq_len)

    def __len__(self) -> int:
        return self.windows.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        w = self.windows[i]
        return {"input_ids": w, "labels": w.clone()}

    def batch(self, indices: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
        """The windows ``indices`` stacked into one batch (same layout as the default collate)."""
        w = self.windows[torch.as_tensor(indices, dtype=torch.long)]
        return {"input_ids": w, "labels": w.clone()}
