"""utils.models: shapes, parameter counts, causality, bad input; utils.data.patterned_tokens."""

import math

import pytest
import torch

from utils import data, models


def test_mlp_is_the_seed_architecture():
    mlp = models.MLP()
    assert models.count_parameters(mlp) == 784 * 256 + 256 + 256 * 10 + 10
    assert mlp(torch.randn(5, 1, 28, 28)).shape == (5, 10)


def test_transformer_seed_sizes():
    cfg = models.TransformerConfig()
    assert (cfg.vocab_size, cfg.d_model, cfg.nhead, cfg.num_layers) == (50_000, 512, 8, 6)
    with pytest.raises(ValueError, match="divisible"):
        models.TransformerConfig(d_model=100, nhead=8)
    with torch.device("meta"):  # counted without allocating: what TransformerConfig's docstring says
        model = models.TransformerModel(cfg)
    assert round(models.count_parameters(model) / 1e6, 1) == 70.2
    assert models.count_parameters(model.embedding) + models.count_parameters(model.head) == 51_250_000


def test_transformer_shapes_and_causality():
    torch.manual_seed(0)
    model = models.TransformerModel(models.TransformerConfig(vocab_size=97, d_model=32, nhead=4, num_layers=2,
                                                             dim_feedforward=64, dropout=0.0)).eval()
    tokens = torch.randint(0, 97, (2, 10))
    logits = model(tokens)
    assert logits.shape == (2, 10, 97)
    # changing a later token must not change earlier predictions (causal), but does change later ones
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 97
    with torch.no_grad():
        again = model(changed)
    torch.testing.assert_close(again[:, :7], logits[:, :7].detach())
    assert not torch.allclose(again[:, 7:], logits[:, 7:].detach())


def test_transformer_rejects_float_tokens():
    model = models.TransformerModel(models.TransformerConfig(vocab_size=11, d_model=8, nhead=2, num_layers=1))
    with pytest.raises(ValueError, match="int64"):
        model(torch.randn(2, 3))


def test_patterned_tokens_follow_the_rule():
    gen = torch.Generator().manual_seed(0)
    inputs, targets = data.patterned_tokens(64, 50, 1000, noise=0.1, generator=gen)
    assert inputs.shape == targets.shape == (64, 50) and inputs.dtype == torch.int64
    torch.testing.assert_close(inputs[:, 1:], targets[:, :-1])
    follows = (targets == (31 * inputs + 7) % 1000).float().mean().item()
    assert 0.85 < follows < 0.95  # 90% follow the rule (plus the rare random hit)
    assert data.patterned_tokens_min_loss(1000, 0.1) < math.log(1000) / 4
    with pytest.raises(ValueError):
        data.patterned_tokens(1, 1, 10, noise=0.0)


def _tiny_lm():
    torch.manual_seed(0)
    cfg = models.TransformerConfig(vocab_size=50, d_model=32, nhead=4, num_layers=1, dim_feedforward=64, dropout=0.0)
    return models.TransformerModel(cfg)


@pytest.mark.parametrize("amp_dtype", [None, torch.bfloat16])
def test_train_step_lowers_the_loss(amp_dtype):
    from utils import train

    model = _tiny_lm()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, targets = data.patterned_tokens(8, 16, 50, generator=torch.Generator().manual_seed(1))
    first = train.train_step(model, opt, inputs, targets, amp_dtype=amp_dtype)
    for _ in range(30):
        last = train.train_step(model, opt, inputs, targets, amp_dtype=amp_dtype)
    assert not first.requires_grad and last.item() < 0.7 * first.item()


def test_train_step_with_scaler_clips_unscaled_gradients(monkeypatch):
    from utils import train

    model = _tiny_lm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    seen = {}
    real_clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm):
        params = list(params)
        seen["norm"] = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in params])).item()
        return real_clip(params, max_norm)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    inputs, targets = data.synthetic_tokens(4, 8, 50, generator=torch.Generator().manual_seed(2))
    train.train_step(model, opt, inputs, targets, scaler=scaler, max_grad_norm=1.0)
    # unscaled before clipping: the norm the clip sees is that of the true gradients (order 1, not 1000s)
    assert seen["norm"] < 100


def test_train_step_rejects_other_dtypes():
    from utils import train

    model = _tiny_lm()
    with pytest.raises(ValueError, match="amp_dtype"):
        train.train_step(model, torch.optim.SGD(model.parameters(), lr=0.1), *data.synthetic_tokens(1, 4, 50),
                         amp_dtype=torch.float64)


@pytest.mark.parametrize(("gib", "batch"), [(139.8, 32), (79.2, 32), (14.6, 16), (7.6, 8), (3.8, 4)])
def test_seed_train_batch_follows_the_gpus_memory(gib, batch):  # H200, H100, T4, 8 GB and 4 GB laptop GPUs
    assert models.seed_train_batch(int(gib * 2**30)) == batch


def test_seed_train_batch_rejects_a_size_that_is_not_one():
    with pytest.raises(ValueError, match="memory in bytes"):
        models.seed_train_batch(0)
