"""What a death is charged with, on real books and no workers: when the dead worker's order
of work is all that is known (a Ray actor: ``blame.blame_in_order``), or a worker process's
shared slot says it ran no unit (``blame.assign_blame``); then ``blame.settle_death``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from easycore import WorkerDied, producer
from easycore._exec.core.blame import Dead, assign_blame, blame_in_order, settle_death
from easycore._exec.core.books import RAISE, SKIP, ErrorPolicy, RunBooks, Work
from easycore._exec.core.plan import plan_chain
from easycore._exec.core.protocol import UNPICKLING
from easycore._exec.core.scheduler import Chunk
from easycore._exec.core.sources import source_of
from easycore._options import Numbering, RunOptions

DEAD = Dead(0, 0, "cpu", "Ray actor 0 of stage 'f'", "it died")


def books(policy: ErrorPolicy, retries: int = 0) -> RunBooks:
    chain = plan_chain(producer(lambda x: x)._as_pipeline(), 1)
    return RunBooks(chain, source_of(range(1000)), RunOptions(retries=retries), policy)


def chunks(*sizes: int) -> list[Work]:
    """Consecutive chunks of these sizes from item 0, oldest first (an actor's queue)."""
    out, start = [], 0
    for n in sizes:
        out.append(Work(start, list(range(start, start + n))))
        start += n
    return out


def test_with_no_retries_a_death_holding_several_chunks_fails_and_names_them_all():
    """Raising with no retries, a death that names no unit may have been in any chunk the
    actor had (the replies of those it finished can die with it): every unit fails, the
    error names every chunk, its index the first unit, and nothing runs again."""
    b = books(RAISE)
    lost = chunks(10, 10, 5)
    blame = blame_in_order(b, 0, lost, None)
    assert blame.charged == tuple(range(25))
    assert blame.later == (lost[1], lost[2])
    assert settle_death(b, DEAD, blame, lost) == []
    with pytest.raises(WorkerDied) as info:
        list(b.deliver())
    assert info.value.index == 0
    assert str(info.value).endswith(
        "while running item 0 .. item 9 or a later chunk it had (item 10 .. item 19, "
        "item 20 .. item 24)"
    )


def test_a_death_while_unpickling_names_every_chunk_too():
    b = books(RAISE)
    lost = chunks(4, 4)
    blame = blame_in_order(b, 0, lost, int(UNPICKLING))
    assert (blame.doing, blame.charged, blame.later) == ("unpickling", tuple(range(8)), (lost[1],))


def test_a_long_queue_is_named_by_its_first_chunks():
    b = books(RAISE)
    lost = chunks(*[2] * 11)
    settle_death(b, DEAD, blame_in_order(b, 0, lost, None), lost)
    with pytest.raises(
        WorkerDied, match=r"\(item 2 \.\. item 3, .*item 16 \.\. item 17 and 2 more\)"
    ):
        list(b.deliver())


@pytest.mark.parametrize(("policy", "retries"), [(RAISE, 1), (SKIP, 0)])
def test_with_retries_or_skip_nothing_is_charged_and_the_oldest_is_split(policy, retries):
    """Units pinned down: the oldest chunk runs again one unit at a time, the others whole,
    and no unit fails (a death of one alone names it later)."""
    b = books(policy, retries)
    lost = chunks(3, 3)
    blame = blame_in_order(b, 0, lost, None)
    assert (blame.charged, blame.later, blame.split) == ((), (), (lost[0],))
    again = settle_death(b, DEAD, blame, lost)
    assert [(w.start, len(w.items)) for w in again] == [(0, 1), (1, 1), (2, 1), (3, 3)]
    assert not b.segments


def test_a_span_names_every_unit_the_way_its_first_is_named():
    """A span of a later pool's batches names batches, and a rank's items (``numbering``) by
    their index in the whole input, first and last alike."""

    def f(x):
        return x

    def g(batch):
        return batch

    chain = plan_chain((producer(f) >> producer(g).on(1, batch_size=2))._as_pipeline(), 1)
    b = RunBooks(chain, source_of(range(100)), RunOptions(), RAISE)
    lost = chunks(4, 4)  # (first-hop units: batches 0..1, then 2..3 of g)
    dead = Dead(1, 0, "cpu", "Ray actor 0 of stage 'g'", "it died")
    settle_death(b, dead, blame_in_order(b, 1, lost, None), lost)
    with pytest.raises(WorkerDied) as info:
        list(b.deliver())
    assert str(info.value).endswith(
        "while running batch 0 (items 0..1) .. batch 1 (items 2..3) of stage 'g' or a later "
        "chunk it had (batch 2 (items 4..5) .. batch 3 (items 6..7) of stage 'g')"
    )
    rank = RunOptions(numbering=Numbering(first=1, step=2))
    b = RunBooks(plan_chain(producer(f)._as_pipeline(), 1), source_of(range(100)), rank, RAISE)
    lost = chunks(3)
    settle_death(b, DEAD, blame_in_order(b, 0, lost, None), lost)
    with pytest.raises(WorkerDied, match=r"while running item 1 \.\. item 5$"):
        list(b.deliver())


class _Slots:
    """A dead worker's shared slot: no unit started, nothing being sent."""

    def started(self, slot: int) -> float:
        return 0.0

    def sending(self, slot: int) -> int:
        return -1


@pytest.mark.parametrize(("policy", "retries"), [(RAISE, 1), (SKIP, 0)])
def test_a_worker_dead_between_units_with_units_pinned_down_splits_its_oldest_chunk(
    policy, retries
):
    """A worker process that died between units (say the kernel's OOM killer): its oldest
    chunk runs again one unit at a time, charged nothing, so that no innocent unit is set
    aside (with ``skip`` and no retries, all of it was)."""
    b = books(policy, retries)
    running = [Chunk(0, [0, 1, 2], id=7), Chunk(3, [3, 4], id=8)]
    w = SimpleNamespace(hop=0, slot=0, timed_out=None)
    blame = assign_blame(b, w, _Slots(), running, running)
    assert (blame.charged, blame.split) == ((), (running[0],))
    again = settle_death(b, DEAD, blame, running, idle_runs=1)
    assert [(x.start, len(x.items)) for x in again] == [(0, 1), (1, 1), (2, 1), (3, 2)]
    assert not b.segments


def test_a_worker_dead_between_units_raising_with_no_retries_fails_its_oldest_chunk():
    b = books(RAISE)
    running = [Chunk(0, [0, 1, 2], id=7), Chunk(3, [3, 4], id=8)]
    w = SimpleNamespace(hop=0, slot=0, timed_out=None)
    blame = assign_blame(b, w, _Slots(), running, running)
    assert (blame.charged, blame.split) == ((0, 1, 2), ())
    again = settle_death(b, DEAD, blame, running, idle_runs=1)
    assert [(x.start, len(x.items)) for x in again] == [(3, 1), (4, 1)]
    with pytest.raises(WorkerDied, match="holding 5 item"):
        list(b.deliver())
