"""easycore 0.4's ``easycore.torch`` path; see :mod:`easycore.torch.parallel`.

Replacement: the functional API in :mod:`easycore`, which runs CPU and CUDA devices alike.
Importing this package does not import torch.
"""

from __future__ import annotations

__all__: list[str] = []
