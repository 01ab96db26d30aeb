"""Triton's CPU interpreter, with ``triton.language`` patched once per kernel launch instead of at every call, and
two of its per-operation lookups memoized.

The interpreter runs a kernel by patching ``triton.language``'s builtins for the launch (``_patch_lang``), running
every program, then restoring them. A ``@triton.jit`` helper called from inside a kernel patches the same modules
again on every call; those patches change nothing (the members are already the interpreter's), but each one walks
the modules with ``inspect.getmembers``, which then dominates a kernel's host time after the numpy arithmetic.
:func:`install` makes a helper's call skip that walk while a launch that already patched every ``triton.language``
module the helper sees is running. What runs is unchanged: the same patched members, the same program order, the
same numpy arithmetic (tests/kernels/test_interpreter_patching.py compares the results bit for bit).

Two pure lookups the interpreter repeats are kept instead of recomputed: the language's builtin member names per
module (``_patch_builtin`` lists every member of a module with ``inspect.getmembers`` at each launch; the members are
still read and checked at each launch, only the listing is kept), and the numpy dtype of a Triton dtype
(``_get_np_dtype`` builds its table of every dtype at each cast, splat and load).

:func:`install` does nothing unless the Triton release has the two pieces it wraps (``_patch_lang``,
``GridExecutor.__call__``); it is idempotent. :func:`uninstalled` puts Triton's own back for a block.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Callable, Iterator

_ORIGINALS: dict[str, Callable] = {}  # "_patch_lang" / "launch": Triton's own, once installed


def install() -> bool:
    """Wrap the interpreter's launch and patch step; returns whether they are (now or already) wrapped."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patch_lang = getattr(interpreter, "_patch_lang", None)
    executor = getattr(interpreter, "GridExecutor", None)
    if patch_lang is None or executor is None or "__call__" not in vars(executor):
        return False
    if _ORIGINALS:
        return True
    language_modules = (interpreter.tl, interpreter.tl.core)
    patched: list[set[int]] = []  # per running launch: ids of the language modules it has patched
    seen_by: dict[Callable, frozenset[int]] = {}  # per function: ids of the language modules its globals hold

    def modules_seen_by(fn: Callable) -> frozenset[int]:
        seen = seen_by.get(fn)
        if seen is None:
            seen = seen_by[fn] = frozenset(id(value) for value in fn.__globals__.values() if inspect.ismodule(value)
                                           and any(value is module for module in language_modules))
        return seen

    def patch_lang_once(fn: Callable) -> Any:
        seen = modules_seen_by(fn)
        if patched and seen <= patched[-1]:
            return None  # a helper's call inside a launch that patched all it sees (the caller drops the scope)
        scope = _ORIGINALS["_patch_lang"](fn)
        if patched:
            patched[-1] |= seen
        return scope

    launch = executor.__call__

    def launch_patching_once(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched.append(set())
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    _ORIGINALS.update(_patch_lang=patch_lang, launch=launch)
    interpreter._patch_lang = patch_lang_once
    executor.__call__ = launch_patching_once
    _memoize_lookups(interpreter)
    return True


def _memoize_lookups(interpreter: Any) -> None:
    """Wrap ``_patch_builtin`` and ``_get_np_dtype`` (where this Triton has them) with their kept
    answers (module docstring)."""
    patch_builtin, np_dtype = (getattr(interpreter, name, None)
                               for name in ("_patch_builtin", "_get_np_dtype"))
    patch_attr, tl = getattr(interpreter, "_patch_attr", None), getattr(interpreter, "tl", None)
    if patch_builtin is not None and patch_attr is not None and tl is not None:
        builtin_names: dict[int, tuple[Any, list[str]]] = {}  # id(module): (module, names)

        def patch_builtin_listed(pkg: Any, builder: Any, scope: Any) -> None:
            kept = builtin_names.get(id(pkg))
            if kept is None or kept[0] is not pkg:
                names = [name for name, member in inspect.getmembers(pkg) if tl.core.is_builtin(member)]
                kept = builtin_names[id(pkg)] = (pkg, names)
            for name in kept[1]:
                member = getattr(pkg, name)
                if tl.core.is_builtin(member):
                    interpreter._patch_attr(pkg, name, member, builder, scope)

        _ORIGINALS["_patch_builtin"] = patch_builtin
        interpreter._patch_builtin = patch_builtin_listed
    if np_dtype is not None and tl is not None:
        by_scalar: dict[Any, Any] = {}

        def np_dtype_kept(tt_dtype: Any) -> Any:
            scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
            if isinstance(scalar, tl.pointer_type):
                return np_dtype(scalar)
            found = by_scalar.get(scalar)
            if found is None:
                found = by_scalar[scalar] = np_dtype(scalar)
            return found

        _ORIGINALS["_get_np_dtype"] = np_dtype
        interpreter._get_np_dtype = np_dtype_kept


def installed() -> bool:
    return bool(_ORIGINALS)


@contextlib.contextmanager
def uninstalled() -> Iterator[None]:
    """Triton's own ``_patch_lang``, launch and lookups inside the block (for comparisons); the wrappers again after it."""
    if not _ORIGINALS:
        yield
        return
    from triton.runtime import interpreter

    names = [name for name in ("_patch_lang", "_patch_builtin", "_get_np_dtype") if name in _ORIGINALS]
    wrappers = {name: getattr(interpreter, name) for name in names}
    launch = interpreter.GridExecutor.__call__
    for name in names:
        setattr(interpreter, name, _ORIGINALS[name])
    interpreter.GridExecutor.__call__ = _ORIGINALS["launch"]
    try:
        yield
    finally:
        for name, wrapper in wrappers.items():
            setattr(interpreter, name, wrapper)
        interpreter.GridExecutor.__call__ = launch
