"""The Ray engine (``engine="ray"``): every hop a group of Ray actors.

``engine``: RayEngine, the actors' lifecycle; ``run``: the transport over object
references, and the driver's record of each actor (``Actor``); ``actor``: StageActor and
the task body, imported in Ray's workers. Imported only when a run asks for Ray; it
imports nothing of the process engine.
"""
