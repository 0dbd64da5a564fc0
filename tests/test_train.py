"""utils.train.GraphedStep: a whole training step in a CUDA graph, equal to eager training."""

import weakref

import pytest
import torch
import torch.utils._python_dispatch
import torch.utils._pytree
from torch import nn

from utils import data, models, train


def test_graphed_step_needs_a_graph_safe_optimizer():
    model = models.MLP()
    with pytest.raises(ValueError, match="capturable=True"):
        train.GraphedStep(model, torch.optim.Adam(model.parameters()), nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match="fused=True alone"):  # Adam.step() refuses capture without capturable
        train.GraphedStep(model, torch.optim.Adam(model.parameters(), fused=True), nn.CrossEntropyLoss())


def test_graphed_step_needs_cuda():
    model = models.MLP()
    optimizer = torch.optim.Adam(model.parameters(), capturable=True)
    with pytest.raises(RuntimeError, match="CUDA graphs need a CUDA device"):
        train.GraphedStep(model, optimizer, nn.CrossEntropyLoss())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphed_training_equals_eager_training_including_a_smaller_last_batch():
    torch.manual_seed(0)
    x, y = data.synthetic_images(100, device="cuda")
    eager, graphed = models.MLP().cuda(), models.MLP().cuda()
    graphed.load_state_dict(eager.state_dict())
    options = {"lr": 1e-2, "fused": True, "capturable": True}
    eager_opt = torch.optim.Adam(eager.parameters(), **options)
    graphed_opt = torch.optim.Adam(graphed.parameters(), **options)
    loss_fn = nn.CrossEntropyLoss()
    step = train.GraphedStep(graphed, graphed_opt, loss_fn)
    for _ in range(3):  # epochs of batches 32, 32, 32, 4: two graphs
        for start in range(0, 100, 32):
            xb, yb = x[start:start + 32], y[start:start + 32]
            eager_opt.zero_grad(set_to_none=True)
            eager_loss = loss_fn(eager(xb), yb)
            eager_loss.backward()
            eager_opt.step()
            graphed_loss = step(xb, yb)
            torch.testing.assert_close(graphed_loss, eager_loss.detach())
    assert len(step.graphs) == 2
    for a, b in zip(eager.parameters(), graphed.parameters(), strict=True):
        torch.testing.assert_close(a, b)


def tiny_lm(vocab=300):
    torch.manual_seed(0)
    return models.TransformerModel(models.TransformerConfig(vocab_size=vocab, d_model=32, nhead=2, num_layers=1,
                                                            dim_feedforward=64, dropout=0.0))


def test_chunked_loss_equals_the_plain_loss_with_the_same_gradients():
    model = tiny_lm()
    x, y = data.synthetic_tokens(3, 37, 300)  # 111 tokens: chunks of 50, 50 and 11
    plain = train.lm_loss(model(x), y)
    plain.backward()
    plain_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    chunked = train.chunked_lm_loss(model.features(x), model.head, y, chunk_tokens=50)
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=1e-6)
    for p, g in zip(model.parameters(), plain_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)


def test_chunked_loss_keeps_no_full_logits_under_autocast():
    model = tiny_lm(vocab=2000)
    x, y = data.synthetic_tokens(4, 64, 2000)
    logits_bytes = 4 * 64 * 2000 * 4  # fp32 [tokens, vocab]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def saved_storages(fn):
        """nbytes of every storage autograd packs for backward while fn() runs, parameters excluded."""
        saved = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            fn()
        return list(saved.values())

    plain = saved_storages(lambda: train.lm_loss(model(x), y))
    chunked = saved_storages(lambda: train.chunked_lm_loss(model.features(x), model.head, y, chunk_tokens=64))
    assert max(plain) == logits_bytes  # the fp32 log-probs of every token
    head_fp32_bytes = model.head.weight.numel() * 4  # the head's weight gradient, kept in fp32
    assert max(chunked) <= head_fp32_bytes < logits_bytes and sum(chunked) < sum(plain) / 2


class _LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """The peak of the bytes held by tensors created inside the block (counted by storage, until freed)."""

    def __init__(self):
        super().__init__()
        self.level = self.peak = 0
        self.refs: dict[int, int] = {}
        self.sizes: dict[int, int] = {}

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            del self.refs[key]
            self.level -= self.sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr():
                key = t.untyped_storage().data_ptr()
                if key not in self.refs:
                    self.refs[key], self.sizes[key] = 0, t.untyped_storage().nbytes()
                    self.level += self.sizes[key]
                self.refs[key] += 1
                weakref.finalize(t, self._drop, key)
        self.peak = max(self.peak, self.level)
        return out


