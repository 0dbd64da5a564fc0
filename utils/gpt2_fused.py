"""GPT-2's decode step in five Triton kernels per layer (notebooks 08 and 09).

At batch 1 a decode step multiplies one vector by every weight matrix. Compiled by ``torch.compile`` and replayed
from a CUDA graph, GPT-2 small's step still runs about 15 kernels per layer (norms, four matrix-vector products,
bias adds, the cache writes, attention, GELU, residual adds), and each is too short to reach the memory's
bandwidth: the kernels' fixed costs, not the bytes, set the step. This module runs a layer in five kernels:

1. :data:`gemv_kernel` with ``LN``: LayerNorm of the residual stream (every program recomputes the row's
   statistics, which costs less than another kernel) → the fused Q, K, V projection + bias.
2. :data:`decode_attention_kernel`: one query per head against the cached keys and values, the positions shared
   among a few programs per head (flash-decoding); the new token's own key and value come from registers and are
   written into the cache.
3. :data:`gemv_kernel` with ``COMBINE_SPLITS`` and ``RESIDUAL``: the attention splits combined → the output
   projection + bias, added into the residual stream in place.
4. :data:`gemv_kernel` with ``LN`` and ``GELU``: LayerNorm → the MLP's first projection + bias → GELU (tanh).
5. :data:`gemv_kernel` with ``RESIDUAL``: the MLP's second projection + bias, added into the residual stream.

Around the layers: :data:`embed_kernel` (token + position embeddings), the final LayerNorm and the tied head (one
more :data:`gemv_kernel`, which also keeps each program's largest logit) and :data:`pick_kernel` (the greedy token
from those candidates, written out, and the position advanced): 63 kernels for GPT-2 small, no torch op.

Two things make the kernels short. Each program of :data:`gemv_kernel` loads its whole share of the weights — a
few rows, all of ``K`` — in one go, with enough programs to give every multiprocessor about two. And on Hopper and
later GPUs, *programmatic dependent launch* (PDL) lets each kernel start while the one before it is finishing: it
loads what no earlier kernel writes (its weights, bias and norm parameters) and only then waits
(``griddepcontrol.wait``) for the previous kernel's results. The weights of the next projection stream in while
the current one ends, so the launch gaps and the first loads' latency overlap work instead of adding to it.

The residual stream, the projections' outputs and the logits are fp32; the weights and the KV cache stay in the
model's type. Every product accumulates in fp32 and rounds once.

:class:`FusedDecodeStep` is a drop-in for the model's forward on one new token per sequence with a
:class:`utils.gpt2.StaticKVCache`; ``utils.gpt2.StaticDecoder(model, ..., fused_step=True)`` captures its greedy
step in a CUDA graph like the other steps. Its buffers are allocated on the first call for a batch size and reused
after, so a graph captured after that first call stays valid.

Triton compiles for CUDA GPUs. On a machine without one its interpreter runs the same kernels on CPU tensors
(numpy underneath, no bf16, no PDL) when ``TRITON_INTERPRET=1`` was set before the first ``import triton`` in the
process; ``tests/test_gpt2_fused.py`` checks the kernels that way and, on a GPU, compiled.
"""

from __future__ import annotations

import os

import torch

try:  # Triton ships with CUDA builds of torch on Linux
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None
try:  # programmatic dependent launch (Hopper and later): Triton 3.4+
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

TRITON_INTERPRETED = triton is not None and os.environ.get("TRITON_INTERPRET") == "1"
"""True when Triton runs its CPU interpreter (TRITON_INTERPRET=1 was set before triton was first imported)."""

