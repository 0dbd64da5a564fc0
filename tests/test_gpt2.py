"""utils.gpt2: the same logits and greedy tokens as Hugging Face's GPT-2 given the same weights; the caches agree
with recomputation; loading checks its input; offline, a random model and a sentence saying so."""

import os

import pytest
import torch

from utils import gpt2

transformers = pytest.importorskip("transformers", reason="the reference implementation (requirements.txt has it)")


def hf_twin(config: gpt2.GPT2Config, seed: int = 0):
    """A Hugging Face GPT2LMHeadModel of the same shape with random weights, and ours loaded from it."""
    torch.manual_seed(seed)
    hf_config = transformers.GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions,
                                        n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                                        layer_norm_epsilon=config.layer_norm_epsilon, bos_token_id=0,
                                        eos_token_id=0, attn_implementation="eager")
    hf = transformers.GPT2LMHeadModel(hf_config).eval()
    ours = gpt2.GPT2(config).eval()
    gpt2.load_hf_state_dict(ours, hf.state_dict())
    return hf, ours


def test_same_logits_and_greedy_tokens_as_transformers():
    config = gpt2.GPT2Config.tiny()
    hf, ours = hf_twin(config)
    idx = torch.randint(0, config.vocab_size, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)
        expected = hf.generate(idx[:1], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(gpt2.generate_recompute(ours, idx[:1], 12), expected)


def test_the_hubs_unprefixed_keys_load_too():
    config = gpt2.GPT2Config.tiny()
    hf, ours = hf_twin(config)
    hub_style = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    hub_style["h.0.attn.bias"] = torch.ones(1)  # an old mask buffer: not a weight
    again = gpt2.GPT2(config)
    gpt2.load_hf_state_dict(again, hub_style)
    for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache_kind", ["static", "dynamic"])
def test_cached_generation_equals_recomputation(cache_kind):
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = gpt2.StaticKVCache(config, batch=2, max_len=32) if cache_kind == "static" else gpt2.DynamicKVCache()
    assert torch.equal(gpt2.generate_cached(model, idx, 15, cache), gpt2.generate_recompute(model, idx, 15))


def test_sampled_generation_is_reproducible_and_top_1_is_greedy():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))

    def sample(seed, **options):
        cache = gpt2.StaticKVCache(config, batch=1, max_len=32)
        return gpt2.generate_cached(model, idx, 20, cache, generator=torch.Generator().manual_seed(seed), **options)

    greedy = gpt2.generate_cached(model, idx, 20, gpt2.DynamicKVCache())
    assert torch.equal(sample(0, temperature=1.5, top_k=1), greedy)  # one candidate left: the argmax
    hot = sample(0, temperature=2.0)
    assert torch.equal(hot, sample(0, temperature=2.0)) and not torch.equal(hot, greedy)
    assert not torch.equal(hot, sample(1, temperature=2.0))
    with pytest.raises(ValueError, match="new_tokens must be at least 1"):
        gpt2.generate_cached(model, idx, 0, gpt2.DynamicKVCache())


def test_is_greedy_accepts_the_argmax_and_rejects_another_token():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(4))
    tokens = gpt2.generate_recompute(model, idx, 10)
    assert gpt2.is_greedy(model, tokens, 6)
    with torch.no_grad():
        worst = model(tokens[:, :8])[:, -1].argmin(dim=-1)  # the least likely token at position 8
    wrong = tokens.clone()
    wrong[:, 8] = worst
    assert not gpt2.is_greedy(model, wrong, 6)
    with pytest.raises(ValueError, match="prompt_len must be between 1 and 15"):
        gpt2.is_greedy(model, tokens, 16)


def test_static_cache_step_logits_match_the_full_forward():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(3))
    cache = gpt2.StaticKVCache(config, batch=1, max_len=16)
    with torch.no_grad():
        full = model(idx)
        model(idx[:, :7], torch.arange(7), cache)
        steps = [model(idx[:, p:p + 1], torch.tensor([p]), cache)[:, 0] for p in range(7, 10)]
    torch.testing.assert_close(torch.stack(steps, dim=1), full[:, 7:], rtol=1e-5, atol=1e-5)


def test_sampling_stays_on_the_device_and_respects_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]])
    assert gpt2.greedy_or_sample(logits).item() == 1
    gen = torch.Generator().manual_seed(0)
    draws = {gpt2.greedy_or_sample(logits, temperature=1.0, top_k=2, generator=gen).item() for _ in range(50)}
    assert draws == {1, 2}


