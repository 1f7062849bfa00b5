"""easycore 0.4's ``easycore.torch.parallel`` runners: the same classes as ``common.parallel``.

Replacement: ``@producer``/``@consumer`` and ``Pipeline.open``. In 0.4 this module differed from
:mod:`easycore.common.parallel` only in using ``torch.multiprocessing``; here both run on the one
executor, which binds each worker to its device (``"cpu"``, ``"cuda:0"``...) and moves tensors
through shared memory or CUDA IPC, so ``easycore.torch.parallel.OrderedRunner`` is
``easycore.common.parallel.OrderedRunner``.
"""

from __future__ import annotations

from easycore._compat import BaseRunner, OrderedRunner, UnorderedRunner

__all__ = ["BaseRunner", "OrderedRunner", "UnorderedRunner"]
