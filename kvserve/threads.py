"""The OpenMP settings kvserve starts with, and the one-line account of those in effect.

torch's OpenMP runtime (libgomp; the C kernels share it) reads its variables once, when torch is
imported. Unset, each idle worker thread spins 300,000 iterations before it sleeps, which beside a busy
neighbour takes the core the other thread needs (docs/performance.md "Threads" has the measurements that
chose `THREAD_DEFAULTS`). The `kvserve` command line calls `apply_thread_defaults()` before anything
imports torch; engine-core and tensor-parallel processes are spawned from it and inherit the environment.
The offline API (`from kvserve import LLM`, before torch is imported) loads torch with the defaults and
then gives the environment back as it was (`defaults_while_torch_loads`), so programs the user starts
later are unaffected; its tensor-parallel ranks get them again through `spawn_environment`.
A variable the user set wins: a default is applied only when no variable of its group is set (setting
`OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` keeps both of ours out). This module never imports torch.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Mapping

# Chosen from benchmarks/neighbour.py, quiet and with one busy core (docs/performance.md "Threads"): of
# the settings that kept TPOT within 2x beside a busy core, the best quiet TPOT (tied with a 1,000-spin
# count, within the rounds' spread); PASSIVE is standard OpenMP, so other runtimes honour it too.
THREAD_DEFAULTS: Mapping[str, str] = {"OMP_WAIT_POLICY": "PASSIVE"}

# Variables that decide the same thing: a user's setting of one keeps the group's defaults out.
_GROUPS: tuple[tuple[str, ...], ...] = (
    ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"),  # how an idle OpenMP thread waits
    ("OMP_NUM_THREADS",),
)
THREAD_VARIABLES: tuple[str, ...] = tuple(name for group in _GROUPS for name in group)

# Names of the variables kvserve set (comma-separated), so a spawned process can tell them apart.
APPLIED_MARKER = "KVSERVE_THREAD_DEFAULTS"


# The defaults torch was loaded with where they were set only while it loaded (the offline API).
_LOADED_WITH: dict[str, str] = {}


def _group(name: str) -> tuple[str, ...]:
    return next((group for group in _GROUPS if name in group), (name,))


def thread_defaults_for(environ: Mapping[str, str]) -> dict[str, str]:
    """The `THREAD_DEFAULTS` that apply to `environ`: those no variable of whose group is set."""
    return {
        name: value
        for name, value in THREAD_DEFAULTS.items()
        if not any(other in environ for other in _group(name))
    }


def apply_thread_defaults() -> dict[str, str]:
    """Set `thread_defaults_for(os.environ)` in os.environ (and `APPLIED_MARKER`); returns what was
    set. Does nothing once torch is imported: OpenMP has read its variables, and a change would reach
    only child processes, which would then run differently from this one."""
    if "torch" in sys.modules:
        return {}
    applied = thread_defaults_for(os.environ)
    os.environ.update(applied)
    if applied:
        os.environ[APPLIED_MARKER] = ",".join(applied)
    return applied


@contextlib.contextmanager
def defaults_while_torch_loads() -> Iterator[dict[str, str]]:
    """Around the import that loads torch: the defaults are in os.environ inside, and removed again
    after (a library does not change its host's environment for good)."""
    applied = apply_thread_defaults()
    try:
        yield applied
    finally:
        for name in [*applied, APPLIED_MARKER] if applied else []:
            os.environ.pop(name, None)
        _LOADED_WITH.update(applied)


@contextlib.contextmanager
def spawn_environment() -> Iterator[None]:
    """Around starting a process that imports torch: os.environ carries the defaults this process's
    torch was loaded with, also where they were set only while it loaded."""
    missing = {name: value for name, value in _LOADED_WITH.items() if name not in os.environ}
    if missing and APPLIED_MARKER not in os.environ:
        missing[APPLIED_MARKER] = ",".join(missing)
    os.environ.update(missing)
    try:
        yield
    finally:
        for name in missing:
            os.environ.pop(name, None)


def describe_threads(num_threads: int, environ: Mapping[str, str] | None = None) -> str:
    """e.g. '2 OpenMP threads; OMP_WAIT_POLICY=PASSIVE (kvserve default)': the thread count torch uses
    and every OpenMP variable set in this process, each marked as kvserve's default or the user's."""
    if environ is None:
        loaded = {**_LOADED_WITH, APPLIED_MARKER: ",".join(_LOADED_WITH)} if _LOADED_WITH else {}
        environ = {**loaded, **os.environ}
    ours = set(environ.get(APPLIED_MARKER, "").split(","))
    settings = [
        f"{name}={environ[name]} ({'kvserve default' if name in ours else 'set by user'})"
        for name in THREAD_VARIABLES
        if name in environ
    ]
    return "; ".join([f"{num_threads} OpenMP threads", *(settings or ["libgomp defaults"])])
