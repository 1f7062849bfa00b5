"""easycore 0.4's runner classes: ``BaseRunner``, ``UnorderedRunner``, ``OrderedRunner``.

Replacement: ``@producer(init=..., end=...)`` and ``@consumer(init=..., end=...)`` composed
with ``>>`` and run with ``Pipeline.map`` or ``Pipeline.open`` (see the guide page
"Coming from easycore 0.4", ``docs/guide/from-0.4.md``). These classes are adapters onto
that executor, defined once in ``easycore._compat`` and shared with
:mod:`easycore.torch.parallel`.
"""

from __future__ import annotations

from easycore._compat import BaseRunner, OrderedRunner, UnorderedRunner

__all__ = ["BaseRunner", "OrderedRunner", "UnorderedRunner"]
