"""The caller's side of execution: how ``Pipeline.map``/``imap``/``open`` run.

Data flow (the caller's own thread runs the loop; ``Runner.submit`` runs the same loop in one
background thread). A pipeline is a chain of hops (pools); one pool is a chain of one hop::

    caller process                                      worker process (one per device per hop)
    --------------------------------------------------  -------------------------------------
    data ─lazy─> Source ─> Run.dispatch ─ Task (chunk) ─> pipe ─> reader thread ─> main thread:
      ^ backpressure: at most sched.window() items       (duplex   (EOF: caller gone   prepared
      │ taken and not yet yielded                         Unix      -> os._exit, no    stages run
      │                                                   socket)   orphans)           each unit
      │                                                                               │ slot k =
      │                                                                               │ (index,
      │                                                                               │  start)
    yield / consumer fold <── books.deliver <── Done (one per chunk, last hop) ───────┘
                              (ordered: segments keyed by start index)

    with several hops, a chunk finished by hop h stays in its worker (Held) until a worker
    of hop h+1 has room; the caller then tells the holder to send it there (Forward, with a
    new socket pair's end when the two were never paired) and the holder confirms (Sent):

    caller ──Task──> hop 0 worker i ─Held─> caller ─Forward─> hop 0 worker i: outlet thread
                                                                 └──Task──> hop 1 worker j
                                                                              └─Done─> caller
      (release notes for i's shared-memory segments go back over the pair)

    WorkerSet.wait_and_handle: one poll over [pipe 1..n, process sentinel 1..n, (submit)]:
       pipe ready      -> read every message (Done, Held, Sent, Unreadable, ...)
       sentinel ready  -> gone: its pipe is drained first (results sent before the death count
                          and are never re-run), then Run.on_death re-queues what it ran, held
                          or was sending (retries) or raises WorkerDied naming the unit in its
                          slot; it is respawned
       timeout         -> a unit passed `timeout` (its start time is in its slot): the worker
                          is killed, then as above, raising ItemTimeout when retries are spent

Big tensors/arrays travel in shared-memory segments in both directions, only their ids in the
pickle (``easycore._transport``). Modules, in the order data meets them:

    runner.py    Runner: lifecycle, one run at a time (submit.Seat), map/imap/submit
    plan.py      the pipeline cut into a Chain of Hops; StageStats
    core.py      the run's books, engine-neutral: input under the window, re-runs, retry
                 charges, the error policy, ordering, chunk sizes, stats; Segment, Failed
    engine.py    ProcessEngine (worker processes) beside inline.py's InlineEngine
    ray_engine.py  RayEngine (engine="ray"): each hop a group of Ray actors (ray_actor.py),
                 runs in ray_run.py; imported only when a run asks for Ray
    startup.py   forkservers and the process-global state, in one module that says so
    workers.py   WorkerSet: spawn, respawn, pair across hops, wait on pipes + sentinels, stop
    sources.py   where items come from (iterable, range, submitted one at a time)
    sizing.py    adaptive chunk sizes, per hop
    scheduler.py where every chunk is (queued / held / moving) and goes, for every engine
                 with workers: window, room, routing, deaths (no I/O)
    run.py       Run: the process transport, the loop of named steps over the chain
    blame.py     after a death: the unit to charge, the error naming it, what re-runs
    fold.py      the consumer, in the calling process
    policy.py    errors="skip": failed units set aside and reported
    resume.py    resume=: the run ledger in SQLite (finished units sent as CACHED markers),
                 which knows what run it belongs to (RunIdentity)
    digest.py    digests equal in every process: of items, functions and cfg (for resume.py)
    position.py  imap's state_dict()/state=: what the caller received, a stream that starts
                 there (sequences by index; units received beyond it sent as CACHED markers)
    submit.py    Seat and SubmitFeeder behind Runner.submit
    sharded.py   map(distributed=True): a Runner per rank of a torchrun/Slurm job

Why this shape:

* Routing from the caller rather than from worker to worker: one process sees every queue's
  depth and every death, so exactly-once delivery and backpressure need no distributed
  protocol, while the bytes (the expensive part) never pass through it.
* Per-worker pipes (as torch's DataLoader keeps per-worker index queues) tell us exactly which
  items each worker holds, so a dead worker's items can be re-run and nothing is lost or
  doubled: a chunk's results arrive in one message, and a chunk is forgotten only when its
  reply has been read.
* Waiting on process sentinels (as loky does) sees a death the moment it happens, not on a
  polling timer. No ``multiprocessing.Queue``: its feeder thread turns pickling errors into
  silent hangs; here the caller pickles synchronously and can name the item.
* Workers start from a forkserver that has already imported torch and easycore (Linux
  default): the first pool pays the import once, later pools and respawns fork in
  milliseconds, and no worker is forked from a caller that may hold threads or CUDA state.
  A caller that never imported torch gets a second, light forkserver (see
  ``startup.light_wanted``).
* Chunks grow adaptively (target ~50 ms of work or ~1 MiB per message) so tiny items do not
  drown in per-message overhead; the window scales with the chunk size and bounds memory:
  at most ``n_workers * (prefetch + 1) * chunk`` items are in flight, and with ``ordered=True``
  the reorder buffer holds at most that many results (a slow item stalls the stream instead
  of growing memory).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from easycore._exec.plan import PipelineDef, StageStats
from easycore._exec.position import check_state
from easycore._exec.resume import RunIdentity, check_ledger
from easycore._exec.runner import OwnedResults, Runner
from easycore._options import RunOptions

__all__ = ["Runner", "StageStats", "run_imap", "run_map"]


def run_map(
    pipeline: PipelineDef,
    data: Iterable[Any],
    options: RunOptions,
    distributed: bool = False,
    **where: Any,
) -> Any:
    """``Pipeline.map``: fresh workers for one run, closed after it (``where``: the keyword
    arguments of :class:`Runner` that say where: ``devices``, ``cfg``, ``start_method``,
    ``engine``, ``concurrency``)."""
    if distributed:
        from easycore._exec.sharded import sharded_map  # imports torch.distributed helpers

        return sharded_map(pipeline, data, options, **where)
    with _one_shot(pipeline, options, where) as runner:
        return runner.run_map(data, options)


def run_imap(
    pipeline: PipelineDef, data: Iterable[Any], options: RunOptions, **where: Any
) -> Iterator[Any]:
    """``Pipeline.imap``: workers start, and work with them, now; they stop when the results
    are exhausted, closed or dropped."""
    runner = _one_shot(pipeline, options, where)
    try:
        results = runner.run_imap(data, options)
    except BaseException as exc:
        runner.__exit__(type(exc), exc, exc.__traceback__)
        raise
    return OwnedResults(runner, results)


def _one_shot(pipeline: PipelineDef, options: RunOptions, where: dict[str, Any]) -> Runner:
    """The runner of one ``map``/``imap`` call: a ``resume`` path that is no ledger, or
    another run's, is refused before any worker starts; work goes to each worker as soon as
    it is ready (init errors surface in the run)."""
    check_state(options, getattr(pipeline, "sink", None))
    if options.resume is not None:
        check_ledger(options.resume, RunIdentity.of(pipeline, where["cfg"], options))
    return Runner(pipeline, **where, _wait=False, _tasks=_stateless(options))


def _stateless(options: RunOptions) -> bool:
    """Whether a one-shot run keeps nothing per worker between chunks (no ``timeout`` clock,
    no recycling): on Ray its init-less pools then run as plain tasks, not actors."""
    return (
        options.timeout is None
        and options.max_items_per_worker is None
        and options.max_worker_memory is None
    )
