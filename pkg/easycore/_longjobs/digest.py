"""Digests that are the same in every process and every Python run: of items (``resume=``
tells "the input changed" by them) and of functions and ``cfg`` (what run a ledger belongs
to).

A pickle is no such digest. A set's pickle lists its elements in hash order, and the hash of
a str or bytes changes with ``PYTHONHASHSEED``, so in every new process; a dict's pickle
lists its keys in insertion order, so equal dicts pickle apart; pickle's memo makes a list of
two equal strings pickle one way when they are one object and another when they are two.
So an item's digest hashes a canonical pickle of it (:class:`_Canonical`, as joblib's
hashing does):

* without a memo: equal values pickle alike, whatever objects they share;
* a ``dict``'s entries and the elements of a ``set`` or ``frozenset``, also of their
  subclasses (a ``defaultdict``), sorted: by value where they (a dict's keys) are all str,
  all int or all bytes, else by their digests; an ``OrderedDict`` in its order, as its
  equality is;
* numpy arrays and torch tensors: dtype, shape and the bytes of the values, in C order (a
  tensor's own pickle holds the address of its storage);
* classes, modules and builtins by name (never imported: a class defined in a function
  too), functions by :func:`function_digest`;
* any other object as pickle reduces it (a constructor, its arguments, its state), its
  parts canonical as above: a dataclass holding a set, a module holding tensors.

An item that pickle cannot take, or that holds itself, goes through its cloudpickle. Types
are part of the pickle: ``1``, ``1.0``, ``True`` and ``"1"`` differ, and so do ``(1, 2)``
and ``[1, 2]``. A ledger of digests of another kind is refused by its ``format``
(:class:`~easycore._longjobs.resume.RunIdentity`).

A function's digest is its code (bytecode, constants, names, nested code objects), its
defaults, the values its closure holds, and what of its own module it names: functions
(by their digest), plain data (numbers, strings, arrays, tensors, and lists, tuples, dicts
and sets of them: by value) and classes (their methods, and data attributes as ``C.K``);
not where it sits in its file, nor ``id``/``hash``: all of it as one value, pickled as an
item is (code objects as their parts). Bytecode is the interpreter's, so another Python
version makes another digest. :func:`code_digest` leaves the data's values out and returns
them by name, so that a message can name them; :func:`function_digest` is that digest
with the data's item digests.
"""

from __future__ import annotations

import collections
import copyreg
import hashlib
import io
import operator
import pickle
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any

import cloudpickle

__all__ = ["cfg_digests", "code_digest", "function_digest", "item_digest"]

DIGEST_SIZE = 16

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
# what pickle takes as it is (in a canonical pickle too)
_PICKLED = frozenset({type(None), bool, int, float, str, bytes, tuple, list})


def _hasher(*parts: Any) -> Any:
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in parts:
        h.update(part)
    return h


