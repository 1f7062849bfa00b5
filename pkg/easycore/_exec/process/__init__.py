"""The process engine: worker processes on this machine (the default engine).

The caller's side (``engine``: ProcessEngine; ``run``: the transport over pipes;
``workers``: spawn, respawn, wait, stop; ``startup``: fork or forkserver) and the
worker's side (``worker_loop``: the loop inside a worker; ``channel``: messages with
tensors in shared memory; ``forkserver``, ``preload``, ``preload_light``: what the
forkservers do and import once). It imports nothing of the Ray engine.
"""
