"""A run's train step compiled with the libtpu flag set `posttrain compile` chose for its plan.

libtpu reads `LIBTPU_INIT_ARGS` once per process, for every program. `posttrain compile` instead
tries the async collective set (`posttrain._collectives.TPU_OPTIONS`) on each program as compile
options and compiles without it where the compiler refuses; `FlagChosenStep` does the same for a
run's train step, so the program a run executes is the one the plan reported. Where the user
set `LIBTPU_INIT_ARGS`, or off TPU, the step is the plain jitted one.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import jax

from posttrain._collectives import compile_choosing_flags

log = logging.getLogger("posttrain")


class FlagChosenStep:
    """`jitted(*args)`, each new argument signature (shapes, dtypes, shardings) lowered and
    compiled once with `options` (None: the async collective set), or without them where the
    compiler refuses; `flags` says which, and the choice is logged once per signature."""

    def __init__(self, jitted, options: dict | None = None, **names):
        self.jitted, self.options, self.names = jitted, options, names  # (label=, what=)
        self.flags = ""
        self._compiled: dict = {}

    def __call__(self, *args):
        leaves, tree = jax.tree.flatten(args)
        key = (tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
        compiled = self._compiled.get(key)
        if compiled is None:
            lowered = self.jitted.lower(*args)
            compiled, self.flags = compile_choosing_flags(
                lambda options: lowered.compile(compiler_options=options), self.options,
                **self.names,
            )  # fmt: skip
            self._compiled[key] = compiled
            log.info("train step compiled with libtpu flags: %s", self.flags)
        return compiled(*args)


def with_chosen_flags(jitted) -> Callable:
    """`FlagChosenStep(jitted)` on TPU unless `LIBTPU_INIT_ARGS` sets the flags for the whole
    process; `jitted` itself elsewhere."""
    if jax.default_backend() != "tpu" or os.environ.get("LIBTPU_INIT_ARGS"):
        return jitted
    return FlagChosenStep(jitted)
