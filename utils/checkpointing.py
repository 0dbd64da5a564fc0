"""Activation checkpointing, full or selective, with what backward recomputes counted.

:class:`ActivationCheckpointing` runs chosen modules under ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)`` for the length of a ``with`` block, optionally keeping the outputs of named operators
(selective checkpointing), and counts what the forward pass kept and what backward ran again.
:class:`OpCounter` counts the ATen operators that run inside a block, as PyTorch dispatches them — the names a
selective policy must use (:func:`op_name`, :func:`is_matmul`, :data:`MATMUL_OPS`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen matrix multiplies: the ops a "keep the matmuls" selective-checkpointing policy names.
MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_mm"})

#: ATen fused attention (``F.scaled_dot_product_attention``'s kernels, two matmuls and a softmax each). They are
#: not in :data:`MATMUL_OPS`, so a "keep the matmuls" policy recomputes attention in backward; add their overloads
#: (from :meth:`OpCounter.attention`) to ``save`` to keep it too, as LLM training code usually does.
ATTENTION_OPS = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_fused_attention_overrideable"})


def op_name(op: Any) -> str:
    """'aten.addmm.default' for an OpOverload, 'aten.addmm' for an OpOverloadPacket, else str()."""
    name = getattr(op, "_name", None) or str(op)  # OpOverloadPacket._name: 'aten::addmm'
    overload = getattr(op, "_overloadname", None)
    name = name.replace("::", ".")
    return f"{name}.{overload}" if overload and not name.endswith(f".{overload}") else name


def _is_view(op: Any) -> bool:
    return bool(getattr(op, "is_view", False))


def is_matmul(op: Any) -> bool:
    """True for an ATen matrix multiply (an overload of one of :data:`MATMUL_OPS`)."""
    packet = getattr(op, "overloadpacket", op)
    return getattr(packet, "__name__", "").split(".")[-1] in MATMUL_OPS


def is_attention(op: Any) -> bool:
    """True for an ATen fused attention kernel (an overload of one of :data:`ATTENTION_OPS`)."""
    packet = getattr(op, "overloadpacket", op)
    return getattr(packet, "__name__", "").split(".")[-1] in ATTENTION_OPS


class OpCounter(TorchDispatchMode):
    """Count the ATen operators that run inside a ``with`` block, by overload (``aten.addmm.default``)::

        with utils.checkpointing.OpCounter() as ops:
            model(x)
        ops.matmuls()   # {aten.addmm.default: 7, aten.mm.default: 2}

    A ``TorchDispatchMode``: it sees the operators as PyTorch dispatches them, after composite ones such as
    ``linear`` have been decomposed — which is what a selective-checkpointing policy sees too.
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] += 1
        return func(*args, **(kwargs or {}))

    def matmuls(self) -> dict[Any, int]:
        return {op: n for op, n in self.counts.items() if is_matmul(op)}

    def attention(self) -> dict[Any, int]:
        """The fused attention kernels that ran (:data:`ATTENTION_OPS`), by overload."""
        return {op: n for op, n in self.counts.items() if is_attention(op)}

    def compute_ops(self) -> Counter:
        """The counts without view and aliasing operators (views, detach, ...), which move no data."""
        return Counter({op: n for op, n in self.counts.items() if not _is_view(op)})


