"""rlfunc.core.shapes.broadcast_shapes against torch.broadcast_shapes on random shapes (ones, zeros,
different ranks), the errors included."""

import random

import pytest
import torch

from rlfunc.core.shapes import broadcast_shapes


def _torch(*shapes):
    try:
        return torch.broadcast_shapes(*shapes)
    except RuntimeError:
        return None


def _ours(*shapes):
    try:
        return broadcast_shapes(*shapes)
    except RuntimeError:
        return None


def test_agrees_with_torch_on_random_shapes():
    rng = random.Random(0)
    errors = 0
    for _ in range(3000):
        shapes = [tuple(rng.choice([0, 1, 1, 2, 3]) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 3))]
        want = _torch(*shapes)
        assert _ours(*shapes) == want, shapes
        errors += want is None
    assert 300 < errors < 2700  # both outcomes were exercised


@pytest.mark.parametrize("shapes,want", [
    (((256, 6), (256, 6), (6,)), (256, 6)),
    (((3, 1), (1, 4)), (3, 4)),
    (((1,), (0,)), (0,)),
    (((), (2, 3)), (2, 3)),
    ((torch.Size([5, 1, 2]), torch.Size([7, 1])), (5, 7, 2)),
])
def test_hand_computed(shapes, want):
    got = broadcast_shapes(*shapes)
    assert isinstance(got, torch.Size) and got == torch.Size(want)


def test_mismatch_is_a_runtime_error_naming_the_dim():
    with pytest.raises(RuntimeError, match=r"dim -1: 3 and 4"):
        broadcast_shapes((2, 3), (4,))
