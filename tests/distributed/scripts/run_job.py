"""One rank of a test job: ``torchrun ... run_job.py OUTDIR`` (or a Slurm-like launch).

Runs every scenario of ``jobs.py`` with ``distributed=True`` and the collectives, and
pickles what this rank saw to ``OUTDIR/rank{R}.pkl``.
"""

from __future__ import annotations

import os
import pickle
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import jobs

from easycore import distributed


def main(outdir: Path) -> None:
    distributed.init(timeout=60)
    distributed.init()  # twice: harmless
    me = distributed.rank()
    seen: dict[str, object] = {
        "launch": distributed.detect_launcher(),
        "ids": (
            distributed.rank(),
            distributed.world_size(),
            distributed.local_rank(),
            distributed.local_world_size(),
            distributed.is_main(),
        ),
        "local_devices": distributed.local_devices(),
        "nncore": (distributed.is_distributed(), distributed.get_dist_info()),
    }
    seen["all_gather"] = [
        (obj["rank"], obj["fn"]()) for obj in distributed.all_gather({"rank": me, "fn": lambda: me})
    ]
    seen["gather"] = distributed.gather(me * 10, dst=1)
    seen["gather0"] = distributed.gather(f"r{me}")
    seen["broadcast"] = distributed.broadcast(f"from {me}", src=1)
    seen["barrier"] = distributed.barrier()

    @distributed.main_only
    def only_main(x):
        return x + 1

    seen["main_only"] = only_main(me)
    marks = str(outdir / "marks")
    for name in jobs.SCENARIOS:
        seen[name] = jobs.run(name, 1, True, marks)
    distributed.barrier()
    with open(outdir / f"rank{me}.pkl", "wb") as f:
        pickle.dump(seen, f)
    print(f"rank {me} done (pid {os.getpid()})", flush=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
