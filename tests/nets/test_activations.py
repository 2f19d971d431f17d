"""rlfunc.nets.activations: the compiled form of mish is the same function as aten's."""

import pytest
import torch

from rlfunc.nets import activations


def _reference(x: torch.Tensor) -> torch.Tensor:
    x64 = x.double()
    return x64 * torch.tanh(torch.nn.functional.softplus(x64))


@pytest.mark.parametrize("compiling", [False, True], ids=["eager-kernel", "compiled-form"])
def test_mish_matches_float64_over_its_range(monkeypatch, compiling):
    """Both forms against x tanh(softplus(x)) in float64, from deep negatives (where it underflows
    to -0) past the clamp at 20 (where the one-exponential form's ratio is exactly 1), and its
    gradient against float64 autograd; NaN stays NaN."""
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    x = torch.cat([torch.linspace(-60, 60, 2001), torch.randn(4000, generator=torch.Generator().manual_seed(0)) * 3])
    x.requires_grad_(True)
    y = activations.mish(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), _reference(x.detach()), atol=2e-6, rtol=2e-6)
    (grad,) = torch.autograd.grad(y.sum(), x)
    x64 = x.detach().double().requires_grad_(True)
    (want,) = torch.autograd.grad(_reference(x64).sum(), x64)
    torch.testing.assert_close(grad.double(), want, atol=2e-5, rtol=2e-5)
    assert torch.isnan(activations.mish(torch.tensor([float("nan")]))).all()
    assert isinstance(activations.Mish()(torch.zeros(2)), torch.Tensor) and not list(activations.Mish().parameters())
