"""Pools that size themselves, the report and the trace (API.md sections 13 and 14), on
worker processes: real workers that come and go in the middle of runs."""

from __future__ import annotations

import json
import os
import time

import pytest

import easycore
from easycore import WorkerDied, WorkerError, producer
from easycore._exec.core import sizing

WHYS = {"busiest pool", "waits for input", "input exhausted", "no gain when it grew"}


@producer
def quick(x):
    time.sleep(0.005)
    return x


@producer
def slow(x):
    time.sleep(0.01)
    return x * 10


@producer
def plus_one(x):
    return x + 1


@pytest.fixture
def churn(monkeypatch):
    """Forced resizes: every 0.1 s each self-sizing pool gets a size drawn at random."""
    import random

    monkeypatch.setattr(sizing, "CHURN", random.Random(7))
    monkeypatch.setattr(sizing, "CHURN_EVERY", 0.1)


class TestBounds:
    def test_a_pair_of_ints_is_a_pool_that_sizes_itself(self):
        pipeline = quick.on((1, 4)) >> slow
        assert "quick.on((1, 4))" in repr(pipeline)

    @pytest.mark.parametrize("bounds", [(0, 2), (3, 2), (-1, 1)])
    def test_bounds_that_are_not_bounds_are_a_value_error(self, bounds):
        with pytest.raises(ValueError, match=r"1 <= lo <= hi"):
            quick.on(bounds)

    def test_bounds_that_cannot_fit_the_budget_fail_before_any_worker_starts(self, tmp_path):
        started = tmp_path / "started"

        def init():
            started.write_text("yes")

        @producer(init=init)
        def marks(x):
            return x

        pipeline = marks.on((2, 4)) >> slow.on((2, 4))
        with pytest.raises(ValueError, match=r"'marks' at least 2, 'slow' at least 2.*cpus=3"):
            pipeline.map(range(4), cpus=3)
        assert not started.exists()

    @pytest.mark.parametrize("cpus", [0, -2, 1.5, "4", True])
    def test_a_bad_cpus_is_refused(self, cpus):
        with pytest.raises(ValueError, match="cpus"):
            quick.on((1, 2)).map(range(2), cpus=cpus)


class TestResizes:
    def test_the_slow_pool_gets_the_workers_and_results_equal_a_fixed_split(self):
        pipeline = quick.on((1, 5)) >> slow.on((1, 5))
        with pipeline.open(cpus=6) as runner:
            out = runner.map(range(400))
            stats = runner.stats()
        assert out == [10 * x for x in range(400)]  # (a fixed split's results)
        resizes = [r for s in stats for r in s.resizes]
        assert resizes, "no pool changed its size"
        assert {r.why for r in resizes} <= WHYS
        assert all(r.before != r.after and r.at >= 0 for r in resizes)
        grew = [r for r in stats[1].resizes if r.why == "busiest pool"]
        assert grew and max(r.after for r in grew) > 3  # the slow pool got more than half

    def test_never_more_workers_than_the_budget(self, churn):
        pipeline = quick.on((1, 3)) >> slow.on((1, 3)) >> plus_one.on(1)
        with pipeline.open(cpus=4) as runner:
            it = runner.imap(range(200))
            most = 0
            for _ in it:
                alive = [w for w in runner._engine.workers.workers if not w.parked and not w.gone]
                most = max(most, len(alive))
            assert most <= 5  # (3 of the budget, 1 fixed, and one still running its end)
            assert any(s.resizes for s in runner.stats())

    def test_forced_resizes_change_nothing_but_speed(self, churn):
        @producer
        def seeded(batch):
            time.sleep(0.01)
            return [(x, easycore.item_seed()) for x in batch]

        pipeline = quick.on((1, 3)) >> seeded.on((1, 3), batch_size=4)
        out = pipeline.map(range(200), seed=3, cpus=4)
        assert out == (quick.on(1) >> seeded.on(2, batch_size=4)).map(range(200), seed=3)

    def test_a_worker_that_leaves_runs_end_and_a_new_one_runs_init(self, churn, tmp_path):
        def init(worker):
            (tmp_path / f"init-{os.getpid()}").write_text(str(worker))

        def end():
            (tmp_path / f"end-{os.getpid()}").write_text("")

        @producer(init=init, end=end)
        def tracked(x):
            time.sleep(0.01)
            return x

        out = (tracked.on((1, 3)) >> slow.on((1, 3))).map(range(200), cpus=4)
        assert out == [10 * x for x in range(200)]
        inits = {p.name.split("-")[1] for p in tmp_path.glob("init-*")}
        ends = {p.name.split("-")[1] for p in tmp_path.glob("end-*")}
        assert len(inits) > 2  # workers came and went (it started with 2)
        assert inits == ends  # every one that started ended

    def test_a_death_during_resizes_loses_nothing(self, churn, tmp_path):
        @producer
        def dies_once(x):
            flag = tmp_path / "died"
            if x == 77 and not flag.exists():
                flag.write_text("")
                os._exit(3)
            time.sleep(0.005)
            return x

        out = (dies_once.on((1, 3)) >> slow.on((1, 3))).map(range(200), retries=1, cpus=4)
        assert out == [10 * x for x in range(200)]

    def test_a_death_without_retries_is_reported(self, churn):
        @producer
        def dies(x):
            if x == 40:
                os._exit(3)
            return x

        with pytest.raises(WorkerDied):
            (dies.on((1, 3)) >> slow.on((1, 3))).map(range(200), cpus=4)

    def test_skip_under_resizes_sets_aside_exactly_the_failures(self, churn):
        @producer
        def picky(x):
            if x % 50 == 7:
                raise ValueError(x)
            time.sleep(0.005)
            return x

        failures = []
        out = (picky.on((1, 3)) >> slow.on((1, 3))).map(
            range(200), errors="skip", on_error=failures.append, cpus=4
        )
        assert out == [10 * x for x in range(200) if x % 50 != 7]
        assert sorted(f.item for f in failures) == [x for x in range(200) if x % 50 == 7]

    def test_recycling_under_resizes(self, churn):
        out = (quick.on((1, 3)) >> slow.on((1, 3))).map(range(200), max_items_per_worker=40, cpus=4)
        assert out == [10 * x for x in range(200)]

    def test_a_resumed_imap_equals_the_uninterrupted_run(self, churn):
        pipeline = quick.on((1, 3)) >> slow.on((1, 3))
        it = pipeline.imap(range(200), seed=1, cpus=4)
        first = [next(it) for _ in range(70)]
        state = it.state_dict()
        it.close()
        rest = list(pipeline.imap(range(200), seed=1, cpus=4, state=state))
        assert first + rest == [10 * x for x in range(200)]


