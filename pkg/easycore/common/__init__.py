"""easycore 0.4's ``easycore.common`` paths, kept so 0.4 code imports unchanged.

==============================  ==========================================================
0.4 path                        replacement
==============================  ==========================================================
``common.config.CfgNode``       :class:`easycore.CfgNode` (frozen by default)
``common.registry.Registry``    :class:`easycore.Registry`
``common.parallel`` runners     ``@producer``/``@consumer`` and ``Pipeline.open``
==============================  ==========================================================

Import the submodule you need (``from easycore.common.config import CfgNode``); this package
imports nothing itself, so ``import easycore.common`` stays light.
"""

from __future__ import annotations

__all__: list[str] = []
