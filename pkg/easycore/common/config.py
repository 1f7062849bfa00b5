"""easycore 0.4's ``CfgNode``: the same config tree, mutable until ``freeze()``.

Replacement: :class:`easycore.CfgNode`, which is frozen by default; build a mutable one with
``CfgNode(d, frozen=False)`` or change a frozen one inside ``with cfg.unfrozen():``.

Everything but the default is inherited: ``open``, ``load``, ``dump``, ``save``, ``merge``,
``copy``, ``freeze`` and ``is_frozen`` are :class:`easycore.CfgNode`'s. Loading stays safe
(0.4 could build Python objects from YAML tags; this refuses them), and an unquoted
``(224, 224)`` still loads as a tuple. Nodes built inside the tree (nested dicts, loaded YAML,
copies) are of this class too, so they are mutable as well.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import easycore

__all__ = ["CfgNode"]


class CfgNode(easycore.CfgNode):
    """:class:`easycore.CfgNode` with 0.4's default: mutable until :meth:`freeze`.

    Args:
        init_dict: a possibly nested mapping; nested dicts become ``CfgNode`` s.
        copy: deep-copy the values of ``init_dict`` (``False`` shares them).
        frozen: whether the new tree refuses changes (0.4 had no such argument).

    >>> cfg = CfgNode()
    >>> cfg.SOLVER = CfgNode()
    >>> cfg.SOLVER.LEARNING_RATE = 0.001
    >>> cfg.freeze()
    >>> cfg.is_frozen(), isinstance(cfg, easycore.CfgNode)
    (True, True)
    """

    __slots__ = ()

    def __init__(
        self,
        init_dict: Mapping[str, Any] | None = None,
        copy: bool = True,
        frozen: bool = False,
    ) -> None:
        super().__init__(init_dict, copy=copy, frozen=frozen)