class TestReport:
    def test_the_report_names_the_pool_made_slow(self):
        pipeline = quick.on(2) >> slow.on(1)
        with pipeline.open() as runner:
            for _ in runner.imap(range(100)):
                pass
            report = runner.report()
        assert isinstance(report, easycore.Report)
        assert report.limited_by == "slow"
        assert [p.name for p in report.pools] == ["quick", "slow"]
        slow_pool = report.pools[1]
        assert slow_pool.busy > 0.7 and slow_pool.workers == 1
        assert report.pools[0].waits_next > 0.3  # quick's results waited for slow
        assert report.caller_wait is not None and report.caller_wait > 0.5
        text = str(report)
        assert "limited by 'slow' (1 worker, busy" in text
        assert "'quick' (2 workers) waited for 'slow'" in text
        assert "Your loop waited for data" in text

    def test_a_slow_loop_is_named(self):
        with plus_one.open(2) as runner:
            for _ in runner.imap(range(60)):
                time.sleep(0.01)
            report = runner.report()
        assert report.limited_by == "your loop"
        assert report.caller_wait < 0.2
        assert "limited by your loop" in str(report)

    def test_a_one_shot_imap_has_its_report(self):
        it = (quick.on(1) >> slow.on((1, 2))).imap(range(50), cpus=3)
        assert list(it) == [10 * x for x in range(50)]
        report = it.report()
        assert report.items_per_s > 0 and report.limited_by in ("quick", "slow")

    def test_before_any_run(self):
        with plus_one.open(1) as runner:
            assert str(runner.report()) == "Nothing has run yet."

    def test_map_has_no_caller_wait(self):
        with plus_one.open(1) as runner:
            runner.map(range(10))
            assert runner.report().caller_wait is None


