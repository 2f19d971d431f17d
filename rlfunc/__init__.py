"""rlfunc: functional reinforcement learning on PyTorch (torch.func + TensorDict)."""

__version__ = "0.1.0"