@pytest.mark.parametrize("amp", [None, torch.bfloat16])
def test_chunked_loss_holds_at_most_8_bytes_per_logit_of_one_chunk(amp):
    """What utils.memory_calculator counts for the chunked loss: one chunk's logits at 8 bytes each (fp32 logits and
    their log-softmax; a bf16 logit once cost 16: an fp32 copy for log_softmax, the last chunk's tensors still
    named, and a second fp32 copy for the bias gradient), the head's weight in the compute dtype, and the gradients
    it keeps for backward (features and head, fp32)."""
    torch.manual_seed(0)
    n, d, v, chunk = 256, 32, 4000, 64
    head = nn.Linear(d, v)
    features, targets = torch.randn(n, d, requires_grad=True), torch.randint(0, v, (n,))
    with _LiveBytes() as live, torch.autocast("cpu", dtype=amp or torch.float32, enabled=amp is not None):
        train.chunked_lm_loss(features, head, targets, chunk_tokens=chunk)
    weight_copy = v * d * 2 if amp else 0
    kept = n * d * 4 + (v * d + v) * 4
    assert live.peak <= chunk * v * 8 + weight_copy + kept + 64 * 1024, (live.peak, chunk * v * 8)


def test_chunked_loss_under_autocast_matches_the_plain_loss():
    model = tiny_lm(vocab=500)
    x, y = data.synthetic_tokens(4, 50, 500)
    results = {}
    for name, fn in (("plain", lambda: train.lm_loss(model(x), y)),
                     ("chunked", lambda: train.chunked_lm_loss(model.features(x), model.head, y, chunk_tokens=64))):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        (loss * 3.0).backward()  # a scaled loss, as a GradScaler would give it
        results[name] = (loss.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(results["chunked"][0], results["plain"][0], rtol=1e-2, atol=1e-2)
    grad_err = (results["chunked"][1] - results["plain"][1]).norm() / results["plain"][1].norm()
    assert grad_err < 2e-2
    with torch.no_grad():  # evaluation: no gradient work, same value
        torch.testing.assert_close(train.chunked_lm_loss(model.features(x), model.head, y, chunk_tokens=64),
                                   train.lm_loss(model(x), y), rtol=1e-5, atol=1e-5)


def _confident_head(vocab=1000, d=8, gap=18.0):
    """A head whose logits put every word but word 0 `gap` below it: their probabilities are e^-18 ≈ 1.5e-8, so
    their logits' gradients sit below half fp16's smallest subnormal (3e-8) at unit scale."""
    torch.manual_seed(0)
    head = nn.Linear(d, vocab)
    with torch.no_grad():
        head.weight.mul_(0.01)
        head.bias.fill_(-gap)
        head.bias[0] = 0.0
    return head


def _head_grad(head, features, targets, loss_fn, scale):
    head.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = loss_fn()
    (loss * scale).backward()  # as scaler.scale(loss).backward() does
    return head.weight.grad / scale  # as scaler.unscale_ does


def test_chunked_loss_made_at_the_loss_scale_keeps_fp16_gradients_that_underflow_without_it():
    head, n = _confident_head(), 64
    features, targets = torch.randn(n, 8, generator=torch.Generator().manual_seed(1)), torch.zeros(n, dtype=torch.long)
    reference = torch.autograd.grad(train.lm_loss(head(features)[None], targets[None]), head.weight)[0]
    rare = reference[1:]  # the rows of the 999 improbable words: p·mean(x), about 1e-8 each
    assert (rare != 0).all()
    scale = 2.0**16  # a GradScaler's initial scale

    def chunked(grad_scale):
        return _head_grad(head, features, targets, lambda: train.chunked_lm_loss(
            features, head, targets, chunk_tokens=16, grad_scale=grad_scale), scale)[1:]

    unprotected, protected = chunked(None), chunked(scale)
    plain = _head_grad(head, features, targets, lambda: train.lm_loss(head(features)[None], targets[None]), scale)[1:]
    assert (unprotected == 0).all()  # made at unit scale in forward: fp16 rounds every one of them to 0
    assert (protected != 0).all() and (plain != 0).all()
    def error(g):
        return ((g - rare).norm() / rare.norm()).item()

    assert error(unprotected) == 1.0 and error(protected) < 0.02  # survives, within fp16's rounding
    assert abs(error(protected) - error(plain)) < 0.01  # as the plain loss does under the same scale


def test_chunked_loss_fn_reads_the_scalers_scale_and_its_overflow_is_skipped():
    model = tiny_lm(vocab=1000)
    with torch.no_grad():  # a confident model: every word but word 0 has a probability of about 1.5e-8
        model.head.bias.fill_(-18.0)
        model.head.bias[0] = 0.0
    x, y = data.synthetic_tokens(2, 16, 1000)
    y.zero_()
    rare = torch.autograd.grad(train.lm_loss(model(x), y), model.head.weight)[0][1:]
    runs = {}
    for name, init_scale, pass_scaler in (("scaler not passed", 2.0**16, False), ("scaler passed", 2.0**16, True),
                                          ("too large a scale", 2.0**40, True)):
        model.zero_grad(set_to_none=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        loss_fn = train.chunked_loss_fn(chunk_tokens=8, scaler=scaler if pass_scaler else None)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, x, y)
        scaler.scale(loss).backward()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        scaler.unscale_(optimizer)
        grad = model.head.weight.grad.clone()
        scaler.step(optimizer)
        scaler.update()
        runs[name] = (((grad[1:] - rare).norm() / rare.norm()).item(), grad.isfinite().all().item(),
                      scaler.get_scale())
    assert runs["scaler not passed"][0] > 0.2  # fp16 lost or rounded most of them
    assert runs["scaler passed"][0] < 0.02 and runs["scaler passed"][1:] == (True, 2.0**16)  # kept; none skipped
    assert runs["too large a scale"][1:] == (False, 2.0**39)  # overflow, seen by the scaler: skipped, halved


def test_train_step_takes_a_loss_fn():
    model = tiny_lm()
    x, y = data.synthetic_tokens(2, 16, 300)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = train.lm_loss(model(x), y).item()
    for _ in range(5):
        loss = train.train_step(model, optimizer, x, y, loss_fn=train.chunked_loss_fn(chunk_tokens=8))
    assert loss.item() < before


def test_chunked_loss_rejects_bad_input():
    model = tiny_lm()
    x, y = data.synthetic_tokens(2, 16, 300)
    with pytest.raises(ValueError, match="chunk_tokens"):
        train.chunked_lm_loss(model.features(x), model.head, y, chunk_tokens=0)
    with pytest.raises(ValueError, match="tokens"):
        train.chunked_lm_loss(model.features(x), model.head, y[:, :5])


# ── notebook 02's training runs ─────────────────────────────────────────────────────────────────────────────


def _mnist_like(n=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=gen), torch.randint(0, 10, (n,), generator=gen)


def _epoch(model, batches, optimizer):
    total, steps = 0.0, 0
    for x, y in batches:
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total, steps = total + loss.item(), steps + 1
    return total / steps


def test_fit_trains_from_the_given_weights_and_records_curves():
    x, y = _mnist_like()
    init = models.MLP().state_dict()
    batches = [(x[i:i + 64], y[i:i + 64]) for i in range(0, len(x), 64)]
    a = train.fit(_epoch, batches, init_state=init, epochs=3, test=(x, y), device="cpu", lr=1e-2)
    b = train.fit(_epoch, lambda: iter(batches), init_state=init, epochs=3, test=(x, y), device="cpu", lr=1e-2)
    assert len(a.losses) == len(a.accuracies) == 3 and a.losses[-1] < a.losses[0]
    assert train.same_weights(a.weights(), b.weights()) == "bit-identical"  # a list or a factory: the same run
    assert a.accuracy == a.accuracies[-1] and 0 <= a.accuracy <= 100
    before = a.weights()
    a.epoch()  # one more epoch of the same loop on the same model
    with pytest.raises(AssertionError, match="net"):
        train.same_weights(before, a.weights())
    with pytest.raises(ValueError, match="at least one epoch"):
        train.fit(_epoch, batches, init_state=init, epochs=0, test=(x, y), device="cpu", lr=1e-2)


def test_accuracy_is_one_pass_and_keeps_the_mode():
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    x = torch.randn(90, 4)
    y = model(x).argmax(1)
    y[:30] = (y[:30] + 1) % 3
    model.train()
    assert train.accuracy(model, x, y) == pytest.approx(200 / 3) and model.training
    # the same as counting batch by batch, as a DataLoader-based evaluation would
    hits = sum((model(x[i:i + 16]).argmax(1) == y[i:i + 16]).sum().item() for i in range(0, 90, 16))
    assert train.accuracy(model, x, y) == pytest.approx(100 * hits / 90)


def test_standard_error_of_an_accuracy():
    assert train.standard_error(95.0, 10_000) == pytest.approx(100 * (0.95 * 0.05 / 10_000) ** 0.5)
    assert train.standard_error(100.0, 10) == 0
