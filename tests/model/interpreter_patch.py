"""Triton's interpreter without its repeated patching of ``triton.language``: the tests' kernels
run in the interpreter on the CPU, and there every call of a ``@triton.jit`` helper from inside a
kernel (``InterpretedFunction.__call__``) patches the language modules its function sees again:
``inspect.getmembers`` over ``tl``, ``tl.tensor`` and ``tl.math``, about 0.8 ms a call. The
kernel's launch has already patched them for its whole run, and restores them when it ends; a
helper that sees no module the launch did not patch finds them patched already. In a profile of
``test_fast_decode``'s look-ahead test, 63,000 such calls took 52 of its 127 s.

``install`` makes a helper's call skip the patch when every language module in its globals is
already patched by the running launch, and patch as before otherwise; the launch's own patch
and restore are unchanged. Where Triton's interpreter does not have the functions this relies
on (another release), nothing is changed."""

from __future__ import annotations

import inspect
import sys
from typing import Any

_installed = False


def install() -> bool:
    """Install the shortcut if Triton's interpreter is imported and has the expected shape;
    whether it is in place."""
    global _installed
    if _installed:
        return True
    mod = sys.modules.get("triton.runtime.interpreter")
    if mod is None or not callable(getattr(mod, "_patch_lang", None)):
        return False
    scope_cls = getattr(mod, "_LangPatchScope", None)
    if scope_cls is None or not callable(getattr(scope_cls, "restore", None)):
        return False
    import triton.language as tl

    real = mod._patch_lang
    patched: set[int] | None = None  # the running launch's patched modules (None: no launch)

    class Done:
        """The scope of a patch that was not needed: nothing to restore."""

        def restore(self) -> None:
            pass

    seen_in: dict[Any, frozenset[int]] = {}  # a function's language modules, by function

    def langs(fn: Any) -> frozenset[int]:
        if fn not in seen_in:  # (a module's imports are made when it loads)
            core = (tl, tl.core)
            mods = (v for v in fn.__globals__.values() if inspect.ismodule(v) and v in core)
            seen_in[fn] = frozenset(id(v) for v in mods)
        return seen_in[fn]

    def patch_lang(fn: Any) -> Any:
        nonlocal patched
        seen = langs(fn)
        if patched is not None and seen <= patched:
            return Done()
        scope = real(fn)
        if patched is not None:  # a helper seeing another module: patched as before
            patched |= seen
            return scope
        patched = set(seen)  # the launch's patch: its restore ends the shortcut
        restore = scope.restore

        def restore_and_forget() -> None:
            nonlocal patched
            patched = None
            restore()

        scope.restore = restore_and_forget
        return scope

    mod._patch_lang = patch_lang
    _installed = True
    return True
