"""Ray tests: one real Ray for the folder (2 CPUs), and a leak check that knows Ray's processes.

The suite's leak check (no process of ours left, no new /dev/shm entry) would count Ray's own
long-lived processes (raylet, GCS, idle workers, object store files); here the check is that
no easycore actor is left alive after a test.
"""

from __future__ import annotations

import pytest

from helpers import no_actors_left, running_ray


@pytest.fixture(scope="package")
def local_ray():
    """A local Ray with 2 CPUs for the modules of this folder (the user's own: easycore leaves
    it running), started once: a start and a shutdown cost ~4 s (the folder has
    ``__init__.py`` so that the package scope ends with it)."""
    yield from running_ray(2)


@pytest.fixture(autouse=True)
def no_leaks():
    """After every test: no easycore actor process alive."""
    yield from no_actors_left()