def test_bad_inputs_are_clear_errors():
    config = gpt2.GPT2Config.tiny()
    model = gpt2.GPT2(config)
    with pytest.raises(ValueError, match="int64"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="max_len"):
        gpt2.StaticKVCache(config, batch=1, max_len=config.n_positions + 1)
    with pytest.raises(ValueError, match="divisible"):
        gpt2.GPT2Config(n_embd=10, n_head=3)
    with pytest.raises(ValueError, match="missing"):
        gpt2.load_hf_state_dict(model, {"wte.weight": torch.zeros(1)})
    wrong_shape = {k: torch.zeros(1) for k in model.state_dict()}
    with pytest.raises(ValueError, match="shapes do not fit"):
        gpt2.load_hf_state_dict(model, wrong_shape)


def test_a_failed_download_gives_a_random_model_and_says_so(monkeypatch):
    import huggingface_hub

    def no_network(*args, **kwargs):
        raise OSError("no route to huggingface.co")

    monkeypatch.setattr(gpt2, "hub_unreachable", lambda: None)  # the probe connected; the download fails
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", no_network)
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards: notebooks run in child processes inherit them
    model, tokenizer, note = gpt2.from_pretrained(timeout_s=2.5)
    assert tokenizer is None and "random weights" in note and "no route" in note
    # huggingface_hub parses its timeouts with int(): "2.5" would break every later import of it in this process
    assert os.environ["HF_HUB_ETAG_TIMEOUT"] == os.environ["HF_HUB_DOWNLOAD_TIMEOUT"] == "3"
    assert gpt2.count_parameters(model) == 124_439_808  # GPT-2 small, embedding tied to the head