class _Canonical(pickle.Pickler):
    """Pickles a value canonically, as joblib's hashing does (see the module's docstring);
    arrays' and tensors' values are hashed apart, not copied into the pickle.

    ``active``: the ids of the functions on the way down (a function whose closure holds a
    value that holds it); ``constants``: where a function's module data goes by name
    (:func:`code_digest`), None outside a function's digest.
    """

    def __init__(self, active: set[int], constants: dict[str, Any] | None = None) -> None:
        self.stream = io.BytesIO()
        super().__init__(self.stream, protocol=5)
        self.fast = True  # (no memo; a value that holds itself is an error)
        self.active = active
        self.constants = constants  # (within a function's digest: see code_digest)
        self.values = _hasher()

    def digest(self, obj: Any) -> bytes:
        self.dump(obj)
        return bytes(_hasher(self.stream.getbuffer(), self.values.digest()).digest())

    def persistent_id(self, obj: Any) -> Any:
        """What stands for ``obj`` in the pickle, or None: pickle's own (for every value,
        also those pickle takes without a reducer: dicts and sets)."""
        kind = type(obj)
        if kind in _PICKLED:
            return None
        if kind is dict:
            return "M", self._sorted(list(obj.items()), key=operator.itemgetter(0))
        if kind is set or kind is frozenset:
            return kind.__name__, self._sorted(list(obj), key=lambda v: v)
        if kind is types.FunctionType:
            if self.constants is None:
                return "f", function_digest(obj)
            return "f", _code_digest(obj, self.active, self.constants)
        if kind is types.MethodType:
            return "m", obj.__func__, obj.__self__
        if kind is types.CodeType:
            return "c", _code(obj, obj.co_consts)
        if kind is _ByName:
            return "n", obj.fn.__module__, obj.fn.__qualname__
        if isinstance(obj, type | types.BuiltinFunctionType | types.ModuleType):
            module = "" if kind is types.ModuleType else obj.__module__
            return "n", module, getattr(obj, "__qualname__", obj.__name__)
        np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
        if np is not None and kind is np.ndarray:
            if obj.dtype.hasobject:  # elements are Python objects: pickled as such
                return "O", obj.shape, list(obj.ravel(order="C"))
            dtype = str(obj.dtype.descr) if obj.dtype.fields else obj.dtype.str
            flat = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            return self._values("A", obj, dtype, flat)
        if torch is None or not isinstance(obj, torch.Tensor):
            return None
        if obj.layout != torch.strided or obj.is_quantized or obj.device.type == "meta":
            return None  # (sparse, quantized, meta: their pickle)
        t = obj.detach().cpu().resolve_conj().resolve_neg().contiguous()
        return self._values(kind, t, str(t.dtype), t.reshape(-1).view(torch.uint8).numpy())

    def _values(self, kind: Any, obj: Any, dtype: str, flat: Any) -> Any:
        self.values.update(flat)
        return kind, dtype, tuple(obj.shape), flat.nbytes

    def reducer_override(self, obj: Any) -> Any:
        """An object as pickle reduces it, its constructor by name (a function in the
        value is digested, one that builds it is named); subclasses of dict and set with
        their entries sorted too."""
        if isinstance(obj, set | frozenset):
            return type(obj), (self._sorted(list(obj), key=lambda v: v),), _state(obj)
        if isinstance(obj, collections.OrderedDict):  # (in its order, as its equality is)
            return type(obj), (list(obj.items()),), _state(obj)
        reduce = copyreg.dispatch_table.get(type(obj))
        # (protocol 4: 5 reduces an array subclass to a buffer, pickled as writable or not)
        rv = reduce(obj) if reduce is not None else obj.__reduce_ex__(4)
        if not isinstance(rv, tuple):
            return rv  # (a global's name)
        func, args, *rest = rv
        rest += [None] * (4 - len(rest))
        if isinstance(obj, dict):  # (a defaultdict: its default_factory in args)
            rest[2] = rest[2] and iter(self._sorted(list(rest[2]), key=operator.itemgetter(0)))
        if isinstance(func, types.FunctionType):
            func = _ByName(func)
        return func, args, *rest

    def _sorted(self, values: list[Any], key: Callable[[Any], Any]) -> list[Any]:
        """``values`` in an order that depends on their ``key`` s alone: keys of one type,
        str, int or bytes, by value; any others by their digests."""
        kinds = {type(key(v)) for v in values}
        if len(kinds) > 1 or not kinds <= {str, int, bytes}:
            return sorted(values, key=lambda v: _item_digest(key(v), self.active, self.constants))
        return sorted(values, key=key)


