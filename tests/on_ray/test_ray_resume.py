"""Training that resumes on engine="ray" (API.md sections 7 and 12): an imap stopped at a
random point and resumed from its state equals the uninterrupted stream, with ``.on`` pools
and batching; a few examples (each run starts actors)."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from easycore import producer

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("local_ray")]

N = 60


@producer
def noisy(x):
    if x % 7 == 3:
        raise ValueError(f"poison {x}")
    return (x, random.random())


@producer
def batch_draw(batch):
    return (tuple(x for x, _ in batch), random.random())


def test_pools_with_batching_resume_anywhere_on_ray():
    pipeline = noisy.on(1) >> batch_draw.on(1, batch_size=3)
    with pipeline.open(engine="ray") as runner:

        @settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
        @given(stop=st.integers(0, N // 3), ordered=st.booleans())
        def check(stop, ordered):
            kw = {"seed": 9, "epoch": 2, "ordered": ordered, "errors": "skip"}
            kw["on_error"] = lambda f: None
            full = list(runner.imap(range(N), **kw))
            it = runner.imap(range(N), **kw)
            first = [next(it) for _ in range(min(stop, len(full)))]
            state = json.loads(json.dumps(it.state_dict()))
            it.close()
            rest = list(runner.imap(range(N), state=state, **kw))
            if ordered:
                assert first + rest == full
            else:
                assert sorted(first + rest) == sorted(full)
                assert len(first + rest) == len(full)

        check()
        # output units received beyond the position (an unordered run's state) are neither
        # delivered again nor lost
        kw = {"seed": 9, "epoch": 2, "errors": "skip", "on_error": lambda f: None}
        full = list(runner.imap(range(N), **kw))
        it = runner.imap(range(N), **kw)
        next(it)
        state = it.state_dict()
        it.close()
        assert state["position"] == 3
        state["received"] = [9, 18, 21]
        rest = list(runner.imap(range(N), state=state, **kw))
        assert rest == [r for r in full[1:] if r[0][0] not in (9, 18, 21)]
        # the same results as the local engine's inline run (seeds included)
        inline = (noisy >> batch_draw.on(1, batch_size=3)).open(devices="inline")
        with inline:
            kw = {"seed": 9, "epoch": 2, "errors": "skip", "on_error": lambda f: None}
            assert list(inline.imap(range(N), **kw)) == list(runner.imap(range(N), **kw))
