"""Frozen dataclasses that serve as cache keys.

The planner memoises pure functions of the model's shape, the recipe and the accelerator (`functools.lru_cache`
on ModelArgs, Training, Cluster). A dataclass's generated hash builds a tuple of every field on each call, which
a search making ~10^5 lookups pays for again and again; `hashed_once` computes it on first use and keeps it.
"""

from __future__ import annotations

import dataclasses


def _hashable(value):
    if isinstance(value, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value


def hashed_once(cls):
    """Class decorator for a frozen dataclass: hash every field once (dicts and lists by their contents), keep it
    on the instance, and leave it out of pickles (a str's hash differs from one process to the next)."""
    if not cls.__dataclass_params__.frozen:
        raise TypeError(f"{cls.__name__} must be a frozen dataclass to be hashed once")
    names = tuple(f.name for f in dataclasses.fields(cls))

    def __hash__(self) -> int:
        cached = self.__dict__.get("_hash")
        if cached is None:
            cached = hash((cls.__name__, *(_hashable(getattr(self, n)) for n in names)))
            object.__setattr__(self, "_hash", cached)
        return cached

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_hash"}

    cls.__hash__ = __hash__
    cls.__getstate__ = __getstate__
    return cls
