"""The run core: what a run is, whatever runs its work (no processes, no Ray, no I/O).

The books of a run (``books``: input taken under the window, re-runs, charges, order
of delivery, the error policy, the loop every transport runs under), the scheduler
(which place takes which chunk, what a death leaves to run again), the plan (a
pipeline cut into hops), sources, chunk sizes, blame after a death, what a run
delivers (``outcomes``), the consumer's fold, the prepared stages (the one copy of
"run the user's code") and the messages and markers every engine shares
(``protocol``). Nothing here imports an engine (``tests/unit/test_structure.py``).
"""
