"""A small, readable GPT-2 (124M) for inference: one screen per class, a static KV cache, and the real weights when
the reader is online.

- :class:`GPT2Config` — sizes as a dataclass; the defaults are GPT-2 small (124 M parameters).
- :class:`GPT2` — token and position embeddings → ``n_layer`` pre-norm blocks (fused QKV attention through
  ``scaled_dot_product_attention``, a GELU(tanh) MLP) → final norm → the tied vocabulary head. ``forward(idx,
  input_pos, cache)``: without a cache, causal attention over the whole sequence; with a :class:`StaticKVCache`,
  the new tokens' keys and values are written at ``input_pos`` and attention reads the cache, masked to the
  positions written so far — shapes never change, so a decode step can be compiled and captured in a CUDA graph.
- :class:`DynamicKVCache` — the cache most tutorials write: keys and values grow with ``torch.cat`` every token.
- :func:`load_hf_state_dict` — the Hugging Face checkpoint's tensors into this model (Conv1D weights transposed).
- :func:`from_pretrained` — the weights and tokenizer from the Hugging Face hub when online, else a random
  initialisation and a sentence saying so; :func:`hub_unreachable` asks once first, so an offline machine goes
  straight to its local cache instead of retrying every request.
- :func:`save_checkpoint` / :func:`load_checkpoint` — the weights and a prompt in a folder, for the child processes
  of notebook 08 (``scripts/hf_generate.py``, ``scripts/gpt2_export.py``).

The layout follows Hugging Face's ``GPT2LMHeadModel`` exactly (same parameters, same arithmetic), so that loading
its weights gives its logits; ``tests/test_gpt2.py`` checks that against ``transformers``.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HUB_NAME = "openai-community/gpt2"
"""GPT-2 small on the Hugging Face hub."""


@dataclass(frozen=True)
class GPT2Config:
    """GPT-2's sizes; the defaults are GPT-2 small (124 M parameters)."""

    vocab_size: int = 50257
    n_positions: int = 1024  # the longest sequence (context)
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def tiny(cls) -> GPT2Config:
        """A GPT-2 of the same shape, small enough for a CPU test: 2 layers, width 64, vocabulary 512."""
        return cls(vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4)


class StaticKVCache(nn.Module):
    """Keys and values of every layer, preallocated for ``batch`` sequences of up to ``max_len`` tokens.

    ``k[layer]`` and ``v[layer]`` are [batch, heads, max_len, head_dim]; a forward pass writes its tokens' keys
    and values at their positions (``index_copy_``, no reallocation) and reads the whole buffer, masked to the
    positions written so far. Register it with the model's device and dtype: ``StaticKVCache(...).to(device)``.
    """

    def __init__(self, config: GPT2Config, batch: int, max_len: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        if not 0 < max_len <= config.n_positions:
            raise ValueError(f"max_len must be in 1..{config.n_positions} (the context), got {max_len}")
        shape = (config.n_layer, batch, config.n_head, max_len, config.head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype), persistent=False)
        self.max_len = max_len

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write k, v [B, H, T, D] at positions ``input_pos`` [T]; return the layer's whole cache."""
        self.k[layer].index_copy_(2, input_pos, k.to(self.k.dtype))
        self.v[layer].index_copy_(2, input_pos, v.to(self.v.dtype))
        return self.k[layer], self.v[layer]

    def mask(self, input_pos: torch.Tensor) -> torch.Tensor:
        """Boolean [T, max_len]: query at position p attends to cache positions ≤ p (causal, written ones)."""
        return torch.arange(self.max_len, device=input_pos.device)[None, :] <= input_pos[:, None]