class TestTrace:
    def _load(self, path):
        events = json.loads(path.read_text())["traceEvents"]
        spans = [e for e in events if e["ph"] == "X"]
        return events, spans

    def test_spans_of_every_pool_counters_and_resizes(self, tmp_path, churn):
        path = tmp_path / "run.json"
        out = (quick.on((1, 3)) >> slow.on((1, 3))).map(range(200), cpus=4, trace=path)
        assert out == [10 * x for x in range(200)]
        events, spans = self._load(path)
        assert {e["pid"] for e in spans} == {1, 2}
        assert all(e["dur"] >= 0 and isinstance(e["tid"], int) for e in spans)
        names = {e["args"]["name"] for e in events if e["ph"] == "M"}
        assert names == {"pool 0: quick", "pool 1: slow"}
        assert {e["name"] for e in events if e["ph"] == "C"} == {"workers", "items waiting"}
        resizes = [e for e in events if e["ph"] == "i"]
        assert resizes and all(e["args"]["why"] in WHYS for e in resizes)

    def test_written_when_the_run_fails(self, tmp_path):
        @producer
        def fails(x):
            if x == 30:
                raise ValueError("no")
            return x

        path = tmp_path / "failed.json"
        with pytest.raises(WorkerError):
            fails.map(range(100), devices=2, trace=path)
        _, spans = self._load(path)
        assert spans

    def test_an_open_runner_writes_every_run(self, tmp_path):
        path = tmp_path / "runs.json"
        with plus_one.open(1, trace=path) as runner:
            runner.map(range(5))
            first = len(self._load(path)[1])
            runner.map(range(5))
            assert len(self._load(path)[1]) > first

    def test_a_bad_trace_is_refused(self):
        with pytest.raises(TypeError, match="trace must be a path"):
            plus_one.map(range(2), devices=1, trace=3)

    def test_bounded(self, tmp_path, monkeypatch):
        from easycore._exec.core import report

        monkeypatch.setattr(report, "MAX_EVENTS", 200)
        path = tmp_path / "bounded.json"
        plus_one.map(range(20000), devices=2, trace=path)
        events, _ = self._load(path)
        assert 0 < len(events) <= 200


class TestInline:
    def test_sizes_do_not_apply_inline(self):
        out = (quick.on((1, 4)) >> slow.on((1, 4))).map(range(10), devices="inline")
        assert out == [10 * x for x in range(10)]


def test_a_self_sizing_pools_progress_bar_shows_its_workers(capsys, churn):
    (quick.on((1, 3)) >> slow.on((1, 3))).map(range(120), cpus=4, progress=True)
    err = capsys.readouterr().err
    assert "quick (2 workers)" in err  # its first size, then each resize
    assert any(f"slow ({k} workers)" in err for k in (1, 3))


def test_a_second_run_on_an_open_runner_starts_from_the_first_split():
    pipeline = quick.on((1, 3)) >> slow.on((1, 3))
    with pipeline.open(cpus=4) as runner:
        runner.map(range(60))  # (its end: each pool, its input exhausted, shrinks to 1)
        assert runner.map(range(60)) == [10 * x for x in range(60)]
        first = [s.resizes[0] for s in runner.stats()]
    assert [(r.before, r.after, r.why) for r in first] == [(1, 2, "a new run starts")] * 2
    assert all(r.at == 0.0 for r in first)


def test_the_default_budget_is_this_machines_cores(monkeypatch):
    from easycore._exec.core import plan

    monkeypatch.setattr(plan, "cpu_count", lambda: 3)
    with pytest.raises(ValueError, match=r"need 4 CPU workers at least .*cpus=3 leaves 3"):
        (quick.on((2, 4)) >> slow.on((2, 4))).map(range(4))


def test_timeouts_under_resizes(churn):
    @producer
    def stuck_once(x):
        time.sleep(3 if x == 30 else 0.005)
        return x

    failures = []
    out = (stuck_once.on((1, 3)) >> slow.on((1, 3))).map(
        range(120), timeout=0.5, errors="skip", on_error=failures.append, cpus=4
    )
    assert out == [10 * x for x in range(120) if x != 30]
    assert [(f.item, type(f.error).__name__) for f in failures] == [(30, "ItemTimeout")]


def test_a_trace_is_written_when_the_caller_is_interrupted(tmp_path):
    path = tmp_path / "cut.json"
    with pytest.raises(KeyboardInterrupt), (quick.on(1) >> slow.on(1)).open(trace=path) as runner:
        for k, _ in enumerate(runner.imap(range(200))):
            if k == 20:
                raise KeyboardInterrupt
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["pid"] for e in events if e["ph"] == "X"} == {1, 2}


def test_the_report_during_a_run():
    with (quick.on(1) >> slow.on(1)).open() as runner:
        for k, _ in enumerate(runner.imap(range(100))):
            if k == 50:
                report = runner.report()
                assert report.limited_by == "slow" and report.items_per_s > 0
