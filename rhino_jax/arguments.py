"""A call of a parallelized step split as `jax.jit` splits it: static arguments (`static_argnums`,
`static_argnames`: Python values the step branches on, hashed into the cache key) and dynamic ones
(arrays and numbers, traced). Lowering, the search and the compiled program see only the dynamic
ones, through `Call.fn`, which puts the static values back before calling the user's function.

Which arguments are static, and which are donated, is resolved once against the function's
signature, as jax.jit does: positions name parameters and names give positions, and a function
that is already `jax.jit`-ed brings its own static (and, unless overridden, donated) arguments.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import jax

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


@dataclass(frozen=True)
class Call:
    """One call's dynamic arguments, its static values, and the function of the dynamic ones."""

    fn: Callable  # called as fn(*args, **kwargs): the user's function with the static values put back
    args: tuple
    kwargs: dict
    static: tuple  # ((position or name, value), ...): positions ascending, then names sorted
    positions: tuple[int, ...]  # the user's position of each of `args`
    donate_argnums: tuple[int, ...]  # among the dynamic positional arguments
    donate_argnames: tuple[str, ...]


@dataclass(frozen=True)
class ArgSpec:
    """Which arguments of a step are static and which are donated (positions and names)."""

    fn_name: str
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()

    @staticmethod
    def of(fn: Callable, static_argnums=None, static_argnames=None, donate_argnums=None) -> "ArgSpec":
        """Resolve the options against `fn`'s signature (and its own jax.jit options)."""
        jit = getattr(fn, "_jit_info", None)
        name = getattr(getattr(fn, "_fun", fn), "__name__", type(fn).__name__)
        params = _parameters(fn)
        nums = _argnums(static_argnums, "static_argnums", params, name)
        names = _argnames(static_argnames, "static_argnames", params, name)
        nums, names = _infer(nums, names, params)
        if jit is not None:  # a jax.jit-ed step: its static arguments stay static
            nums = tuple(sorted(set(nums) | set(jit.static_argnums)))
            names = tuple(sorted(set(names) | set(jit.static_argnames)))
        if donate_argnums is None and jit is not None:
            donate, donate_names = tuple(jit.donate_argnums), tuple(jit.donate_argnames)
        else:
            donate, donate_names = _infer(_argnums(donate_argnums, "donate_argnums", params, name), (), params)
        both = sorted(set(donate) & set(nums)) or sorted(set(donate_names) & set(names))
        if both:
            raise ValueError(f"argument {both[0]!r} of {name} is both static and donated: a static argument is a "
                             "Python value, not a buffer; drop it from donate_argnums or from static_argnums/"
                             "static_argnames")
        return ArgSpec(name, nums, names, donate, donate_names)

    @property
    def has_static(self) -> bool:
        return bool(self.static_argnums or self.static_argnames)

    def split(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, tuple]:
        """(dynamic positional arguments, dynamic keyword arguments, static values) of a call; a
        static value that cannot be hashed is a TypeError, as with jax.jit."""
        if not self.has_static:
            return args, kwargs, ()
        static = [(i, args[i]) for i in self.static_argnums if i < len(args)]
        static += [(k, kwargs[k]) for k in self.static_argnames if k in kwargs]
        for key, value in static:
            try:
                hash(value)
            except TypeError as e:
                raise TypeError(
                    f"static argument {_label(key)} of {self.fn_name} is a {type(value).__name__}, which cannot be "
                    f"hashed ({e}): static arguments key the plan cache, as with jax.jit; pass a hashable value "
                    "(a tuple for a list, a frozen dataclass), or make the argument dynamic (an array)") from None
        if static:
            args = tuple(a for i, a in enumerate(args) if i not in self.static_argnums)
            kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        return args, kwargs, tuple(static)

    def call(self, fn: Callable, args: tuple, kwargs: dict) -> Call:
        """The call `fn(*args, **kwargs)` as the dynamic arguments and the function of them."""
        dyn_args, dyn_kwargs, static = self.split(args, kwargs)
        positions = [k for k, _ in static if isinstance(k, int)]
        donate = tuple(d - sum(p < d for p in positions) for d in self.donate_argnums)
        kept = tuple(i for i in range(len(args)) if i not in positions)
        return Call(_with_static(fn, static), dyn_args, dyn_kwargs, static, kept, donate,
                    tuple(n for n in self.donate_argnames if n not in self.static_argnames))


