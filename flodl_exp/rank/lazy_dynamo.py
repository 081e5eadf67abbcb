"""Keep ``torch._dynamo`` out of a rank until something compiles.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` as it is built and on each ``step()``, whatever
``foreach``, ``fused`` or ``differentiable`` say: ``add_param_group``, ``zero_grad``, ``state_dict`` and
``load_state_dict`` are wrapped by ``torch._disable_dynamo`` (which imports dynamo on the first call to build its
"do not trace this" wrapper), and ``step`` by ``_use_grad_for_differentiable`` (which imports it to place two
``graph_break()`` markers). Outside ``torch.compile`` both are no-ops, but the import is about 1.3-1.8 s of CPU a
process on this machine kind, as much as ``import torch`` itself, paid by every rank before its first batch
(docs/reference/measurements.md, start-up).

:func:`defer_optimizer_dynamo` gives those wrappers an eager path that runs the optimizer's own function directly
while ``torch._dynamo`` is not loaded. Nothing can be compiling then (``torch.compile`` imports dynamo first), so
the eager path is exactly what torch runs in eager mode: the same function under the same grad mode. From the
moment anything loads dynamo (the user's ``torch.compile``, ``torch.export``), every wrapper hands back to torch's
own code on its next call, so compiled code sees torch's behaviour unchanged.

It recognises torch's wrappers by their code objects, closure variables and the names they read, and changes nothing
it does not recognise, so a torch whose internals differ only loses the saving. ``FLODL_DEFER_DYNAMO=0`` turns it off.
"""
from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

ENV = "FLODL_DEFER_DYNAMO"
_DYNAMO = "torch._dynamo"
_CACHE_ATTR = "__dynamo_disable"  # the attribute torch._disable_dynamo caches its wrapper under, on the function
# The shapes this module knows (torch 2.4-2.13): the closure's free variables and every global or attribute name
# the wrapper's body reads. A torch whose wrapper reads anything else does something this module would not copy.
_DISABLE_SHAPE = (("fn", "recursive"), {"getattr", "torch._dynamo", "_dynamo", "disable", _CACHE_ATTR})
_USE_GRAD_SHAPE = (("func",), {"torch._dynamo", "cast", "Optimizer", "is_grad_enabled", "set_grad_enabled",
                               "defaults", "_dynamo", "graph_break"})


def dynamo_loaded() -> bool:
    return _DYNAMO in sys.modules


def _known(code: Any, shape: tuple[tuple[str, ...], set[str]]) -> bool:
    freevars, names = shape
    return code.co_freevars == freevars and set(code.co_names) <= names


def _cell(wrapper: Any, name: str) -> Any:
    return wrapper.__closure__[wrapper.__code__.co_freevars.index(name)].cell_contents


class _EagerUntilDynamo:
    """Stands in for the cached ``torch._dynamo.disable(fn)`` of one ``torch._disable_dynamo`` wrapper: calls
    ``fn`` itself while dynamo is not loaded, and once it is, removes itself so torch's wrapper builds the real one."""

    def __init__(self, fn: Callable[..., Any], torch_wrapper: Callable[..., Any]) -> None:
        self.fn = fn
        self.torch_wrapper = torch_wrapper

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not dynamo_loaded():
            return self.fn(*args, **kwargs)
        cached = self.fn.__dict__
        if cached.get(_CACHE_ATTR) is self:
            cached.pop(_CACHE_ATTR, None)  # two threads may get here at once: the second finds it gone
        return self.torch_wrapper(*args, **kwargs)


def _eager_step(use_grad: Callable[..., Any], func: Callable[..., Any]) -> Callable[..., Any]:
    """``_use_grad_for_differentiable(func)`` without its dynamo import: the same grad mode around ``func``
    (the optimizer's ``defaults["differentiable"]``); torch's ``use_grad`` wrapper itself once dynamo is loaded
    (``is_compiling`` first: dynamo folds it to a constant, so a compiled step never traces the module check)."""
    import torch

    @functools.wraps(func)
    def step(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling() or dynamo_loaded():
            return use_grad(*args, **kwargs)
        prev = torch.is_grad_enabled()
        try:
            torch.set_grad_enabled(args[0].defaults["differentiable"])
            return func(*args, **kwargs)
        finally:
            torch.set_grad_enabled(prev)

    return step


def _optimizer_classes() -> Iterator[type]:
    import torch.optim

    seen: set[type] = set()
    todo: list[type] = [torch.optim.Optimizer]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.add(cls)
            todo.extend(cls.__subclasses__())
            yield cls


def defer_optimizer_dynamo() -> int:
    """Give the optimizers' dynamo wrappers their eager path (see the module's docstring). Idempotent; does nothing
    once dynamo is loaded or with ``FLODL_DEFER_DYNAMO=0``. Returns how many wrappers it changed. Only optimizer
    classes defined when it runs are changed (torch's own, imported with ``torch.optim``); one defined later keeps
    torch's wrappers. Never raises: a torch it does not recognise keeps its own code (and its import)."""
    if os.environ.get(ENV, "1") == "0" or dynamo_loaded():
        return 0
    try:
        return _defer()
    except Exception:  # a torch whose internals moved: the saving is lost, the rank is not
        return 0


def _defer() -> int:
    import torch
    from torch.optim import optimizer as optimizer_module

    disable_code = torch._disable_dynamo(lambda: None).__code__
    use_grad_code = optimizer_module._use_grad_for_differentiable(lambda: None).__code__
    disable_ok, use_grad_ok = _known(disable_code, _DISABLE_SHAPE), _known(use_grad_code, _USE_GRAD_SHAPE)
    changed = 0
    for cls in _optimizer_classes():
        for name, attr in list(vars(cls).items()):
            code = getattr(attr, "__code__", None)
            if code is None:
                continue
            if code is disable_code and disable_ok:
                fn = _cell(attr, "fn")
                if getattr(fn, _CACHE_ATTR, None) is None:
                    setattr(fn, _CACHE_ATTR, _EagerUntilDynamo(fn, attr))
                    changed += 1
            elif code is use_grad_code and use_grad_ok and not getattr(attr, "hooked", False):
                # not yet wrapped by the profiler hook (which the class's first instance adds around it)
                setattr(cls, name, _eager_step(attr, _cell(attr, "func")))
                changed += 1
    return changed
