"""Leaving a one-shot ``Pipeline.imap`` early (``break``, ``return``, ``close()``, dropping
it): the loop goes on at once, whatever items are still running; workers between items run
their ``end``; and Ctrl-C while the workers are being stopped still reaches the caller."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from easycore import WorkerError, producer

pytestmark = pytest.mark.timeout(120)


@producer
def one_slow(x):
    if x == 4:
        time.sleep(300)  # (an item that would hold a drain for five minutes)
    return x


def first_two(it):
    for i, y in enumerate(it):
        if i == 1:
            return y  # (the loop is left while item 4 runs; `it` is dropped)
    return None


@pytest.mark.parametrize("how", ["return", "close"])
def test_leaving_does_not_wait_for_the_items_in_flight(how):
    t0 = time.monotonic()
    if how == "return":
        assert first_two(one_slow.imap(range(100), devices=2)) == 1
    else:
        it = one_slow.imap(range(100), devices=2)
        assert [next(it), next(it)] == [0, 1]
        it.close()
    assert time.monotonic() - t0 < 60  # (not the slow item's 300 s: the workers were stopped)


def test_workers_between_items_run_their_end(tmp_path):
    def end(state):
        (tmp_path / f"ended-{state}").touch()

    @producer(init=lambda worker: worker, end=end)
    def quick(x, *, state):
        time.sleep(0.01)
        return state

    it = quick.imap(range(1000), devices=2, ordered=False)
    seen = set()
    while len(seen) < 2:  # (both workers ran items: neither is still in its init)
        seen.add(next(it))
    it.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ended-0", "ended-1"]


SCRIPT = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from easycore import producer

    marker = sys.argv[1]

    def end(state):
        open(marker, "w").close()  # (the workers are being stopped now)
        time.sleep(1.0)

    @producer(end=end)
    def work(x):
        return x

    def first_two():
        for i, y in enumerate(work.imap(range(10_000), devices=1)):
            if i == 1:
                return y

    def press_ctrl_c():
        while not os.path.exists(marker):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=press_ctrl_c, daemon=True).start()
    try:
        first_two()
        time.sleep(2)  # (an interrupt still pending would arrive here)
        print("the program went on")
    except KeyboardInterrupt:
        print("KeyboardInterrupt reached the caller")
    """
)


def test_ctrl_c_while_the_workers_stop_reaches_the_caller(tmp_path):
    script = tmp_path / "leave.py"
    script.write_text(SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ending")],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert "KeyboardInterrupt reached the caller" in out.stdout, out.stdout + out.stderr


@pytest.mark.parametrize("devices", [1, "inline"])
def test_an_imap_read_to_its_end_runs_every_end_and_raises_its_error(tmp_path, devices):
    """Only leaving early stops the workers as after Ctrl-C: read to its end, a one-shot
    imap waits for each end, however long, and raises what an end raised."""

    def slow_end(state):
        time.sleep(2.2)  # (past the abort's grace, 2 s)
        (tmp_path / "ended").touch()

    def failing_end(state):
        raise RuntimeError("end failed")

    @producer(end=slow_end)
    def square(x):
        return x * x

    @producer(end=failing_end)
    def cube(x):
        return x**3

    assert list(square.imap(range(5), devices=devices)) == [0, 1, 4, 9, 16]
    assert (tmp_path / "ended").exists()
    with pytest.raises(WorkerError, match="end failed"):
        list(cube.imap(range(5), devices=devices))