def donated_leaves(call: Call) -> tuple[int, ...]:
    """The positions, among a call's flat dynamic arguments (as jax flattens (args, kwargs)), of
    the leaves of its donated arguments."""
    marks = (tuple(jax.tree.map(lambda _, i=i: i in call.donate_argnums, a) for i, a in enumerate(call.args)),
             {k: jax.tree.map(lambda _, k=k: k in call.donate_argnames, v) for k, v in call.kwargs.items()})
    return tuple(i for i, donated in enumerate(jax.tree.leaves(marks)) if donated)


def call_tree(tree, leaves: Sequence):
    """`leaves` (one per leaf of a call's dynamic arguments, flattened as jax flattens (args,
    kwargs)) in the structure `plan.input_shardings` takes: the args tuple, or (args, kwargs) for
    a call with keyword arguments."""
    args, kwargs = jax.tree.unflatten(tree, leaves)
    return (args, kwargs) if kwargs else args


def _label(key: int | str) -> str:
    return f"arg[{key}]" if isinstance(key, int) else f"arg[{key!r}]"


def _with_static(fn: Callable, static: tuple) -> Callable:
    """fn of the dynamic arguments alone: the static values go back in their places."""
    if not static:
        return fn
    positions = [(k, v) for k, v in static if isinstance(k, int)]  # ascending
    named = {k: v for k, v in static if isinstance(k, str)}

    def step(*args, **kwargs):
        full = list(args)
        for i, value in positions:
            full.insert(i, value)
        return fn(*full, **kwargs, **named)

    # jax names the module after the function (not via __wrapped__: jax would read fn's signature)
    step.__name__ = step.__qualname__ = getattr(getattr(fn, "_fun", fn), "__name__", "step")
    return step


def _parameters(fn: Callable) -> list[inspect.Parameter] | None:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some callables have no signature
        return None


def _argnums(value, option: str, params, name: str) -> tuple[int, ...]:
    """`value` (None, an int or ints) as sorted non-negative positions, checked against `params`."""
    nums = _items(value, int, option, "an int or a sequence of ints")
    if any(isinstance(i, bool) or not isinstance(i, int) for i in nums):
        raise TypeError(f"{option} must be an int or a sequence of ints, got {value!r}")
    positional = None if params is None else [p for p in params if p.kind in _POSITIONAL]
    open_ended = params is None or any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params)
    out = []
    for i in nums:
        if i < 0:
            if open_ended:
                raise ValueError(f"{option}={value!r}: a negative position needs a function whose positional "
                                 f"parameters are known, and {name} takes *args or has no signature; use i >= 0")
            i += len(positional)
        if i < 0 or (not open_ended and i >= len(positional)):
            raise ValueError(f"{option}={value!r}: {name} takes {len(positional)} positional arguments "
                             f"({', '.join(p.name for p in positional)}); use positions below {len(positional)}")
        out.append(i)
    return tuple(sorted(set(out)))


def _items(value, one: type, option: str, expected: str) -> tuple:
    """`value` as a tuple: () for None, (value,) for one `one`, else its items."""
    if value is None:
        return ()
    if isinstance(value, one):
        return (value,)
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"{option} must be {expected}, got {value!r}")
    return tuple(value)


def _argnames(value, option: str, params, name: str) -> tuple[str, ...]:
    names = _items(value, str, option, "a str or a sequence of str")
    if any(not isinstance(n, str) for n in names):
        raise TypeError(f"{option} must be a str or a sequence of str, got {value!r}")
    if params is not None and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        known = [p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL]
        for n in names:
            if n not in known:
                raise ValueError(f"{option}={value!r}: {name} has no parameter {n!r} (its parameters: "
                                 f"{', '.join(known)})")
    return tuple(sorted(set(names)))


def _infer(nums: Sequence[int], names: Sequence[str], params) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Positions give the names of the parameters there, and names their positions (jax.jit's rule:
    only when one of the two is given, and only for parameters that may be passed either way)."""
    if params is None or (nums and names):
        return tuple(nums), tuple(names)
    either = [p.name if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else None
              for p in params if p.kind in _POSITIONAL]
    if nums:
        names = tuple(sorted(either[i] for i in nums if i < len(either) and either[i]))
    elif names:
        nums = tuple(sorted(either.index(n) for n in names if n in either))
    return tuple(nums), tuple(names)
