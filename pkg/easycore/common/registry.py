"""easycore 0.4's ``Registry`` path.

Replacement: :class:`easycore.Registry` (same ``register`` and ``get``; it adds ``build``,
``in``, ``len`` and iteration). 0.4's ``get_registered_names`` is kept as an alias of
:meth:`~easycore.Registry.registered_names`.
"""

from __future__ import annotations

import easycore

__all__ = ["Registry"]


class Registry(easycore.Registry):
    """:class:`easycore.Registry` plus 0.4's method name ``get_registered_names``.

    >>> MODEL_REGISTRY = Registry("MODEL")
    >>> @MODEL_REGISTRY.register()
    ... class ResNet50:
    ...     pass
    >>> MODEL_REGISTRY.get_registered_names()
    ['ResNet50']
    """

    def get_registered_names(self) -> list[str]:
        """Every registered name, in registration order (0.4's name for ``registered_names``).

        Returns:
            A new list of the names.

        >>> REG = Registry("DEMO")
        >>> _ = REG.register("a", 1)
        >>> REG.get_registered_names()
        ['a']
        """
        return self.registered_names()