if triton is not None:

    @triton.jit
    def gemv_kernel(x_ptr, w_ptr, b_ptr, scale_ptr, out_ptr, ln_w_ptr, ln_b_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                      best_val_ptr, best_idx_ptr, N, eps, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      HAS_SCALE: tl.constexpr, LN: tl.constexpr,
                      COMBINE_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, GELU: tl.constexpr,
                      RESIDUAL: tl.constexpr, ARGMAX: tl.constexpr, PDL: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
        # One program: BLOCK_N outputs of row `row`, out[row, n] = sum_k f(x[row])[k] * w[n, k] (+ b[n]), where f
        # is LayerNorm when LN; then GELU (tanh) when GELU; added to out[row, n] (the residual stream) when RESIDUAL.
        # x, out: [rows, K] / [rows, N], contiguous; w: [N, K] as nn.Linear stores it (K contiguous: coalesced).
        # HAS_SCALE: w is int8 with one scale per output (w ≈ q * scale[:, None]): the tile is loaded as int8 (1 byte
        # a weight), widened in registers, and the scale applied to each output's sum.
        # COMBINE_SPLITS > 0: x is not read; its row is attention's output, combined here from the partial results
        # of decode_attention_kernel's splits. ARGMAX: the program's largest output and its index are written to
        # best_val_ptr / best_idx_ptr. The program's whole tile, BLOCK_N x K (BLOCK_K >= K), is one load.
        # PDL (programmatic dependent launch, Hopper on): the next kernel may start once every program is running,
        # and this one reads what no earlier kernel writes (weights, bias, norm) before waiting for the one before.
        if PDL:
            gdc_launch_dependents()
        row = tl.program_id(1)
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = cols < N
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < K
        w = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
        if HAS_SCALE:
            scale = tl.load(scale_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)
        if LN:
            gamma = tl.load(ln_w_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
            beta = tl.load(ln_b_ptr + ks, mask=k_ok, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()  # what the kernels before this one wrote is visible from here on
        if COMBINE_SPLITS > 0:  # softmax-weighted sum of the splits' partial outputs, per head
            splits = tl.arange(0, COMBINE_SPLITS)
            part = ((row * K + ks) // HEAD_DIM)[:, None] * COMBINE_SPLITS + splits[None, :]  # [BLOCK_K, SPLITS]
            part_m = tl.load(part_m_ptr + part, mask=k_ok[:, None], other=0.0)
            weight = tl.exp(part_m - tl.max(part_m, axis=1)[:, None])  # a split that saw nothing: m = -inf
            denom = tl.sum(weight * tl.load(part_l_ptr + part, mask=k_ok[:, None], other=1.0), axis=1)
            numer = tl.load(part_acc_ptr + part * HEAD_DIM + (ks % HEAD_DIM)[:, None], mask=k_ok[:, None], other=0.0)
            xk = tl.where(k_ok, tl.sum(weight * numer, axis=1) / denom, 0.0)
        else:
            xk = tl.load(x_ptr + row * K + ks, mask=k_ok, other=0.0).to(tl.float32)
        if RESIDUAL:
            residual = tl.load(out_ptr + row * N + cols, mask=n_ok, other=0.0)
        if LN:  # the row's statistics, in every program: K floats from L2 cost less than a kernel launch
            mean = tl.sum(xk, axis=0) / K
            centred = tl.where(k_ok, xk - mean, 0.0)
            rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / K + eps)
            xk = tl.where(k_ok, centred * rstd * gamma + beta, 0.0)
        y = tl.sum(w.to(tl.float32) * xk[None, :], axis=1)
        if HAS_SCALE:
            y = y * scale
        if HAS_BIAS:
            y += bias
        if GELU:  # 0.5 y (1 + tanh(u)) == y * sigmoid(2u), u = sqrt(2/pi) (y + 0.044715 y^3)
            y = y * tl.sigmoid(1.5957691216057308 * (y + 0.044715 * y * y * y))
        if RESIDUAL:
            y += residual
        tl.store(out_ptr + row * N + cols, y, mask=n_ok)
        if ARGMAX:  # the greedy token's candidates: this program's best output (the first, among equal ones)
            y = tl.where(n_ok, y, float("-inf"))
            best = row * tl.num_programs(0) + tl.program_id(0)
            tl.store(best_val_ptr + best, tl.max(y, axis=0))
            tl.store(best_idx_ptr + best, tl.program_id(0) * BLOCK_N + tl.argmax(y, axis=0))

    @triton.jit
    def decode_attention_kernel(qkv_ptr, k_cache_ptr, v_cache_ptr, part_m_ptr, part_l_ptr, part_acc_ptr, pos_ptr, C,
                                cache_batch_stride, cache_head_stride, scale, D: tl.constexpr, SPLITS: tl.constexpr,
                                BLOCK_T: tl.constexpr, ITERS: tl.constexpr, PDL: tl.constexpr):
        # One program: split `s` of head `h` of sequence `b` (flash-decoding: the positions before `pos` are shared
        # among SPLITS programs per head, so that more multiprocessors read the cache). qkv: [B, 3C] fp32, Q, K, V
        # of the new token; the caches: [B, H, max_len, D] of this layer. Split 0 also takes the new token (position
        # pos) from registers and writes its key and value into the cache for the steps after this one. Each split
        # leaves its running maximum, softmax denominator and weighted sum of values; gemv_kernel combines them.
        if PDL:  # everything here depends on the kernel before: let the next one start loading its weights
            gdc_launch_dependents()
            gdc_wait()
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.program_id(2)
        pos = tl.load(pos_ptr)
        d = tl.arange(0, D)
        new = qkv_ptr + b * 3 * C + h * D
        q = tl.load(new + d) * scale
        k_new = tl.load(new + C + d)
        v_new = tl.load(new + 2 * C + d)
        k_head = k_cache_ptr + b * cache_batch_stride + h * cache_head_stride
        v_head = v_cache_ptr + b * cache_batch_stride + h * cache_head_stride
        first = s == 0
        m = tl.where(first, tl.sum(q * k_new, axis=0), float("-inf"))  # running maximum of the scores
        denom = tl.where(first, 1.0, 0.0)  # running sum of exp(score - m)
        acc = tl.where(first, v_new, 0.0)  # running sum of exp(score - m) * value
        chunk = tl.cdiv(pos, SPLITS)
        lo = s * chunk
        hi = tl.minimum(lo + chunk, pos)
        # ITERS x BLOCK_T covers the longest split the cache allows: a fixed trip count (compile-time), the positions
        # past `hi` masked off — a split with nothing to read keeps m = -inf, denominator 0, sum 0
        for i in range(ITERS):
            ts = lo + i * BLOCK_T + tl.arange(0, BLOCK_T)
            t_ok = ts < hi
            k = tl.load(k_head + ts[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            v = tl.load(v_head + ts[:, None] * D + d[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            scores = tl.where(t_ok, tl.sum(k * q[None, :], axis=1), float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=0))
            shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: exp(-inf - 0) = 0, no NaN
            alpha = tl.exp(m - shift)
            p = tl.exp(scores - shift)
            denom = denom * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m = m_new
        part = (b * tl.num_programs(1) + h) * SPLITS + s
        tl.store(part_m_ptr + part, m)
        tl.store(part_l_ptr + part, denom)
        tl.store(part_acc_ptr + part * D + d, acc)
        tl.store(k_head + pos * D + d, k_new.to(k_cache_ptr.dtype.element_ty), mask=first & (d < D))
        tl.store(v_head + pos * D + d, v_new.to(v_cache_ptr.dtype.element_ty), mask=first & (d < D))

    @triton.jit
    def pick_kernel(best_val_ptr, best_idx_ptr, programs, token_ptr, token_stride, out_ptr, out_stride, pos_ptr,
                    BATCH: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
        # One program for the whole batch: each row's greedy token from the head's per-program candidates (the
        # first of equal maxima, as torch.argmax), written as the next input token and into the output at pos + 1;
        # then the position advances. What StaticDecoder's step does with torch ops, in one launch.
        if PDL:
            gdc_wait()
        pos = tl.load(pos_ptr)
        offs = tl.arange(0, BLOCK_P)
        ok = offs < programs
        for b in tl.static_range(BATCH):
            vals = tl.load(best_val_ptr + b * programs + offs, mask=ok, other=float("-inf"))
            winner = tl.argmax(vals, axis=0)
            token = tl.load(best_idx_ptr + b * programs + winner).to(tl.int64)
            tl.store(token_ptr + b * token_stride, token)
            tl.store(out_ptr + b * out_stride + pos + 1, token)
        tl.store(pos_ptr, pos + 1)

    @triton.jit
    def embed_kernel(token_ptr, token_stride, pos_ptr, wte_ptr, wpe_ptr, out_ptr, C, BLOCK_C: tl.constexpr,
                     PDL: tl.constexpr):
        # out[b] = wte[token[b]] + wpe[pos], fp32: the residual stream of sequence b
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
        b = tl.program_id(0)
        offs = tl.arange(0, BLOCK_C)
        ok = offs < C
        token = tl.load(token_ptr + b * token_stride)
        pos = tl.load(pos_ptr)
        x = tl.load(wte_ptr + token * C + offs, mask=ok, other=0.0).to(tl.float32)
        x += tl.load(wpe_ptr + pos * C + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + b * C + offs, x, mask=ok)

else:  # pragma: no cover
    gemv_kernel = decode_attention_kernel = pick_kernel = embed_kernel = None


MAX_TILE = 16384
"""The most weights one program of :data:`gemv_kernel` loads (its whole tile at once: 64 per thread at 8 warps)."""


def _blocks(n: int, k: int, programs_wanted: int) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) of :data:`gemv_kernel` for ``n`` outputs of a ``k``-long product: the whole
    ``k`` in one tile (BLOCK_K, a power of two), and as few outputs per program (BLOCK_N, at least 2) as give about
    ``programs_wanted`` programs per row, within :data:`MAX_TILE` weights a program."""
    def floor_pow2(v: int) -> int:
        return 1 << (max(v, 1).bit_length() - 1)
    block_k = triton.next_power_of_2(k)
    block_n = max(2, min(floor_pow2(-(-n // programs_wanted)), MAX_TILE // block_k))
    return block_n, block_k, 8 if block_n * block_k >= 8192 else 4


def _scale(linear) -> torch.Tensor | None:
    """The per-output scales of a linear layer with int8 weights; None for one in the model's dtype."""
    return linear.scale if linear.weight.dtype == torch.int8 else None


def _check_linear(name: str, linear, dtype: torch.dtype) -> None:
    """A block's linear layer the step can run: weights in the model's dtype, or int8 with one scale per output."""
    weight = linear.weight
    if weight.dtype == torch.int8:
        scale = getattr(linear, "scale", None)
        if not isinstance(scale, torch.Tensor) or scale.shape != (weight.shape[0],):
            raise ValueError(f"FusedDecodeStep: {name} has int8 weights {list(weight.shape)} but no `scale` of one "
                             f"value per output ([{weight.shape[0]}]); got {getattr(scale, 'shape', scale)}")
    elif weight.dtype != dtype:
        raise ValueError(f"FusedDecodeStep: {name}'s weights are {weight.dtype}, the model's {dtype} "
                         "(or int8 with a `scale` per output)")


def attention_blocks(max_len: int) -> dict[str, int]:
    """SPLITS, BLOCK_T, ITERS and num_warps of :data:`decode_attention_kernel` for a cache of ``max_len`` positions: a
    split per 64 positions (a power of two, at most 8), blocks of up to 128 positions, and as many blocks (ITERS) as
    the longest split needs.

    On an H100, GPT-2 small with a 384-position cache took 233 µs a token with 4 splits, 245 µs with 2 and 258 µs
    with 1: fewer positions per program shorten the kernel more than combining the splits costs."""
    splits = min(8, 1 << (max(1, max_len // 64).bit_length() - 1))
    longest = -(-max_len // splits)  # the most positions one split reads
    block_t = min(128, max(16, triton.next_power_of_2(longest)))
    return {"SPLITS": splits, "BLOCK_T": block_t, "ITERS": -(-longest // block_t), "num_warps": 4}


class FusedDecodeStep:
    """The forward pass of :class:`utils.gpt2.GPT2` for one new token per sequence, in Triton kernels.

    ``step(idx [B, 1], input_pos [1], cache)`` → logits [B, 1, vocab] (fp32), as ``model(idx, input_pos, cache)``
    returns them, and writes the new keys and values into ``cache`` (a :class:`utils.gpt2.StaticKVCache` in the
    model's dtype, filled up to ``input_pos`` by the prompt's forward pass). ``step.greedy(token, pos, cache,
    out)`` is a whole greedy decode step: the same forward pass, then each row's argmax written into ``token`` and
    into ``out`` at ``pos + 1``, and ``pos`` advanced by one, with no torch op in between (the argmax is taken per
    program inside the head's kernel and finished by one small kernel). The position stays on the device: the
    kernels read it there, so either can be captured in a CUDA graph and replayed at every position.

    The model's weights are used in place (no copy): change them and the step changes too. A block's linear layer
    may hold int8 weights instead, with one scale per output (a ``weight`` int8 [N, K] and a ``scale`` [N], as
    int8 weight-only quantization stores them, ``weight ≈ q * scale[:, None]``): its kernel then reads 1 byte a
    weight and applies the scale to each output. Embeddings, norms and the tied head stay in the model's dtype.

    Raises:
        RuntimeError: Triton is not installed.
        ValueError: CPU tensors without Triton's interpreter; a model or cache this step cannot run (a head size
            that is not a power of two, weights that are not contiguous, a cache of another type or batch).
    """

    def __init__(self, model, *, pdl: bool | None = None, programs_per_sm: int = 2) -> None:
        if triton is None:
            raise RuntimeError("FusedDecodeStep: Triton is not installed (it ships with CUDA builds of PyTorch on "
                               "Linux: pip install triton)")
        param = next(model.parameters())
        if param.device.type == "cpu" and not TRITON_INTERPRETED:
            raise ValueError("FusedDecodeStep: Triton compiles for CUDA GPUs; for a model on the CPU set "
                             "TRITON_INTERPRET=1 before the first `import triton` in the process (its interpreter)")
        if param.device.type not in ("cpu", "cuda"):
            raise ValueError(f"FusedDecodeStep: the kernels run on CUDA (or CPU in Triton's interpreter), not "
                             f"{param.device}")
        config = model.config
        if config.head_dim & (config.head_dim - 1):
            raise ValueError(f"FusedDecodeStep: the head size must be a power of two, got {config.head_dim}")
        if not all(t.is_contiguous() for t in (*model.parameters(), *model.buffers())):
            raise ValueError("FusedDecodeStep: the model's weights must be contiguous (model.to() keeps them so)")
        for i, block in enumerate(model.h):
            for name, linear in (("attn.c_attn", block.attn.c_attn), ("attn.c_proj", block.attn.c_proj),
                                 ("mlp.c_fc", block.mlp["c_fc"]), ("mlp.c_proj", block.mlp["c_proj"])):
                _check_linear(f"h.{i}.{name}", linear, param.dtype)
        if 2 * triton.next_power_of_2(4 * config.n_embd) > MAX_TILE:
            raise ValueError(f"FusedDecodeStep: a width of {config.n_embd} is too wide for one tile per program "
                             f"(the MLP's 4 x {config.n_embd} inputs, two rows, must fit {MAX_TILE} weights)")
        self.model, self.config, self.device, self.dtype = model, config, param.device, param.dtype
        on_gpu = self.device.type == "cuda"
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count if on_gpu else 4
        self.programs_wanted = programs_per_sm * sms
        pdl_here = (on_gpu and gdc_wait is not None and not TRITON_INTERPRETED
                    and torch.cuda.get_device_capability(self.device) >= (9, 0))
        if pdl and not pdl_here:
            raise ValueError("FusedDecodeStep: programmatic dependent launch needs a Hopper or later GPU and "
                             "Triton 3.4 or later (triton.language.extra.cuda.gdc_wait)")
        self.pdl = pdl_here if pdl is None else pdl
        """Whether each kernel lets the next one launch early (and loads its weights before waiting for it)."""
        self._buffers: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def _launch(self) -> dict[str, bool]:
        return {"launch_pdl": True} if self.pdl else {}

    def buffers(self, batch: int, splits: int) -> dict[str, torch.Tensor]:
        """The step's fp32 activations for ``batch`` sequences, allocated once per batch size (and attention split)."""
        if (batch, splits) not in self._buffers:
            c, v, heads = self.config.n_embd, self.config.vocab_size, self.config.n_head
            head_programs = triton.cdiv(v, _blocks(v, c, self.programs_wanted)[0])

            def empty(*shape, dtype=torch.float32):
                return torch.empty(*shape, dtype=dtype, device=self.device)
            self._buffers[batch, splits] = {
                "x": empty(batch, c), "qkv": empty(batch, 3 * c), "h": empty(batch, 4 * c), "logits": empty(batch, v),
                "part_m": empty(batch, heads, splits), "part_l": empty(batch, heads, splits),
                "part_acc": empty(batch, heads, splits, self.config.head_dim),
                "best_val": empty(batch, head_programs), "best_idx": empty(batch, head_programs, dtype=torch.int32)}
        return self._buffers[batch, splits]

    def _linear(self, x, weight, bias, out, buf, *, scale=None, ln=None, gelu=False, residual=False, combine=0,
                argmax=False) -> None:
        rows, n, k = out.shape[0], weight.shape[0], weight.shape[1]
        block_n, block_k, warps = _blocks(n, k, self.programs_wanted)
        ln_w, ln_b = (ln.weight, ln.bias) if ln is not None else (weight, weight)  # unused without LN
        gemv_kernel[(triton.cdiv(n, block_n), rows)](
            x, weight, bias if bias is not None else weight, scale if scale is not None else weight, out, ln_w,
            ln_b, buf["part_m"], buf["part_l"], buf["part_acc"], buf["best_val"], buf["best_idx"], n,
            ln.eps if ln is not None else 0.0, K=k, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None,
            LN=ln is not None, COMBINE_SPLITS=combine, HEAD_DIM=self.config.head_dim,
            GELU=gelu, RESIDUAL=residual, ARGMAX=argmax, PDL=self.pdl, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=warps, **self._launch)

    def _check(self, idx: torch.Tensor, input_pos: torch.Tensor, cache) -> None:
        if idx.dim() != 2 or idx.shape[1] != 1 or idx.dtype != torch.int64:
            raise ValueError(f"FusedDecodeStep decodes one int64 token per sequence, idx [batch, 1]; got {idx.dtype} "
                             f"{list(idx.shape)} (run a prompt through the model itself)")
        if input_pos.shape != (1,) or input_pos.dtype != torch.int64:
            raise ValueError(f"input_pos must be one int64 position [1], got {input_pos.dtype} "
                             f"{list(input_pos.shape)}")
        if not isinstance(getattr(cache, "k", None), torch.Tensor) or not hasattr(cache, "max_len"):
            raise ValueError("FusedDecodeStep needs a utils.gpt2.StaticKVCache (it writes keys and values in place)")
        if cache.k.dtype != self.dtype or cache.k.shape[1] != idx.shape[0] or cache.k.device != self.device:
            raise ValueError(f"the cache ({cache.k.dtype}, batch {cache.k.shape[1]}, {cache.k.device}) must match the "
                             f"model ({self.dtype}, {self.device}) and idx (batch {idx.shape[0]})")
        for name, t in (("idx", idx), ("input_pos", input_pos)):
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device}, the model on {self.device}")

    def _forward(self, idx: torch.Tensor, input_pos: torch.Tensor, cache, *, argmax: bool) -> dict[str, torch.Tensor]:
        self._check(idx, input_pos, cache)
        model, config = self.model, self.config
        batch, c = idx.shape[0], config.n_embd
        blocks = attention_blocks(cache.max_len)
        buf = self.buffers(batch, blocks["SPLITS"])
        x = buf["x"]
        embed_kernel[(batch,)](idx, idx.stride(0), input_pos, model.wte.weight, model.wpe.weight, x, c,
                               BLOCK_C=triton.next_power_of_2(c), PDL=self.pdl, **self._launch)
        scale = config.head_dim ** -0.5
        k_cache, v_cache = cache.k, cache.v
        for i, block in enumerate(model.h):
            attn, mlp = block.attn, block.mlp
            self._linear(x, attn.c_attn.weight, attn.c_attn.bias, buf["qkv"], buf, scale=_scale(attn.c_attn),
                         ln=block.ln_1)
            decode_attention_kernel[(batch, config.n_head, blocks["SPLITS"])](
                buf["qkv"], k_cache[i], v_cache[i], buf["part_m"], buf["part_l"], buf["part_acc"], input_pos, c,
                k_cache.stride(1), k_cache.stride(2), scale, D=config.head_dim, PDL=self.pdl, **blocks, **self._launch)
            self._linear(x, attn.c_proj.weight, attn.c_proj.bias, x, buf, scale=_scale(attn.c_proj), residual=True,
                         combine=blocks["SPLITS"])
            self._linear(x, mlp["c_fc"].weight, mlp["c_fc"].bias, buf["h"], buf, scale=_scale(mlp["c_fc"]),
                         ln=block.ln_2, gelu=True)
            self._linear(buf["h"], mlp["c_proj"].weight, mlp["c_proj"].bias, x, buf, scale=_scale(mlp["c_proj"]),
                         residual=True)
        self._linear(x, model.wte.weight, None, buf["logits"], buf, ln=model.ln_f, argmax=argmax)  # the tied head
        return buf

    def __call__(self, idx: torch.Tensor, input_pos: torch.Tensor, cache) -> torch.Tensor:
        return self._forward(idx, input_pos, cache, argmax=False)["logits"][:, None, :]

    def greedy(self, token: torch.Tensor, pos: torch.Tensor, cache, out: torch.Tensor) -> None:
        """One greedy decode step: ``token`` [B, 1] at position ``pos`` [1] in; the next token written into ``token``
        and into ``out`` [B, max_len] at ``pos + 1``; ``pos`` advanced by one."""
        if out.dim() != 2 or out.shape[0] != token.shape[0] or out.dtype != torch.int64 or out.device != self.device:
            raise ValueError(f"out must be int64 [batch, length] on {self.device}, got {out.dtype} "
                             f"{list(out.shape)} on {out.device}")
        buf = self._forward(token, pos, cache, argmax=True)
        programs = buf["best_val"].shape[1]
        pick_kernel[(1,)](buf["best_val"], buf["best_idx"], programs, token, token.stride(0), out, out.stride(0),
                          pos, BATCH=token.shape[0], BLOCK_P=triton.next_power_of_2(programs), PDL=self.pdl,
                          **self._launch)
