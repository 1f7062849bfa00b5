"""The small network the 0.4 examples use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.fc(x))