def test_offline_goes_to_the_local_cache_without_a_request(monkeypatch, capfd):
    """Where the probe finds no hub, the loaders only look in the local cache: no request, no retries on stderr."""
    import huggingface_hub

    asked = []

    def cache_only(*args, local_files_only=False, **kwargs):
        asked.append(local_files_only)
        raise OSError("not in the cache")

    monkeypatch.setattr(gpt2, "hub_unreachable", lambda: "gaierror: [Errno -3] Temporary failure in name resolution")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", cache_only)
    monkeypatch.setattr(transformers.GPT2LMHeadModel, "from_pretrained", cache_only)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", cache_only)
    for name in ("HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # restored afterwards (the loaders set them)
    _, tokenizer, note = gpt2.from_pretrained()
    ours, hf, tokenizer_pair, note_pair = gpt2.reference_pair(online=True)
    assert asked == [True, True]  # hf_hub_download, then GPT2LMHeadModel.from_pretrained: each cache-only, once
    assert tokenizer is None and tokenizer_pair is None and gpt2.count_parameters(ours) == 124_439_808
    for text in (note, note_pair):
        assert text.startswith("random weights") and "\n" not in text
        assert "huggingface.co could not be reached (gaierror: [Errno -3] Temporary failure in name resolution)" in text
    assert capfd.readouterr().err == ""


def test_hub_unreachable_asks_once_and_says_why(monkeypatch):
    import socket

    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    with socket.socket() as server:  # a port that accepts: reachable
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert gpt2.hub_unreachable("127.0.0.1", server.getsockname()[1], timeout_s=2) is None
        closed = server.getsockname()[1]
    reason = gpt2.hub_unreachable("127.0.0.1", closed, timeout_s=2)  # nothing listens there any more
    assert reason is not None and "Connection" in reason
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert gpt2.hub_unreachable("127.0.0.1", closed) == "HF_HUB_OFFLINE is set"
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # a direct connection would bypass the proxy
    assert gpt2.hub_unreachable("127.0.0.1", closed) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_decode_step_replayed_from_a_cuda_graph_gives_the_same_tokens():
    """The static cache keeps every shape fixed, so one decode step can be captured once and replayed per token."""
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).cuda().eval()
    idx = torch.randint(0, config.vocab_size, (1, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(4))
    new_tokens = 10
    expected = gpt2.generate_recompute(model, idx, new_tokens)
    cache = gpt2.StaticKVCache(config, batch=1, max_len=32).cuda()
    token, pos = torch.zeros(1, 1, dtype=torch.int64, device="cuda"), torch.zeros(1, dtype=torch.int64, device="cuda")
    with torch.inference_mode():
        token.copy_(model(idx, torch.arange(6, device="cuda"), cache)[:, -1].argmax(-1, keepdim=True))
        pos.fill_(6)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the capture writes position 6: rewritten on replay
            model(token, pos, cache)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            next_token = model(token, pos, cache)[:, -1].argmax(-1, keepdim=True)
        generated = [token.clone()]
        for _ in range(new_tokens - 1):
            graph.replay()
            token.copy_(next_token)
            pos.add_(1)
            generated.append(token.clone())
    assert torch.equal(torch.cat([idx, *generated], dim=1), expected)


def test_static_decoder_on_cpu_equals_recomputation():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    decoder = gpt2.StaticDecoder(model, batch=2, max_len=40)
    assert torch.equal(decoder.generate(idx, 12), gpt2.generate_recompute(model, idx, 12))
    shorter = idx[:, :4]  # the same decoder serves another prompt length
    assert torch.equal(decoder.generate(shorter, 5), gpt2.generate_recompute(model, shorter, 5))
    with pytest.raises(ValueError, match="exceed max_len"):
        decoder.generate(idx, 40)
    with pytest.raises(ValueError, match="does not fit"):
        decoder.prefill(idx[:1])


def test_static_decoder_rewind_repeats_the_decode_without_the_prefill():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(7))
    decoder = gpt2.StaticDecoder(model, batch=2, max_len=32)
    with pytest.raises(RuntimeError, match="call prefill"):
        decoder.rewind()
    expected = decoder.generate(idx, 10)
    decoder.out[:, 7:].fill_(-1)  # what the decode steps write: it must come back
    for _ in range(2):  # each time from the first new position, not from where the last decode stopped
        decoder.rewind()
        decoder.decode(10)
        assert torch.equal(decoder.out[:, :16], expected)
    assert int(decoder.pos) == 15


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_decoder_rewind_replays_the_graph_exactly():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).cuda().eval()
    idx = torch.randint(0, config.vocab_size, (1, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(8))
    decoder = gpt2.StaticDecoder(model, batch=1, max_len=40)
    expected = decoder.generate(idx, 20)
    decoder.out[:, 6:].fill_(-1)
    decoder.rewind()
    decoder.decode(20)
    assert torch.equal(decoder.out[:, :25], expected) and decoder.graph is not None


def test_bytes_per_decode_step_counts_weights_and_cache():
    config = gpt2.GPT2Config.tiny()
    model = gpt2.GPT2(config)
    weights = gpt2.count_parameters(model) * 4
    assert gpt2.bytes_per_decode_step(model, 1, 0) == weights
    assert gpt2.bytes_per_decode_step(model, 2, 10) == weights + 2 * config.n_layer * 2 * 10 * config.n_embd * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_size_caches_equal_recomputation_exactly_in_fp32_on_the_gpu():
    """Notebook 08's fp32 check at its own sizes (GPT-2 124M, random weights, 128 + 48 tokens): on the GPU the
    caches' rounding must stay below the gaps between the top logits, so the tokens are exactly equal."""
    torch.manual_seed(0)
    config = gpt2.GPT2Config()
    model = gpt2.GPT2(config).cuda().eval()
    idx = torch.randint(0, config.vocab_size, (1, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    with torch.inference_mode():
        exact = gpt2.generate_recompute(model, idx, 48)
    for cache in (gpt2.DynamicKVCache(), gpt2.StaticKVCache(config, 1, 176).cuda()):
        assert torch.equal(gpt2.generate_cached(model, idx, 48, cache), exact), type(cache).__name__


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("compile_step", [False, True])
def test_static_decoder_graph_replays_equal_recomputation(compile_step):
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).cuda().eval()
    idx = torch.randint(0, config.vocab_size, (1, 5), device="cuda", generator=torch.Generator("cuda").manual_seed(6))
    decoder = gpt2.StaticDecoder(model, batch=1, max_len=64, compile_step=compile_step)
    assert torch.equal(decoder.generate(idx, 20), gpt2.generate_recompute(model, idx, 20))
    assert decoder.graph is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_static_decoder_with_its_prefill_in_a_graph_equals_recomputation():
    """graph_prefill: one graph per prompt length, captured on the first prompt of that length, replayed after."""
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).cuda().eval()
    gen = torch.Generator("cuda").manual_seed(9)
    decoder = gpt2.StaticDecoder(model, batch=1, max_len=64, graph_prefill=True)
    for length in (5, 9, 5):  # a second length gets its own graph; the first length's graph is replayed
        idx = torch.randint(0, config.vocab_size, (1, length), device="cuda", generator=gen)
        assert torch.equal(decoder.generate(idx, 12), gpt2.generate_recompute(model, idx, 12)), length
    assert sorted(decoder.prefill_graphs) == [5, 9]
    decoder.rewind()
    decoder.decode(12)
    assert torch.equal(decoder.out[:, :17], gpt2.generate_recompute(model, idx, 12))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_full_size_prefill_graph_in_16_bits_matches_the_eager_prefill():
    """Notebook 08's shapes: GPT-2 small in 16 bits, a 128-token prompt into a 384-position cache, so the captured
    prefill's attention takes a boolean mask over the whole cache (the fused kernels' masked path, in a graph)."""
    config = gpt2.GPT2Config()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    model = gpt2.GPT2(config).to(device="cuda", dtype=dtype).eval()
    idx = torch.randint(0, config.vocab_size, (1, 128), device="cuda", generator=torch.Generator("cuda").manual_seed(3))
    graphed = gpt2.StaticDecoder(model, batch=1, max_len=384, graph_prefill=True)
    eager = gpt2.StaticDecoder(model, batch=1, max_len=384)
    for _ in range(2):  # the first call captures, the second replays
        graphed.prefill(idx)
    eager.prefill(idx)
    assert list(graphed.prefill_graphs) == [128] and int(graphed.pos) == 128
    torch.testing.assert_close(graphed.cache.k[:, :, :, :128], eager.cache.k[:, :, :, :128])
    torch.testing.assert_close(graphed.cache.v[:, :, :, :128], eager.cache.v[:, :, :, :128])
    assert gpt2.is_greedy(model, graphed.out[:, :129], 128)
    tokens = graphed.generate(idx, 64)
    assert tokens.shape == (1, 192) and torch.equal(tokens[:, :128], idx) and gpt2.is_greedy(model, tokens, 128)


def test_graph_prefill_is_ignored_on_a_cpu():
    config = gpt2.GPT2Config.tiny()
    torch.manual_seed(0)
    model = gpt2.GPT2(config).eval()
    idx = torch.randint(0, config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(2))
    decoder = gpt2.StaticDecoder(model, batch=1, max_len=32, graph_prefill=True)
    assert not decoder.graph_prefill
    assert torch.equal(decoder.generate(idx, 8), gpt2.generate_recompute(model, idx, 8))
    assert decoder.prefill_graphs == {}


def test_reference_pair_offline_shares_weights():
    ours, hf, tokenizer, note = gpt2.reference_pair(gpt2.GPT2Config.tiny(), online=False)
    assert tokenizer is None and "random weights" in note
    idx = torch.randint(0, 512, (1, 8))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, rtol=1e-5, atol=1e-5)


