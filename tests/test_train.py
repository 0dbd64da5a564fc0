"""utils.train.GraphedStep: a whole training step in a CUDA graph, equal to eager training."""

import pytest
import torch
from torch import nn

from utils import data, models, train


def test_graphed_step_needs_a_graph_safe_optimizer():
    model = models.MLP()
    with pytest.raises(ValueError, match="capturable=True or fused=True"):
        train.GraphedStep(model, torch.optim.Adam(model.parameters()), nn.CrossEntropyLoss())


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
