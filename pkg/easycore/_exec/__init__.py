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
pickle (``easycore._exec.process.channel``). Modules, by folder (ARCHITECTURE.md has a line
for each):

    runner.py    Runner (Pipeline.open): lifecycle, one run at a time (submit.Seat), picks
                 the engine; run_map / run_imap (Pipeline.map/imap) on a one-shot Runner
    submit.py    Seat and SubmitFeeder behind Runner.submit
    sharded.py   map(distributed=True): a Runner per rank of a torchrun/Slurm job
    inline.py    the inline engine: every hop in the calling process
    core/        engine-neutral, no I/O: the run's books (books.py: input under the window,
                 re-runs, charges, the error policy, ordering, stats), the scheduler, the plan
                 (a Chain of Hops), sources, chunk sizes, blame after a death, outcomes, the
                 consumer's fold, the prepared stages and the messages every engine shares
    process/     the process engine: ProcessEngine, Run (the transport over the pipes),
                 WorkerSet, startup (fork or forkserver), and the worker's side
                 (worker_loop.py, channel.py, forkserver.py, preload.py, preload_light.py)
    ray/         the Ray engine: RayEngine, RayRun, the driver's Actor records, StageActor;
                 imported only when a run asks for Ray

around any run, on every engine: ``easycore._longjobs`` (resume=, state=, errors="skip",
sinks, checkpoints).

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