class ActivationCheckpointing:
    """Run ``modules`` under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` inside a ``with``
    block, optionally selective, and count what backward recomputes::

        ac = ActivationCheckpointing(model.encoder.layers, save=[torch.ops.aten.addmm.default])
        with ac:
            loss = step()
        ac.recomputed_matmuls()   # 0: the policy kept them
        ac.unmatched()            # named ops that never ran: a policy that matches nothing recomputes everything

    Each module's ``forward`` is replaced, for the block only, by a checkpointed call of the original: the module,
    its weights and its ``state_dict`` stay as they are. Without ``save`` every activation inside each module is
    recomputed in backward (full checkpointing); with ``save`` (ATen overloads, e.g. ``torch.ops.aten.mm.default``)
    the outputs of those operators are kept and the rest recomputed (selective checkpointing,
    ``torch.utils.checkpoint.create_selective_checkpoint_contexts``). A policy receives the overload
    (``aten.mm.default``); a name that never matches — the packet ``torch.ops.aten.mm``, or ``aten.linear.default``,
    which is decomposed before dispatch — silently saves nothing: :meth:`unmatched` lists such names.

    Counting: ``saved`` holds the operators whose outputs the policy kept during forward; ``recomputed`` the
    operators backward ran again, seen by an :class:`OpCounter` placed under the selective-checkpointing cache, so
    an output served from the cache is not counted. ``reset()`` clears both. The counter is a Python dispatch mode
    that every recomputed operator passes through, which costs host time: set ``counting = False`` (or pass
    ``counting=False``) before timing steps, so that the time measured is checkpointing's own.
    """

    def __init__(self, modules: Iterable[torch.nn.Module], *, save: Iterable[Any] | None = None,
                 counting: bool = True) -> None:
        self.modules = list(modules)
        if not self.modules:
            raise ValueError("ActivationCheckpointing needs at least one module")
        self.save = None if save is None else list(save)
        self.counting = counting
        self.saved: Counter = Counter()
        self.recomputed: Counter = Counter()
        self._patched: list[torch.nn.Module] = []

    @property
    def selective(self) -> bool:
        return self.save is not None

    def reset(self) -> None:
        self.saved.clear()
        self.recomputed.clear()

    def _policy(self, ctx, op, *args, **kwargs):
        from torch.utils.checkpoint import CheckpointPolicy

        keep = op in self.save  # type: ignore[operator]
        if keep and not getattr(ctx, "is_recompute", False):
            self.saved[op] += 1
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    def _contexts(self):
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        if self.selective:
            forward_ctx, recompute_ctx = create_selective_checkpoint_contexts(self._policy)
        else:
            forward_ctx, recompute_ctx = nullcontext(), nullcontext()
        if not self.counting:
            return forward_ctx, recompute_ctx
        counter = OpCounter()

        @contextmanager
        def recompute():
            try:  # the counter first, then the cache on top of it: cached outputs never reach the counter
                with counter, recompute_ctx:
                    yield
            finally:  # checkpoint stops a recomputation early by raising through this block
                self.recomputed.update(counter.counts)

        return forward_ctx, recompute()

    def __enter__(self) -> ActivationCheckpointing:
        from torch.utils.checkpoint import checkpoint

        for module in self.modules:
            if "forward" in module.__dict__:
                raise RuntimeError(f"{type(module).__name__}.forward is already replaced (nested checkpointing?)")
            original = module.forward

            def forward(*args, _original=original, **kwargs):
                if not torch.is_grad_enabled():  # nothing to save for backward: plain forward
                    return _original(*args, **kwargs)
                return checkpoint(_original, *args, use_reentrant=False, context_fn=self._contexts, **kwargs)

            module.forward = forward
            self._patched.append(module)
        return self

    def __exit__(self, *exc) -> None:
        for module in self._patched:
            del module.forward  # the class's forward again
        self._patched.clear()

    def recomputed_matmuls(self) -> int:
        return sum(n for op, n in self.recomputed.items() if is_matmul(op))

    def recomputed_attention(self) -> int:
        return sum(n for op, n in self.recomputed.items() if is_attention(op))

    def recomputed_compute_ops(self) -> int:
        """Recomputed operators other than views (which move no data)."""
        return sum(n for op, n in self.recomputed.items() if not _is_view(op))

    def unmatched(self) -> list[str]:
        """Names in ``save`` that matched no operator during the forward passes since the last ``reset()``."""
        if not self.selective:
            return []
        return [op_name(op) for op in self.save if self.saved[op] == 0]  # type: ignore[union-attr]