def test_decode_rate_arithmetic():
    model = gpt2.GPT2(gpt2.GPT2Config.tiny())
    # the prefill timed apart made the first of the 101 new tokens: 100 decode steps in 0.5 s
    rate = gpt2.decode_rate("x", 0.5, model, batch=4, prompt=10, new_tokens=101, copy_gbps=1000.0)
    assert rate.tokens_per_s == pytest.approx(800) and rate.ms_per_token == pytest.approx(5.0)
    expected_gbps = gpt2.bytes_per_decode_step(model, 4, 60) * 200 / 1e9
    assert rate.gbps == pytest.approx(expected_gbps) and rate.pct_copy == pytest.approx(expected_gbps / 10)
    assert set(rate.row()) == {"variant", "tokens/s", "ms/step", "GB/s", "% of copy"}
    # a loop without a separate prefill (the guide's): every one of the new tokens is a step of the time given
    whole = gpt2.decode_rate("guide", 0.5, model, batch=1, prompt=10, new_tokens=100, prefill_included=True)
    assert whole.ms_per_token == pytest.approx(5.0) and whole.pct_copy is None
    with pytest.raises(ValueError, match="at least one step"):
        gpt2.decode_rate("x", 0.5, model, batch=1, prompt=10, new_tokens=1)  # the prefill made the only token