class DynamicKVCache:
    """Keys and values that grow by concatenation: one new allocation per layer per token (the common way)."""

    def __init__(self) -> None:
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def update(self, layer: int, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        if layer in self.k:
            k, v = torch.cat([self.k[layer], k], dim=2), torch.cat([self.v[layer], v], dim=2)
        self.k[layer], self.v[layer] = k, v
        return k, v

    @staticmethod
    def mask(input_pos: torch.Tensor) -> None:  # the cache holds exactly the positions so far: causal per query
        return None


class Attention(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.config, self.layer = config, layer
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)  # fused Q, K, V
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, cache) -> torch.Tensor:
        b, t, c = x.shape
        h, d = self.config.n_head, self.config.head_dim
        q, k, v = (z.view(b, t, h, d).transpose(1, 2) for z in self.c_attn(x).split(c, dim=2))
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            k, v = cache.update(self.layer, input_pos, k, v)
            mask = cache.mask(input_pos)
            if mask is None:  # a dynamic cache: causal within the new tokens, all earlier ones visible
                mask = torch.ones(t, k.shape[2], dtype=torch.bool, device=x.device).tril(k.shape[2] - t)
            y = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, config: GPT2Config, layer: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config, layer)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(config.n_embd, 4 * config.n_embd),
                                  "c_proj": nn.Linear(4 * config.n_embd, config.n_embd)})

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor, cache) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), input_pos, cache)
        return x + self.mlp["c_proj"](F.gelu(self.mlp["c_fc"](self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2: ``forward(idx [B, T] int64, input_pos [T] int64 | None, cache)`` → logits [B, T, vocab]."""

    def __init__(self, config: GPT2Config | None = None) -> None:
        super().__init__()
        self.config = config = config or GPT2Config()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList(Block(config, i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.apply(self._init)  # GPT-2's initialisation: N(0, 0.02), zero biases

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, input_pos: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        if idx.dtype != torch.int64 or idx.dim() != 2:
            raise ValueError(f"idx must be int64 [batch, tokens], got {idx.dtype} {list(idx.shape)}")
        if input_pos is None:
            input_pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(input_pos)
        for block in self.h:
            x = block(x, input_pos, cache)
        return F.linear(self.ln_f(x), self.wte.weight)  # the head shares the token embedding (tied)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ── Hugging Face weights ────────────────────────────────────────────────────────────────────────────────────

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def load_hf_state_dict(model: GPT2, state_dict: dict[str, torch.Tensor]) -> None:
    """Copy a Hugging Face GPT-2 checkpoint into ``model`` (``GPT2LMHeadModel.state_dict()`` or the hub's file).

    Hugging Face stores the four projection weights as ``Conv1D`` ([in, out]); ``nn.Linear`` wants [out, in], so
    they are transposed. Keys with or without the ``transformer.`` prefix are accepted; ``lm_head.weight`` is the
    tied token embedding and the old ``attn.bias`` / ``attn.masked_bias`` mask buffers are not weights.

    Raises:
        ValueError: naming the missing or unexpected tensors, or a shape that does not fit the config.
    """
    ours = model.state_dict()
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in state_dict.items():
        key = key.removeprefix("transformer.")
        if key == "lm_head.weight" or key.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        if key.endswith(_CONV1D):
            tensor = tensor.t()
        mapped[key] = tensor
    missing, unexpected = sorted(set(ours) - set(mapped)), sorted(set(mapped) - set(ours))
    if missing or unexpected:
        raise ValueError(f"not a GPT-2 checkpoint for this config: missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}")
    wrong = [f"{k}: {tuple(mapped[k].shape)} vs {tuple(ours[k].shape)}" for k in ours
             if mapped[k].shape != ours[k].shape]
    if wrong:
        raise ValueError(f"checkpoint shapes do not fit {model.config}: {wrong[:3]}")
    with torch.no_grad():
        for key, tensor in ours.items():
            tensor.copy_(mapped[key])


def _hub_timeouts(timeout_s: float) -> None:
    """Per-request timeouts for huggingface_hub, unless the user set them: whole seconds, as the hub parses them
    with int() (a "10.0" breaks every later import of huggingface_hub in this process and its children)."""
    os.environ.setdefault("HF_HUB_ETAG_TIMEOUT", str(max(1, math.ceil(timeout_s))))
    os.environ.setdefault("HF_HUB_DOWNLOAD_TIMEOUT", str(max(1, math.ceil(timeout_s))))


def hub_unreachable(host: str = "huggingface.co", port: int = 443, timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached from here, or None when it can (or when that is for the hub's own
    client to find out: a proxy is configured, which a direct connection would bypass).

    One TCP connection to ``host:port``, given ``timeout_s`` in all (name resolution included, which a socket
    timeout does not bound: the attempt runs in a daemon thread). ``HF_HUB_OFFLINE=1`` counts as unreachable.
    Asking once, before any download, is what keeps an offline machine from a minute of huggingface_hub's
    retries (five per file, each logged to stderr).
    """
    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            socket.create_connection((host, port), timeout=timeout_s).close()
            outcome.append(None)
        except OSError as err:
            outcome.append(f"{type(err).__name__}: {err}")

    thread = threading.Thread(target=attempt, name="hub-probe", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return outcome[0] if outcome else f"no connection to {host}:{port} within {timeout_s:g} s"


def _random_weights_note(initialised: str, unreachable: str | None, err: Exception) -> str:
    """The one line saying that the weights are random, and why."""
    if unreachable is not None:
        why = f"huggingface.co could not be reached ({unreachable}) and GPT-2 is not in the local cache"
    else:
        first = (str(err).strip().splitlines() or [""])[0][:140]
        why = f"the hub could not be read ({type(err).__name__}: {first})"
    return (f"random weights ({initialised}) in GPT-2 small's shape: {why}; text is token ids, and what it "
            "generates is noise")


def from_pretrained(name: str = HUB_NAME, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                    timeout_s: float = 10.0):
    """GPT-2's real weights and tokenizer from the Hugging Face hub, or a random model offline.

    Returns ``(model, tokenizer, note)``: ``tokenizer`` is a ``transformers`` tokenizer, or None offline (then work
    with token ids); ``note`` is one sentence saying which you got and why. The download uses
    ``huggingface_hub`` (cached in its usual place) with ``timeout_s`` for each request; when
    :func:`hub_unreachable` says the hub cannot be reached, only the local cache is tried (no request, no retries).
    """
    config = GPT2Config()
    model = GPT2(config)
    unreachable = hub_unreachable()
    offline = unreachable is not None
    try:
        _hub_timeouts(timeout_s)
        from huggingface_hub import hf_hub_download
        from safetensors.torch import load_file
        from transformers import AutoTokenizer

        load_hf_state_dict(model, load_file(hf_hub_download(name, "model.safetensors", local_files_only=offline)))
        tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=offline)
        note = f"GPT-2 small's real weights and tokenizer from the Hugging Face hub ({name})" + (
            ", from the local cache: the hub could not be reached" if offline else "")
    except Exception as err:  # offline, no huggingface_hub/transformers, a proxy, a changed file: say which
        tokenizer = None
        note = _random_weights_note("GPT-2's initialisation", unreachable, err)
    return model.to(device=device, dtype=dtype).eval(), tokenizer, note


# ── Generation ─────────────────────────────────────────────────────────────────────────────────────────────


def greedy_or_sample(logits: torch.Tensor, *, temperature: float = 0.0, top_k: int | None = None,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token [B, 1] from the last position's logits [B, V], on the device, with no host synchronisation:
    argmax at temperature 0, else a sample from the top-k softmax (``torch.multinomial``)."""
    if temperature <= 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)


@torch.inference_mode()
def generate_recompute(model: GPT2, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The loop most guides show: every token re-runs the model on the whole sequence so far (``torch.cat`` onto the
    prompt), no cache. Greedy; returns the prompt and the new tokens."""
    for _ in range(new_tokens):
        next_token = model(idx)[:, -1].argmax(dim=-1, keepdim=True)
        idx = torch.cat([idx, next_token], dim=1)
    return idx


@torch.inference_mode()
def generate_cached(model: GPT2, idx: torch.Tensor, new_tokens: int, cache, *, temperature: float = 0.0,
                    top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Prefill the prompt into ``cache`` (a :class:`StaticKVCache` or :class:`DynamicKVCache`), then decode one
    token at a time, each step attending to the cache. Greedy by default; with a ``temperature`` above 0, each
    token is sampled (:func:`greedy_or_sample`, reproducible with a seeded ``generator`` on the model's device).
    Returns the prompt and the new tokens."""
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be at least 1, got {new_tokens}")

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return greedy_or_sample(logits[:, -1], temperature=temperature, top_k=top_k, generator=generator)

    t = idx.shape[1]
    positions = torch.arange(t + new_tokens, device=idx.device)
    tokens = [pick(model(idx, positions[:t], cache))]
    for i in range(new_tokens - 1):
        tokens.append(pick(model(tokens[-1], positions[t + i:t + i + 1], cache)))
    return torch.cat([idx, *tokens], dim=1)


@torch.inference_mode()
def is_greedy(model: GPT2, tokens: torch.Tensor, prompt_len: int, *, rel: float = 2e-2) -> bool:
    """Whether every token after the first ``prompt_len`` of ``tokens`` [B, T] is ``model``'s greedy choice, up to
    16-bit rounding: ``model`` recomputes the logits of the sequence itself (in its own dtype, compared in fp32), and
    each chosen token's logit must lie within ``rel`` × the largest logit's magnitude (+ 1e-3) of the best one at its
    position. A variant that decodes in 16 bits may pick a near-tie differently; a wrong cache or position lands
    far off.

    Raises:
        ValueError: if ``prompt_len`` leaves no new token, or none of the prompt, in ``tokens``.
    """
    if not 0 < prompt_len < tokens.shape[1]:
        raise ValueError(f"prompt_len must be between 1 and {tokens.shape[1] - 1} for {tokens.shape[1]} tokens, "
                         f"got {prompt_len}")
    logits = model(tokens[:, :-1])[:, prompt_len - 1:].float()
    chosen = logits.gather(-1, tokens[:, prompt_len:, None]).squeeze(-1)
    best = logits.max(dim=-1).values
    return bool(((best - chosen) <= rel * logits.abs().max(dim=-1).values + 1e-3).all())


class StaticDecoder:
    """Greedy decoding with a :class:`StaticKVCache` where one decode step is one call of ``step()`` — and, on a
    GPU, one replay of a CUDA graph that holds the whole step: the model's forward for the last token, the argmax,
    writing the token into the output buffer and advancing the position. The host only launches the replays; the
    tokens stay on the GPU until the end (no synchronisation per token).

    ``compile_step=True`` compiles the forward with ``torch.compile`` first (Inductor's fused kernels), then
    captures those in the graph. ``graph_prefill=True`` puts the prompt's prefill (an eager forward pass,
    launch-bound at batch 1) in a CUDA graph of its own as well, one per prompt length. ``fused_step=True`` runs the
    forward as :class:`utils.gpt2_fused.FusedDecodeStep` instead: five Triton kernels per layer (on a CPU only in
    Triton's interpreter); pass a ``FusedDecodeStep`` of this model to choose its options (``pdl=False``). On a
    CPU the step runs in a loop (no graphs there).

    Usage: ``decoder = StaticDecoder(model, batch=1, max_len=512)``; ``decoder.generate(idx, new_tokens)``.
    The graph is captured on the first call (for this batch size; the prompt length may vary).
    """

    def __init__(self, model: GPT2, *, batch: int, max_len: int, compile_step: bool = False,
                 fused_step=False, graph_prefill: bool = False) -> None:
        if max_len < 8:
            raise ValueError(f"max_len must be at least 8 (room for a prompt and the capture's warm-up), got {max_len}")
        if compile_step and fused_step:
            raise ValueError("choose one of compile_step and fused_step: the fused step is Triton kernels already")
        param = next(model.parameters())
        self.model, self.device, self.batch, self.max_len = model, param.device, batch, max_len
        self.cache = StaticKVCache(model.config, batch, max_len, dtype=param.dtype).to(self.device)
        self.token = torch.zeros(batch, 1, dtype=torch.int64, device=self.device)
        self.pos = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.out = torch.zeros(batch, max_len, dtype=torch.int64, device=self.device)
        self.fused = fused_step is not False
        self.prompt_len: int | None = None  # set by prefill(): where rewind() takes the decoder back to
        self.positions = torch.arange(max_len, device=self.device)
        self.graph_prefill = graph_prefill and self.device.type == "cuda"
        self.prefill_graphs: dict[int, tuple[torch.Tensor, torch.cuda.CUDAGraph]] = {}  # prompt length → (input, graph)
        if fused_step is True:
            from utils.gpt2_fused import FusedDecodeStep  # imports triton: only when asked (see that module)

            self.forward = FusedDecodeStep(model)
        elif self.fused:
            if getattr(fused_step, "model", None) is not model or not hasattr(fused_step, "greedy"):
                raise ValueError("fused_step must be True, False or a utils.gpt2_fused.FusedDecodeStep of this model")
            self.forward = fused_step
        else:
            self.forward = torch.compile(model, fullgraph=True, dynamic=False) if compile_step else model
        self.graph: torch.cuda.CUDAGraph | None = None

    def _step(self) -> None:
        if self.fused:  # the argmax and the bookkeeping below, inside the step's own kernels
            self.forward.greedy(self.token, self.pos, self.cache, self.out)
            return
        logits = self.forward(self.token, self.pos, self.cache)
        next_token = logits[:, -1].argmax(dim=-1, keepdim=True)
        self.out.index_copy_(1, self.pos + 1, next_token)
        self.token.copy_(next_token)
        self.pos.add_(1)

    def _prefill_step(self, idx: torch.Tensor) -> None:
        t = idx.shape[1]
        logits = self.model(idx, self.positions[:t], self.cache)
        self.out[:, :t] = idx
        self.out[:, t:t + 1] = logits[:, -1].argmax(dim=-1, keepdim=True)
        self.token.copy_(self.out[:, t:t + 1])
        self.pos.fill_(t)

    @torch.inference_mode()
    def prefill(self, idx: torch.Tensor) -> None:
        """Run the prompt through the model into the cache; the first new token goes to ``out``. With
        ``graph_prefill=True`` (on a GPU) the prefill is a CUDA graph too, one per prompt length, captured on the
        first prompt of that length: one launch instead of a dozen kernels per layer from Python."""
        b, t = idx.shape
        if b != self.batch or t >= self.max_len:
            raise ValueError(f"prompt {list(idx.shape)} does not fit this decoder (batch {self.batch}, "
                             f"max_len {self.max_len})")
        if self.graph_prefill:
            if t not in self.prefill_graphs:
                self._capture_prefill(idx)
            buffer, graph = self.prefill_graphs[t]
            buffer.copy_(idx)
            graph.replay()
        else:
            self._prefill_step(idx)
        self.prompt_len = t

    def _capture_prefill(self, idx: torch.Tensor) -> None:
        """Capture the prefill of prompts of ``idx``'s length; its warm-up writes only what the replay rewrites (the
        prompt's positions of the cache, the output's first tokens, the token and the position)."""
        buffer = idx.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._prefill_step(buffer)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._prefill_step(buffer)
        self.prefill_graphs[idx.shape[1]] = (buffer, graph)

    @torch.inference_mode()
    def rewind(self) -> None:
        """Back to the state the last :meth:`prefill` left: its first new token as the input, at the first new
        position. The prompt's keys and values stay in the cache and the decode steps write the same positions again,
        so ``rewind(); decode(n)`` runs the last decode's steps again from the same state — the same work, which is
        what lets the decode steps be timed without the prefill. The tokens it makes are the last decode's up to the
        decoder's run-to-run variation: a kernel whose reduction order varies between runs can flip a near-tie of
        the two best logits (an H200 run saw rewound tokens part from the first decode's at position 250).

        Raises:
            RuntimeError: before any prefill.
        """
        if self.prompt_len is None:
            raise RuntimeError("rewind() goes back to the last prefill: call prefill() (or generate()) first")
        t = self.prompt_len
        self.token.copy_(self.out[:, t:t + 1])
        self.pos.fill_(t)

    @torch.inference_mode()
    def _capture(self) -> None:
        saved = (self.token.clone(), self.pos.clone(), self.out.clone())
        # warm-up (and compilation) outside the capture, at the last positions of the cache: a later step that gets
        # there writes its keys and values before it reads them, and the prompt's positions stay untouched
        self.pos.fill_(self.max_len - 4)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(3):
                self._step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        self.token.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.out.copy_(saved[2])
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    @torch.inference_mode()
    def decode(self, new_tokens: int) -> None:
        """``new_tokens − 1`` more steps after the prefill's token (replays on a GPU); nothing is read back."""
        if self.device.type == "cuda" and self.graph is None:
            self._capture()
        for _ in range(new_tokens - 1):
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()

    def generate(self, idx: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """The prompt followed by ``new_tokens`` greedy tokens, [batch, prompt + new_tokens]."""
        t = idx.shape[1]
        if t + new_tokens > self.max_len:
            raise ValueError(f"{t} + {new_tokens} tokens exceed max_len {self.max_len}")
        self.prefill(idx)
        self.decode(new_tokens)
        return self.out[:, :t + new_tokens].clone()


def bytes_per_decode_step(model: GPT2, batch: int, context: int) -> int:
    """The fewest bytes one decode step must read from memory: every weight once (the token embedding twice: its
    rows for the input, all of it as the tied head) plus the keys and values of ``context`` positions per sequence.
    At batch 1 the weights dominate, which is why decoding is memory-bound: tokens/s ≤ bandwidth / this."""
    config = model.config
    itemsize = next(model.parameters()).element_size()
    weights = count_parameters(model) * itemsize  # the head reads the whole (tied) embedding table
    kv = 2 * config.n_layer * batch * context * config.n_embd * itemsize
    return weights + kv


# ── Shared by notebooks 08 and 09: the model pair, and a decode measurement ─────────────────────────────────


def reference_pair(config: GPT2Config | None = None, *, online: bool = True, seed: int = 0):
    """Hugging Face's ``GPT2LMHeadModel`` and this module's :class:`GPT2` with the *same* weights, on the CPU in fp32.

    With ``online`` and the default config, the real GPT-2 small weights and tokenizer come from the hub (its
    files are cached by ``huggingface_hub``); otherwise — offline, or any other config — the Hugging Face model is
    initialised randomly from ``seed``. Returns ``(ours, hf, tokenizer or None, note)``. When
    :func:`hub_unreachable` says the hub cannot be reached, only the local cache is tried: no request, no retries.
    """
    import transformers

    config = config or GPT2Config()
    special = {} if config.vocab_size > 50256 else {"bos_token_id": 0, "eos_token_id": 0}  # GPT-2's ids: 50256
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                                        layer_norm_epsilon=config.layer_norm_epsilon, **special)
    hf = tokenizer = None
    note = f"random weights (seed {seed}) in GPT-2's shape: offline, or a small configuration"
    if online and config == GPT2Config():
        unreachable = hub_unreachable()
        offline = unreachable is not None
        try:
            _hub_timeouts(10)
            hf = transformers.GPT2LMHeadModel.from_pretrained(HUB_NAME, local_files_only=offline)
            tokenizer = transformers.AutoTokenizer.from_pretrained(HUB_NAME, local_files_only=offline)
            note = f"GPT-2 small's real weights and tokenizer from the Hugging Face hub ({HUB_NAME})" + (
                ", from the local cache: the hub could not be reached" if offline else "")
        except Exception as err:  # offline, a proxy, a changed file: say which, and carry on with random weights
            hf = tokenizer = None
            note = _random_weights_note(f"seed {seed}", unreachable, err)
    if hf is None:
        torch.manual_seed(seed)
        hf = transformers.GPT2LMHeadModel(hf_config)
    ours = GPT2(config)
    load_hf_state_dict(ours, hf.state_dict())
    return ours.eval(), hf.eval(), tokenizer, note


def save_checkpoint(hf_model, prompt: torch.Tensor, directory: str | Path) -> Path:
    """Hugging Face's GPT-2 and a prompt in ``directory``, for another process to load: ``config.json`` (the
    model's configuration), ``model.safetensors`` (its tensors, the tied head left out as on the hub) and
    ``prompt.pt``. Load ours with :func:`load_checkpoint`, theirs with ``GPT2LMHeadModel.from_pretrained``.
    Returns the directory."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    hf_model.config.to_json_file(str(directory / "config.json"))
    tensors = {k: v.detach().cpu().contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    torch.save(prompt.detach().cpu(), directory / "prompt.pt")
    return directory


def load_checkpoint(directory: str | Path) -> tuple[GPT2, torch.Tensor]:
    """Our :class:`GPT2` (fp32, CPU, eval) with the weights :func:`save_checkpoint` wrote, and the prompt.

    Raises:
        FileNotFoundError: naming the file missing from ``directory``.
    """
    from safetensors.torch import load_file

    directory = Path(directory)
    for name in ("config.json", "model.safetensors", "prompt.pt"):
        if not (directory / name).is_file():
            raise FileNotFoundError(f"{directory} has no {name}: write it with utils.gpt2.save_checkpoint")
    hf_config = json.loads((directory / "config.json").read_text())
    config = GPT2Config(**{k: hf_config[k] for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
                                                     "layer_norm_epsilon")})
    model = GPT2(config)
    load_hf_state_dict(model, load_file(str(directory / "model.safetensors")))
    return model.eval(), torch.load(directory / "prompt.pt", weights_only=True)


@dataclass(frozen=True)
class DecodeRate:
    """What one generation measured: tokens per second over all sequences, time per step, and bytes moved."""

    label: str
    tokens_per_s: float
    ms_per_token: float  # per decode step (one new token for every sequence of the batch): the table's ms/step
    gbps: float  # the fewest bytes a step must read (bytes_per_decode_step) × steps per second
    pct_copy: float | None  # gbps as a % of the copy bandwidth measured in the same run

    def row(self) -> dict[str, object]:
        return {"variant": self.label, "tokens/s": f"{self.tokens_per_s:,.0f}", "ms/step": f"{self.ms_per_token:.3g}",
                "GB/s": f"{self.gbps:,.0f}" if self.gbps >= 10 else f"{self.gbps:.2g}",
                "% of copy": f"{self.pct_copy:.0f}%" if self.pct_copy else "—"}


def decode_rate(label: str, seconds: float, model: GPT2, *, batch: int, prompt: int, new_tokens: int,
                copy_gbps: float | None = None, prefill_included: bool = False) -> DecodeRate:
    """Turn the time of generating ``new_tokens`` after a ``prompt``-token prompt into a :class:`DecodeRate`.

    By default ``seconds`` covers the decode steps only, the prefill timed apart: the prefill makes the first new
    token, so those seconds are ``new_tokens − 1`` steps. ``prefill_included=True`` is for a loop without a separate
    prefill (the guide's, which re-runs the whole sequence for every token): its ``seconds`` make all
    ``new_tokens``, one forward pass each. Bytes per step are counted at the average context,
    ``prompt + new_tokens / 2``.

    Raises:
        ValueError: for no step to count (``new_tokens`` 1 with the prefill apart) or ``seconds`` ≤ 0.
    """
    steps = new_tokens if prefill_included else new_tokens - 1
    if steps < 1 or seconds <= 0:
        raise ValueError(f"decode_rate() needs at least one step and a positive time: {steps} steps "
                         f"({new_tokens} new tokens, prefill {'included' if prefill_included else 'apart'}) "
                         f"in {seconds} s")
    steps_per_s = steps / seconds
    bytes_per_step = bytes_per_decode_step(model, batch, prompt + new_tokens // 2)
    gbps = bytes_per_step * steps_per_s / 1e9
    return DecodeRate(label, batch * steps_per_s, 1e3 / steps_per_s, gbps,
                      100 * gbps / copy_gbps if copy_gbps else None)