def count_recomputation(modules: Iterable[torch.nn.Module], run: Any,
                        policies: dict[str, Iterable[Any] | None]) -> dict[str, dict[str, object]]:
    """For each policy (name → the ``save`` of :class:`ActivationCheckpointing`: None for full checkpointing, or
    the operators to keep), run ``run()`` — a forward and backward pass — with ``modules`` checkpointed under it,
    and count what backward recomputed. Returns name → a table row: the matmuls, the fused attention kernels and
    the operators recomputed (views left out), and the names the policy gave that matched no operator."""
    modules = list(modules)
    rows: dict[str, dict[str, object]] = {}
    for name, save in policies.items():
        ac = ActivationCheckpointing(modules, save=save)
        with ac:
            run()
        rows[name] = {"policy": name, "matmuls recomputed": ac.recomputed_matmuls(),
                      "attention recomputed": ac.recomputed_attention(),
                      "operators recomputed": ac.recomputed_compute_ops(),
                      "named but never matched": ", ".join(ac.unmatched()) or "—"}
    return rows


def check_policies(rows: dict[str, dict[str, object]], *, full: str, selective: str, slip: str | None = None) -> str:
    """Read :func:`count_recomputation`'s rows: full checkpointing must recompute matmuls, a policy that keeps them
    (``selective``) none, and a policy with the classic slip (``slip``: packets such as ``torch.ops.aten.mm``
    where the policy receives overloads) exactly as many as full checkpointing — it matches nothing. Returns the
    sentence that says what was checked.

    Raises:
        AssertionError: when a count says otherwise.
    """
    matmuls = {name: int(row["matmuls recomputed"]) for name, row in rows.items()}  # type: ignore[call-overload]
    assert matmuls[full] > 0, f"{full}: backward recomputed no matmul, so nothing was checkpointed"
    assert matmuls[selective] == 0, f"{selective}: backward recomputed {matmuls[selective]} matmuls it should keep"
    text = (f"✅ {selective}: no matmul recomputed, against {matmuls[full]} under {full}, and "
            f"{rows[selective]['operators recomputed']} of {rows[full]['operators recomputed']} operators.")
    if slip is not None:
        assert matmuls[slip] == matmuls[full], (f"{slip}: {matmuls[slip]} matmuls recomputed, not the "
                                                f"{matmuls[full]} of full checkpointing")
        text += (f" {slip}: matches nothing, so it recomputes all {matmuls[slip]} matmuls, as full checkpointing "
                 "does, without an error: count what a policy recomputes.")
    return text


def record_overhead(comparison: Any, figures: dict[str, str], *, against: str | None = None) -> None:
    """Record each variant's step-time overhead over ``against`` (default: the comparison's baseline), in percent,
    from the same rounds: ``100 × (1 / speed-up − 1)`` with the verdict's band, e.g.
    ``record_overhead(steps, {"checkpointing_step_overhead_pct": "checkpointing"})`` (``utils.results.record``)."""
    from utils import results

    for name, variant in figures.items():
        v = comparison.verdict(variant, against=against)
        low, high = v.band
        results.record(name, 100 * (1 / v.speedup - 1), "%", band=(100 * (1 / high - 1), 100 * (1 / low - 1)))


def costlier_in_16_bits(comparison: Any, *, fp32: tuple[str, str], low: tuple[str, str]) -> str | None:
    """Checkpointing's added time per step under 16-bit autocast against in fp32, from one comparison's rounds.

    ``fp32`` and ``low``: (without, with) checkpointing, each a pair of variants of ``comparison``. The recompute
    runs the same layers in both, and their 16-bit matmuls are faster, so it should add no more time in 16 bits
    than in fp32. Returns a sentence with both added times when the 16-bit one is resolvably larger (its band,
    from :class:`utils.bench.Verdict`, lies wholly above fp32's), else None. A profile then shows where the time
    went: a step that waits on the host pays every relaunched kernel of the recompute in full."""
    from utils.bench import format_seconds

    def added(pair: tuple[str, str]) -> tuple[float, float, float]:
        without, with_ = pair
        verdict, base = comparison.verdict(with_, against=without), comparison.time_s(without)
        lo, hi = verdict.band
        return base * (1 / verdict.speedup - 1), base * (1 / hi - 1), base * (1 / lo - 1)

    (full, _, full_high), (half, half_low, _) = added(fp32), added(low)
    if half_low <= full_high:
        return None
    return (f"checkpointing added {format_seconds(half)} per step under 16-bit autocast, against "
            f"{format_seconds(full)} in fp32, though its recomputed matmuls ran in 16 bits")