class _ByName:
    """A function that builds an object (in its reduction): named in the pickle."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    def __call__(self) -> None: ...


def _state(obj: Any) -> Any:
    """The attributes of a set or OrderedDict (of a subclass), None when it has none."""
    return getattr(obj, "__dict__", None) or None


def item_digest(obj: Any) -> bytes:
    """A 16-byte digest of ``obj`` that equal values share in any process.

    >>> item_digest({"a": 1, "b": {1, 2}}) == item_digest({"b": {2, 1}, "a": 1})
    True
    >>> item_digest((1, 2)) == item_digest([1, 2])
    False
    """
    return _item_digest(obj, set())


def _item_digest(obj: Any, active: set[int], constants: dict[str, Any] | None = None) -> bytes:
    try:
        return _Canonical(active, constants).digest(obj)
    except Exception:  # a cycle, or what pickle cannot take: its cloudpickle (or its error)
        return bytes(_hasher(b"P" + cloudpickle.dumps(obj)).digest())


# -- functions ---------------------------------------------------------------------------------
def _code_digest(fn: Any, active: set[int], constants: dict[str, Any]) -> bytes:
    """:func:`code_digest`'s bytes; a callable already on the way down (``active``: one that
    refers to itself) is a mark."""
    if id(fn) in active:
        return b"@"
    held = set(active)
    active.add(id(fn))
    try:
        return _Canonical(active, constants).digest(_parts(fn, active, constants))
    finally:
        active.intersection_update(held)  # (fn, and the classes its reads expanded)


def _parts(fn: Any, active: set[int], constants: dict[str, Any]) -> Any:
    """What callable ``fn`` computes with, as a value to pickle canonically: a function's
    name, code, defaults, closure values and what of its module it names; a method's
    function and object; any other callable's ``__call__`` (when it is Python's) and
    state."""

    def value(v: Any) -> Any:  # (its type's name when it has no digest)
        try:
            return _item_digest(v, active, constants)
        except Exception:
            return f"{type(v).__module__}.{type(v).__qualname__}"

    if isinstance(fn, types.MethodType):
        return "m", fn.__func__, value(fn.__self__)
    if not isinstance(fn, types.FunctionType):
        call = getattr(type(fn), "__call__", None)  # noqa: B004
        return "o", call if isinstance(call, types.FunctionType) else None, value(fn)
    code, doc = fn.__code__, fn.__doc__
    skip = doc is not None and code.co_consts[:1] == (doc,)  # (a changed docstring: the same)
    cells = []
    for cell in fn.__closure__ or ():
        try:
            cells.append(value(cell.cell_contents))
        except ValueError:  # an empty cell (a name not bound yet)
            cells.append(b"e")
    # helpers, data and classes of its own module that it names: a change there changes
    # what it computes (names of other modules, and other objects, are left out)
    reads: dict[str, Any] = {}
    for name in sorted(_names(code)):
        if name in fn.__globals__:
            _read(reads, name, fn.__globals__[name], fn.__module__, constants, active)
    defaults = value(fn.__defaults__), value(fn.__kwdefaults__)
    name = f"{fn.__module__}.{fn.__qualname__}"
    return name, _code(code, code.co_consts[skip:]), defaults, cells, reads


def _code(code: types.CodeType, consts: tuple[Any, ...]) -> tuple[Any, ...]:
    """A code object as plain values (code nested in ``consts`` pickles as this too)."""
    counts = (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
    names = (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars)
    return counts, code.co_code, getattr(code, "co_exceptiontable", b""), names, consts


def _read(
    reads: dict[str, Any],
    name: str,
    value: Any,
    module: str,
    constants: dict[str, Any],
    active: set[int],
) -> None:
    """A global ``name`` of ``module`` that a function names, into ``reads``: a function of
    the module (pickled as its digest), plain data (:func:`_is_data`) by name only, its
    value into ``constants`` (under ``module.name`` where another module's took the name),
    a class of the module by its methods and data attributes (``C.K``): once per digest of
    a function (``active`` holds it until then: its methods that name it do not expand it
    again, so a class of k such methods costs k digests, not k!)."""
    if isinstance(value, types.FunctionType) and value.__module__ == module:
        reads[name] = value
    elif _is_data(value):
        key = name if constants.setdefault(name, value) is value else f"{module}.{name}"
        constants[key] = value
        reads[name] = "k", key
    elif isinstance(value, type) and value.__module__ == module and id(value) not in active:
        active.add(id(value))
        members: dict[str, Any] = {}
        for klass in reversed(value.__mro__):  # (as attribute lookup finds them)
            if klass.__module__ == module:
                members.update(vars(klass))
        for attr, member in sorted(members.items()):
            if isinstance(member, staticmethod | classmethod):
                member = member.__func__
            elif isinstance(member, property):
                member = member.fget
            if not attr.startswith("__") or isinstance(member, types.FunctionType):
                _read(reads, f"{name}.{attr}", member, module, constants, active)


def _names(code: types.CodeType) -> set[str]:
    """The global (and attribute) names a code object and the code nested in it use."""
    nested = (_names(const) for const in code.co_consts if isinstance(const, types.CodeType))
    return set(code.co_names).union(*nested)


def _is_data(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data: ``None``, a bool, number, str or bytes, a numpy array
    or torch tensor, or a tuple, list, dict, set or frozenset of plain data."""
    if type(value) in _ATOMS:
        return True
    if depth > 20:  # (deeper, or a container that holds itself: not data)
        return False
    if isinstance(value, dict):
        return all(_is_data(k, depth + 1) and _is_data(v, depth + 1) for k, v in value.items())
    if isinstance(value, tuple | list | set | frozenset):
        return all(_is_data(x, depth + 1) for x in value)
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    return (np is not None and type(value) is np.ndarray and not value.dtype.hasobject) or (
        torch is not None and isinstance(value, torch.Tensor)
    )


def function_digest(fn: Callable[..., Any]) -> str:
    """A hex digest of what ``fn`` computes with: the same in every process for the same
    code, defaults and closure values, and module data it reads.

    >>> function_digest(lambda x: x + 1) == function_digest(lambda x: x + 1)
    True
    >>> function_digest(lambda x: x + 1) == function_digest(lambda x: x + 2)
    False
    """
    constants: dict[str, Any] = {}
    code = code_digest(fn, constants)
    return item_digest((code, {k: item_digest(v) for k, v in constants.items()})).hex()


def code_digest(fn: Callable[..., Any], constants: dict[str, Any]) -> str:
    """:func:`function_digest` without the values of the module constants ``fn`` and its
    helpers read: those go into ``constants`` by name, so that when only they differ a
    message can name them and both values.

    >>> constants = {}
    >>> code = code_digest(lambda: DIGEST_SIZE, constants)
    >>> constants
    {'DIGEST_SIZE': 16}
    """
    return _code_digest(fn, set(), constants).hex()


def cfg_digests(cfg: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """The digest of every leaf of ``cfg`` by its dotted key (``"MODEL.WIDTH"``), so that two
    cfgs can be told apart key by key (each after ``prefix``). Mappings count as plain dicts,
    whatever their type.

    >>> cfg_digests({"A": {"B": 1}}) == cfg_digests({"A": {"B": 1}})
    True
    >>> sorted(cfg_digests({"A": {"B": 1}, "C": {}}))
    ['A.B', 'C']
    """
    out: dict[str, str] = {}
    for key, value in cfg.items():
        if isinstance(value, Mapping) and value:
            out.update(cfg_digests(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = item_digest(_plain(value)).hex()
    return out


def _plain(value: Any) -> Any:
    """``value`` with every mapping in it a plain dict (a CfgNode inside a list, say)."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    return value
