"""Shape arithmetic on the hot path of a gradient step.

:func:`broadcast_shapes` is ``torch.broadcast_shapes`` without its cost: torch's goes through
``torch._refs`` (about 33 us a call on a CPU core), which the checks of a Gaussian log-density,
an entropy and a DDIM step's density called several times per gradient step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def broadcast_shapes(*shapes: Sequence[int]) -> torch.Size:
    """The shape that ``shapes`` (sequences of non-negative ints: ``torch.Size``, tuples, lists) broadcast to
    (NumPy's rules: trailing dims aligned, each pair equal or one of them 1), as ``torch.broadcast_shapes``
    gives for them (torch's also takes a bare int for a 1-D shape; this one does not).

    Raises:
        RuntimeError: two shapes do not broadcast (as torch's, so that callers catch one error type).
    """
    first = tuple(shapes[0]) if shapes else ()
    if all(tuple(s) == first for s in shapes[1:]):  # the common case: one shape, nothing to align
        return torch.Size(first)
    n = max(len(s) for s in shapes)
    out = [1] * n
    for s in shapes:
        for i, d in enumerate(s, n - len(s)):
            if d == 1:
                continue
            if out[i] == 1:
                out[i] = d
            elif out[i] != d:
                raise RuntimeError(f"shapes {[tuple(x) for x in shapes]} do not broadcast (dim {i - n}: {out[i]} and {d})")
    return torch.Size(out)
