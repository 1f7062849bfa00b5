"""A run's stream (``RunBooks.stream``) and its books belong to that run alone."""

from __future__ import annotations

from easycore import producer
from easycore._config.cfgnode import CfgNode
from easycore._exec.core.books import PRIMED
from easycore._exec.core.outcomes import Segment
from easycore._exec.core.plan import plan_chain
from easycore._exec.inline import InlineEngine
from easycore._options import RunOptions


def test_closing_a_run_leaves_a_later_runs_results_whole():
    """Inline, ``submit`` runs one stream per item, and an earlier item's stream may be
    closed (dropped) after the next one started: its cleanup must not touch the newer run's
    books (it once emptied them, and the newer run's results were lost)."""
    chain = plan_chain(producer(lambda x: x * 10)._as_pipeline(), "inline")
    engine = InlineEngine(chain, CfgNode())
    engine.start()
    try:
        first = engine.stream([1, 2], RunOptions())
        assert next(first) is PRIMED
        assert next(first) == Segment(0, [10])
        second = engine.stream([3, 4], RunOptions())
        assert next(second) is PRIMED
        first.close()
        assert list(second) == [Segment(0, [30]), Segment(1, [40])]
        assert [s.done for s in engine.stats()] == [2]
    finally:
        engine.stop(None, report=True)
