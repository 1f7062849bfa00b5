"""The scheduler on its own (no processes, no Ray): which place takes which chunk, the
window, room under ``prefetch`` and ``max_items_per_worker``, routing between pools, and
what a death at every state leaves to run again. Places are plain ``Place`` records; a test
plays the transport: it carries out the commands and reports what came back."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from easycore import producer
from easycore._exec.core.books import RAISE, RunBooks, Work
from easycore._exec.core.plan import plan_chain
from easycore._exec.core.scheduler import Forward, Place, Revive, Scheduler, Send
from easycore._exec.core.sources import source_of
from easycore._options import RunOptions


def make(
    sizes: tuple[int, ...] = (2,),
    n_items: int = 1000,
    pipelined: bool = False,
    concurrency: int = 1,
    **options: Any,
) -> tuple[Scheduler, list[list[Place]]]:
    """A scheduler over pools of ``sizes`` places (one pool: the run's devices)."""
    if len(sizes) == 1:
        pipe: Any = producer(lambda x: x)
        chain = plan_chain(pipe._as_pipeline(), sizes[0], concurrency=concurrency)
    else:
        stages = [producer(lambda x: x).on(n) for n in sizes]
        pipe = stages[0]
        for s in stages[1:]:
            pipe = pipe >> s
        chain = plan_chain(pipe, "auto")
    books = RunBooks(chain, source_of(range(n_items)), RunOptions(**options), RAISE)
    books.chunk_size = 10  # (as if measured: chunks of 10 items)
    books.least = 1
    pools = [
        [Place(hop=h, index=i, concurrency=hop.concurrency, unit=hop.unit) for i in range(n)]
        for h, (hop, n) in enumerate(zip(chain.hops, sizes, strict=True))
    ]
    return Scheduler(books, lambda h: pools[h], itertools.count(), pipelined), pools


def sends(sched: Scheduler, most: int | None = None) -> list[Any]:
    return list(sched.sends(most))


# -- sending ---------------------------------------------------------------------------------
def test_consecutive_chunks_go_to_different_places():
    sched, [pool] = make((3,))
    out = sends(sched, 3)
    assert [s.chunk.path for s in out] == [[pool[0]], [pool[1]], [pool[2]]]
    assert [s.chunk.start for s in out] == [0, 10, 20]


def test_a_place_takes_prefetch_chunks_at_most():
    sched, [pool] = make((2,), prefetch=3)
    out = sends(sched)
    assert len(out) == 6
    assert all(len(p.queue) == 3 for p in pool)
    assert sends(sched) == []


def test_most_bounds_the_chunks_sent():
    sched, _ = make((2,))
    assert len(sends(sched, 1)) == 1


def test_the_window_bounds_input_taken_and_not_yielded():
    sched, _ = make((2,), prefetch=2)
    sends(sched)
    assert sched.books.taken <= sched.window()
    assert sched.window() == 3 * 2 * 10  # (prefetch + 1) chunks a place


def test_input_runs_out():
    sched, _ = make((2,), n_items=15, prefetch=8)
    out = sends(sched)
    assert sum(len(s.chunk.items) for s in out) == 15
    assert sched.books.source.exhausted


def test_each_chunk_is_tracked_at_its_place_under_a_new_id():
    sched, [pool] = make((2,))
    a, b = (s.chunk for s in sends(sched, 2))
    assert a.id != b.id
    assert sched.live == {a.id: a, b.id: b}
    assert pool[0].queue == {a.id: a}


def test_re_runs_go_out_before_new_input():
    sched, _ = make((2,))
    sched.books.again([Work(500, [500, 501])])
    first = sends(sched, 1)[0].chunk
    assert (first.start, list(first.items)) == (500, [500, 501])


def test_a_re_run_is_cut_to_what_a_place_may_still_run():
    """A re-run too does not take a place past max_items_per_worker: it is cut, the rest
    runs next (take used to hand re-runs out whatever the bound)."""
    sched, [_pool] = make((1,), max_items_per_worker=4)
    sched.books.again([Work(0, list(range(6)))])
    first = sends(sched, 1)[0].chunk
    assert list(first.items) == [0, 1, 2, 3]
    assert [list(w.items) for w in sched.books.redo] == [[4, 5]]


def test_new_input_is_cut_to_what_a_place_may_still_run():
    sched, [_pool] = make((1,), max_items_per_worker=7)
    chunk = sends(sched, 1)[0].chunk
    assert len(chunk.items) == 7
    assert sends(sched) == []  # it may run nothing more


def test_a_place_that_ran_its_share_retires_once_it_holds_nothing():
    sched, [pool] = make((1,), max_items_per_worker=5)
    chunk = sends(sched)[0].chunk
    assert sched.retirees() == []  # (it still has its chunk)
    assert sched.done(pool[0], chunk.id) is chunk
    sched.count(pool[0], 5)
    sched.finish(chunk)
    assert pool[0].retiring
    assert sched.retirees() == [pool[0]]


def test_a_place_spent_in_an_earlier_run_retires_before_taking_anything():
    sched, [pool] = make((2,), max_items_per_worker=5)
    pool[0].ran = 5
    assert sched.retirees() == [pool[0]]
    assert all(s.chunk.path == [pool[1]] for s in sends(sched))


def test_memory_over_the_bound_retires_a_place():
    sched, [pool] = make((1,), max_worker_memory=100)
    sched.count(pool[0], 1, lambda: 50)
    assert not pool[0].retiring
    sched.count(pool[0], 1, lambda: 150)
    assert pool[0].retiring and pool[0].ran == 2


def test_a_retiring_place_takes_nothing():
    sched, [pool] = make((2,))
    pool[0].retiring = True
    assert {s.chunk.path[0].index for s in sends(sched)} == {1}


def test_a_place_that_waits_counts_units_not_chunks():
    sched, [_pool] = make((1,), concurrency=4, prefetch=2)
    sched.books.chunk_size = 2
    out = sends(sched)
    assert sum(len(s.chunk.items) for s in out) == 2 * 4  # prefetch x k units


def test_a_pool_that_waits_counts_its_slots_in_the_window():
    sched, _ = make((2,), concurrency=64, prefetch=2)
    sched.books.chunk_size = 4
    assert sched.window() == 2 * 2 * 2 * 64 + 2 * 64


def test_several_pools_count_every_place_in_the_window():
    sched, _ = make((2, 3), prefetch=1)
    assert sched.window() == 2 * 5 * 10


# -- what comes back -------------------------------------------------------------------------
def test_a_stale_id_is_dropped():
    sched, [pool] = make((1,))
    assert sched.done(pool[0], 12345) is None


def test_a_reply_from_the_wrong_place_is_dropped():
    sched, [pool] = make((2,))
    chunk = sends(sched, 1)[0].chunk
    assert sched.done(pool[1], chunk.id) is None
    assert chunk.id in sched.live


def test_held_chunks_move_to_the_next_pool_with_room():
    sched, (first, second) = make((1, 2))
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    assert first[0].holding == {chunk.id: chunk}
    fwd = list(sched.forwards())
    assert fwd == [Forward(chunk, first[0], second[0])]
    assert chunk.hop == 1 and chunk.src is first[0] and chunk.place is second[0]
    assert sched.sent(first[0], chunk.id) is chunk
    assert chunk.src is None and not first[0].holding


def test_held_chunks_move_in_input_order_when_ordered():
    sched, (_first, _second) = make((2, 1), prefetch=1)
    a, b = (s.chunk for s in sends(sched, 2))
    for chunk in (b, a):  # b finishes first
        place = chunk.place
        sched.hold(sched.done(place, chunk.id), place)
    assert [f.chunk for f in sched.forwards()] == [a]  # one place of room downstream


def test_a_chunk_that_arrives_before_its_senders_confirmation_clears_it():
    sched, (first, second) = make((1, 1))
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    list(sched.forwards())
    assert sched.done(second[0], chunk.id) is chunk
    assert not first[0].holding and chunk.src is None


def test_a_forward_that_failed_is_held_again():
    sched, (first, second) = make((1, 1))
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    fwd = next(sched.forwards())
    sched.unforward(fwd)
    assert chunk.place is first[0] and chunk.hop == 0 and not second[0].queue
    assert sched.waiting[0] == [chunk]


def test_a_held_chunk_goes_to_a_place_that_may_run_it_whole():
    sched, (first, second) = make((1, 2), max_items_per_worker=12)
    second[0].ran = 8  # may run 4 more
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    assert next(sched.forwards()).dst is second[1]


def test_a_held_chunk_goes_to_an_empty_place_that_may_run_some_of_it():
    sched, (first, second) = make((1, 1), max_items_per_worker=12)
    second[0].ran = 8
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    assert next(sched.forwards()).dst is second[0]  # never cut: it runs a little past


# -- deaths ----------------------------------------------------------------------------------
def test_a_death_takes_what_the_place_ran_oldest_first():
    sched, [pool] = make((1,), prefetch=3)
    chunks = [s.chunk for s in sends(sched)]
    running, lost = sched.died(pool[0])
    assert running == lost == chunks
    assert not sched.live and not pool[0].queue and pool[0].gone
    assert sends(sched) == []  # (a dead place takes nothing until replaced)


def test_a_death_takes_what_the_place_held():
    sched, (first, second) = make((1, 1), prefetch=1)
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    second[0].retiring = True  # (no room: it stays held)
    assert list(sched.forwards()) == []
    running, lost = sched.died(first[0])
    assert (running, lost) == ([], [chunk])
    assert sched.waiting[0] == [] and not sched.live


def test_a_death_while_sending_takes_the_chunk_from_its_receiver_too():
    sched, (first, second) = make((1, 1))
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    list(sched.forwards())
    _, lost = sched.died(first[0])
    assert lost == [chunk] and not second[0].queue
    assert sched.done(second[0], chunk.id) is None  # its late answer is dropped


def test_a_receivers_death_takes_a_chunk_still_being_sent():
    sched, (first, second) = make((1, 1))
    chunk = sends(sched, 1)[0].chunk
    sched.hold(sched.done(first[0], chunk.id), first[0])
    list(sched.forwards())
    running, _ = sched.died(second[0])
    assert running == [chunk] and not first[0].holding
    assert sched.sent(first[0], chunk.id) is None


def test_an_early_stop_forgets_held_chunks_and_answers():
    sched, (_first, second) = make((2, 1), prefetch=1)
    a, b = (s.chunk for s in sends(sched, 2))
    sched.hold(sched.done(a.place, a.id), a.place)
    second[0].retiring = True
    assert sched.drop_held() == [a]
    sched.withdraw(b.place, b.id)
    assert not sched


def test_the_oldest_chunk_at_a_place():
    sched, [pool] = make((1,), prefetch=2)
    a, _ = (s.chunk for s in sends(sched))
    assert sched.oldest_at(pool[0]) is a


def test_units_queued_and_held_per_pool():
    sched, (first, second) = make((1, 1), prefetch=2)
    a, _b = (s.chunk for s in sends(sched))
    sched.hold(sched.done(first[0], a.id), first[0])
    second[0].retiring = True
    assert sched.units() == ([10, 0], [10, 0])


def test_clearing_a_run_leaves_other_runs_chunks_alone():
    sched, [pool] = make((1,), prefetch=2)
    mine = sends(sched, 1)[0].chunk
    other = Scheduler(sched.books, lambda h: [pool[0]], itertools.count(100))
    theirs = other._track(Work(50, [50]), [pool[0]])
    sched.clear()
    assert mine.id not in pool[0].queue and pool[0].queue == {theirs.id: theirs}


# -- pipelined (Ray's way: a chunk at a place of every pool at once) --------------------------
def test_pipelined_a_chunk_goes_to_a_place_of_every_pool():
    sched, (first, second) = make((1, 2), pipelined=True)
    chunk = sends(sched, 1)[0].chunk
    assert chunk.path == [first[0], second[0]]
    assert chunk.id in first[0].queue and chunk.id in second[0].queue


def test_pipelined_places_have_no_prefetch_bound_of_their_own():
    sched, (_pool,) = make((1,), pipelined=True, prefetch=1)
    out = sends(sched)
    assert len(out) == 2  # (prefetch + 1) chunks of 10 for one place: the window
    assert sched.window() == 20


def test_pipelined_the_window_is_the_widest_pools():
    sched, _ = make((1, 3), pipelined=True, prefetch=1)
    assert sched.window() == 2 * 3 * 10


def test_pipelined_re_runs_wait_for_chunks_in_flight_to_drop():
    sched, _ = make((1,), pipelined=True, prefetch=1)
    sends(sched)
    sched.books.again([Work(900, [900])])
    assert sends(sched) == []  # (prefetch + 1) chunks a place out already


def test_pipelined_a_dead_place_is_revived_when_its_pool_has_no_other():
    sched, (first, second) = make((1, 1), pipelined=True)
    second[0].gone = True
    gen = sched.sends(1)
    assert next(gen) == Revive(second[0])
    second[0] = Place(hop=1, index=0)  # (the engine's fresh place)
    send = next(gen)
    assert isinstance(send, Send) and send.chunk.path == [first[0], second[0]]


def test_pipelined_a_solo_chunk_runs_alone():
    sched, [pool] = make((2,), pipelined=True)
    normal = sends(sched, 1)[0].chunk  # at place 0
    sched.books.again([Work(900, [900], solo=True)])
    solo = sends(sched, 1)[0].chunk
    assert solo.path == [pool[1]]  # the idle one
    assert [s.chunk.path for s in sends(sched, 1)] == [[pool[0]]]  # nothing joins it
    assert normal.path == [pool[0]]


def test_a_slot_of_tasks_holds_one_chunk_at_a_time():
    sched, [pool] = make((1,), pipelined=True)
    pool[0].lone = True
    assert len(sends(sched)) == 1


@pytest.mark.parametrize("pipelined", [False, True])
def test_nothing_is_lost_or_doubled_through_deaths(pipelined):
    """Every item is sent, a place dies with what it had, what it had runs again, and
    every item ends up done exactly once."""
    sched, [pool] = make((3,), n_items=200, pipelined=pipelined)
    done: list[int] = []
    rounds = 0
    while (sched or not sched.books.source.exhausted or sched.books.redo) and rounds < 1000:
        rounds += 1
        for cmd in sched.sends():
            if isinstance(cmd, Revive):
                i = pool.index(cmd.place)
                pool[i] = Place(hop=0, index=i)
        for p in list(pool):
            if p.queue and rounds % 7 == 3 and p.index == 1:
                _, lost = sched.died(p)
                sched.books.again(lost)
                if not pipelined:
                    pool[p.index] = Place(hop=0, index=p.index)
                continue
            for chunk in list(p.queue.values())[:1]:
                assert sched.done(p, chunk.id) is chunk
                sched.finish(chunk)
                done += list(chunk.items)
                sched.books.taken -= len(chunk.items)
    assert sorted(done) == list(range(200))
    for p in pool:  # (a place's counts follow its chunks through every change)
        assert p.queue.n_items == sum(len(c.items) for c in p.queue.values())
        assert p.queue.n_solo == sum(c.solo for c in p.queue.values())


def test_a_places_counts_follow_its_chunks():
    sched, (first, second) = make((1, 1), prefetch=2)
    a, _ = (s.chunk for s in sends(sched))
    assert first[0].queue.n_items == 20
    sched.hold(sched.done(first[0], a.id), first[0])
    fwd = next(sched.forwards())
    assert (first[0].queue.n_items, second[0].queue.n_items) == (10, 10)
    sched.unforward(fwd)
    assert second[0].queue.n_items == 0
    sched.died(first[0])
    assert first[0].queue.n_items == 0 and not first[0].queue
    sched.books.again([Work(900, [900, 901], solo=True)])
    second[0].gone = first[0].gone = False
    solo = sends(sched, 1)[0].chunk
    assert solo.place.queue.n_solo == 1 and not sched.has_room(solo.place)
    sched.clear()
    assert (solo.place.queue.n_items, solo.place.queue.n_solo) == (0, 0)


# -- self-sizing pools -----------------------------------------------------------------------
def sized(hi: int = 3, cpus: int = 4) -> tuple[Scheduler, list[list[Place]]]:
    """Two self-sizing pools of (1, hi) places each, their first split placed."""
    from easycore._exec.core.sizing import Balancer

    a, b = producer(lambda x: x).on((1, hi)), producer(lambda x: x).on((1, hi))
    chain = plan_chain(a >> b, "auto", cpus=cpus)
    books = RunBooks(chain, source_of(range(1000)), RunOptions(), RAISE)
    books.chunk_size, books.least = 10, 1
    pools = [[Place(hop=h.index, index=i) for i in range(h.size)] for h in chain.hops]
    sched = Scheduler(books, lambda h: pools[h], itertools.count(), False, Balancer(chain))
    return sched, pools


def test_a_place_that_leaves_its_pool_waits_until_its_results_are_sent_on():
    sched, (first, _second) = sized()
    chunk = sends(sched, 1)[0].chunk
    holder = chunk.place
    sched.hold(sched.done(holder, chunk.id), holder)
    sched.balancer.target[0] = 1  # the first pool shrinks to one place
    sched.sampled = 0.0
    assert sched.tick() == []
    leaving = [p for p in first if p.parking]
    assert leaving and all(p.retiring for p in leaving)
    assert holder not in sched.retirees()  # (its results still wait for the next pool)
    fwd = list(sched.forwards())
    assert fwd and fwd[0].src is holder
    sched.sent(holder, chunk.id)
    assert set(sched.retirees()) >= set(leaving)


def test_idle_places_leave_first_and_a_pool_that_grows_is_told_so():
    sched, (first, _second) = sized(hi=3, cpus=4)
    busy = sends(sched, 1)[0].chunk.place
    sched.balancer.target = [1, 3]
    sched.sampled = 0.0
    grow = sched.tick()
    assert [p.parking for p in first] == [p is not busy for p in first]
    assert grow == []  # (the leaving place still counts against the budget)
    first.remove(next(p for p in first if p.parking))  # it has left
    sched.sampled = 0.0
    assert sched.tick() == [1]


def test_a_joining_place_takes_nothing_until_it_is_ready():
    sched, (first, _second) = sized()
    for p in first:
        p.joining = True
    assert sends(sched) == []
    first[0].joining = False
    assert sends(sched, 1)[0].chunk.place is first[0]
