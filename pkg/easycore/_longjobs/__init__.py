"""What long jobs add around any run, on every engine: ``resume=`` (``resume``: the run
ledger; ``digest``: digests equal in every process), an imap's ``state_dict()``
(``position``), ``errors="skip"`` (``skip``), sinks (``sinks``: the description and
the worker's writer; ``commit``: the caller's side) and training checkpoints
(``checkpoint``). Engine-neutral: nothing here imports an engine.
"""
