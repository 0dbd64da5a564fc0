"""torch.compile's caches: compile from nothing (a cold start) on purpose, and say what the caches did.

``torch.compile`` keeps what it produces so that the next compile of the same graph is cheap:

* on disk, under ``TORCHINDUCTOR_CACHE_DIR`` (default ``/tmp/torchinductor_<user>``): generated code, whole compiled
  graphs (the *FX graph cache*, keyed by the graph, input shapes and dtypes, settings and versions) and autotuning
  results; and under ``TRITON_CACHE_DIR`` (default: a ``triton`` folder inside it): compiled Triton kernels;
* in memory, in this process: Dynamo's compiled frames (``torch.compiler.reset()`` drops them) and Inductor's
  loaded modules, compiled kernels and autotuning choices.

A compile time measured while any of them holds the graph is a warm start, not what a first run on a new machine
pays. :func:`cold` gives a block in which every compile starts from nothing::

    with utils.compile_cache.cold() as cache:
        seconds, _ = utils.bench.first_call(lambda: compiled(x))
        print(cache.status())   # "2 compiled, 0 from cache"
    utils.compile_cache.quiesce()   # compile workers shut down, garbage collected: then time

:func:`graph_counts` reads the FX graph cache's counters at any time, to tell a compile that compiled from one
that loaded a cached graph.

To time several compiled variants together (``utils.bench.compare``) after compiling each one cold, compile them in
``cold(keep_compiled=True)`` blocks: the default block forgets every earlier compile (``torch.compiler.reset()``,
which also drops CUDA graphs), so the variants compiled before it would compile again when called.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: The environment variables that place the on-disk caches (both read when a compile needs them).
CACHE_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")


@dataclass(frozen=True)
class GraphCounts:
    """Graphs Inductor compiled (FX graph cache misses and bypasses) and graphs it loaded from the cache (hits)."""

    compiled: int
    loaded: int

    def __sub__(self, other: GraphCounts) -> GraphCounts:
        return GraphCounts(self.compiled - other.compiled, self.loaded - other.loaded)

    def __str__(self) -> str:
        return f"{self.compiled} compiled, {self.loaded} from cache"


def graph_counts() -> GraphCounts:
    """The FX graph cache's counters of this process so far (``torch._dynamo.utils.counters["inductor"]``).

    Subtract two readings to see what the compiles between them did. A graph whose inputs the cache cannot key
    (a *bypass*) counts as compiled.
    """
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return GraphCounts(inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
                       inductor["fxgraph_cache_hit"])


def clear_in_memory_caches(*, dynamo: bool = True) -> None:
    """Forget the compiles of this process: Dynamo's compiled frames (``torch.compiler.reset()``, unless
    ``dynamo=False``) and Inductor's in-memory caches (loaded modules, compiled kernels, autotuning choices).
    The on-disk caches are left as they are; functions compiled before keep the code they loaded."""
    import torch
    import torch._inductor.utils as inductor_utils

    if dynamo:
        torch.compiler.reset()
    # PyTorch >= 2.8 names it clear_caches; 2.6 and 2.7 clear_inductor_caches
    clear = getattr(inductor_utils, "clear_caches", None) or getattr(inductor_utils, "clear_inductor_caches", None)
    if clear is not None:
        clear()


def quiesce() -> None:
    """Leave the host quiet after compiling, before timing anything: shut down Inductor's compile-worker pools
    (``torch._inductor.async_compile.shutdown_compile_workers``, where this PyTorch has it; a later compile starts
    new ones) and collect the garbage a compile leaves behind. Functions compiled before keep working: their code
    is loaded, and the workers only compile."""
    import gc

    import torch._inductor.async_compile as async_compile

    shutdown = getattr(async_compile, "shutdown_compile_workers", None)
    if shutdown is not None:
        shutdown()
    gc.collect()


@dataclass
class ColdCache:
    """The empty cache directory of a :func:`cold` block, and what the compiles inside it did."""

    directory: Path
    _start: GraphCounts = field(default_factory=graph_counts, repr=False)

    def counts(self) -> GraphCounts:
        """Graphs compiled and loaded from the cache since the block began."""
        return graph_counts() - self._start

    def status(self) -> str:
        """'2 compiled, 0 from cache': what the compiles since the block began did."""
        return str(self.counts())

    def files(self) -> list[Path]:
        """The files the compiles wrote into the cache so far."""
        return [p for p in self.directory.rglob("*") if p.is_file()]

    def size_bytes(self) -> int:
        """Bytes of the files in the cache now (a file that a compile worker removes meanwhile counts as 0)."""
        total = 0
        for p in self.files():
            with contextlib.suppress(FileNotFoundError):
                total += p.stat().st_size
        return total


@contextlib.contextmanager
def cold(*, keep: bool = False, keep_compiled: bool = False,
         parent: str | Path | None = None) -> Iterator[ColdCache]:
    """A block in which every compile starts cold: in-memory caches cleared (Dynamo and Inductor), and both on-disk
    caches (``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR``) pointed at a new, empty directory.

    On leaving, the variables get their previous values back (or are unset again), Inductor's in-memory caches
    are cleared once more (nothing later reuses what was compiled inside) and the directory is deleted unless
    ``keep=True``. Functions compiled inside keep working afterwards (their code is loaded, and Dynamo's frames
    are kept); a recompile of one of them happens in the restored cache.

    Inside, a second compile of the same graph after ``torch.compiler.reset()`` is a *warm* start from this block's
    directory: that is how to measure the two against each other.

    Args:
        keep: leave the directory on disk (its path is ``.directory``), e.g. to read the generated code later.
        keep_compiled: leave Dynamo's compiled frames (no ``torch.compiler.reset()``; Inductor's in-memory caches
            are still cleared), so that functions compiled before the block keep running without compiling again.
            A new compile inside still starts from nothing, unless Dynamo finds an earlier one of the same code
            whose guards pass (same backend and mode, same shapes): then nothing compiles, which ``counts()``
            shows. Dynamo also remembers the sizes a function was compiled at: compiling it at new sizes may mark
            them dynamic (``torch._dynamo.config.automatic_dynamic_shapes``).
        parent: where to create the directory (default: the system's temporary directory).

    Raises:
        FileNotFoundError: if ``parent`` does not exist.
    """
    if parent is not None and not Path(parent).is_dir():
        raise FileNotFoundError(f"cold(): parent directory {parent} does not exist")
    directory = Path(tempfile.mkdtemp(prefix="cold_compile_", dir=parent))
    saved = {name: os.environ.get(name) for name in CACHE_VARIABLES}
    clear_in_memory_caches(dynamo=not keep_compiled)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(directory)
    os.environ["TRITON_CACHE_DIR"] = str(directory / "triton")
    try:
        yield ColdCache(directory)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        clear_in_memory_caches(dynamo=False)
        if not keep:
            shutil.rmtree(directory, ignore_errors=True)
