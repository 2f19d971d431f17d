"""rlfunc.core.normalize: merge property, float64 numpy references, masking, vmap vs loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfunc.errors import ConfigError, ShapeError
from rlfunc.core.normalize import (
    denormalize,
    init_running_stats,
    merge_running_stats,
    normalize,
    scale_reward,
    update_running_stats,
)


def _close(stats, mean, var, count, atol=1e-5, rtol=1e-5):
    torch.testing.assert_close(stats["mean"].double(), torch.as_tensor(mean, dtype=torch.float64), atol=atol, rtol=rtol)
    torch.testing.assert_close(stats["var"].double(), torch.as_tensor(var, dtype=torch.float64), atol=atol, rtol=rtol)
    assert stats["count"].item() == count


def test_init_layout():
    s = init_running_stats((3,))
    assert s.batch_size == torch.Size([])
    assert s["mean"].shape == (3,) and s["var"].shape == (3,) and s["count"].shape == ()
    assert s["mean"].dtype == torch.float32 and s["count"].dtype == torch.float32
    assert s["count"].item() == 0
    x = torch.randn(4, 3)
    torch.testing.assert_close(normalize(s, x), x)  # identity before any data


def test_first_update_from_count_zero_is_exact():
    x = torch.tensor([[1.0, -2.0], [3.0, 5.0], [8.0, 0.5]])
    s = update_running_stats(init_running_stats((2,)), x)
    assert torch.equal(s["mean"], x.mean(0))
    torch.testing.assert_close(s["var"], x.var(0, unbiased=False), atol=0, rtol=1e-6)
    assert s["count"].item() == 3


def test_merge_property_1234():
    s = init_running_stats(())
    s12 = update_running_stats(s, torch.tensor([1.0, 2.0]))
    s1234_seq = update_running_stats(s12, torch.tensor([3.0, 4.0]))
    s1234 = update_running_stats(s, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    _close(s1234_seq, 2.5, 1.25, 4, atol=0, rtol=1e-7)
    _close(s1234, 2.5, 1.25, 4, atol=0, rtol=1e-7)
    merged = merge_running_stats(update_running_stats(s, torch.tensor([3.0, 4.0])), s12)
    _close(merged, 2.5, 1.25, 4, atol=0, rtol=1e-7)


def test_update_is_pure():
    s = init_running_stats((2,))
    before = s.clone()
    s2 = update_running_stats(s, torch.randn(5, 2))
    merge_running_stats(s, s2)
    assert (s == before).all()


@pytest.mark.parametrize("seed", range(5))
def test_random_splits_match_numpy_float64(seed):
    rng = np.random.default_rng(seed)
    shape = (3, 2)
    data = rng.normal(loc=rng.normal(size=shape) * 50, scale=rng.uniform(0.1, 10, size=shape), size=(200, *shape))
    cuts = np.sort(rng.choice(np.arange(1, 200), size=6, replace=False))
    s = init_running_stats(shape)
    parts = []
    for chunk in np.split(data, cuts):
        s = update_running_stats(s, torch.from_numpy(chunk))  # float64 input is cast to float32
        parts.append(update_running_stats(init_running_stats(shape), torch.from_numpy(chunk).float()))
    _close(s, data.mean(0), data.var(0), 200, atol=1e-4, rtol=1e-5)
    # tree merge of the parts, as across seeds/devices
    while len(parts) > 1:
        pairs = [parts[i : i + 2] for i in range(0, len(parts), 2)]
        parts = [merge_running_stats(*p) if len(p) == 2 else p[0] for p in pairs]
    _close(parts[0], data.mean(0), data.var(0), 200, atol=1e-4, rtol=1e-5)


def test_large_offset_is_stable():
    # mean 1e4, std 1e-1: naive E[x^2] - E[x]^2 in float32 loses everything
    rng = np.random.default_rng(0)
    data = 1e4 + 0.1 * rng.normal(size=(4000, 1))
    s = init_running_stats((1,))
    for chunk in np.split(data, 40):
        s = update_running_stats(s, torch.from_numpy(chunk).float())
    ref = data.astype(np.float32).astype(np.float64)
    _close(s, ref.mean(0), ref.var(0), 4000, atol=1e-3, rtol=1e-3)


def test_non_finite_rows_are_skipped():
    x = torch.tensor([[1.0, 2.0], [float("nan"), 0.0], [3.0, 4.0], [0.0, float("inf")], [-float("inf"), 1.0]])
    s = update_running_stats(init_running_stats((2,)), x)
    ref = x[[0, 2]].double()
    _close(s, ref.mean(0), ref.var(0, unbiased=False), 2)
    assert torch.isfinite(s["mean"]).all() and torch.isfinite(s["var"]).all()


def test_all_rows_invalid_leaves_stats_unchanged():
    s = update_running_stats(init_running_stats((2,)), torch.tensor([[1.0, 2.0], [3.0, 5.0]]))
    s2 = update_running_stats(s, torch.full((3, 2), float("nan")))
    assert (s2 == s).all()
    s3 = update_running_stats(s, torch.zeros(0, 2))
    assert (s3 == s).all()
    fresh = update_running_stats(init_running_stats((2,)), torch.full((3, 2), float("nan")))
    assert (fresh == init_running_stats((2,))).all()


def test_mask():
    x = torch.arange(12.0).reshape(2, 3, 2)  # batch [2, 3], shape [2]
    mask = torch.tensor([[True, False, True], [False, True, True]])
    s = update_running_stats(init_running_stats((2,)), x, mask)
    ref = x[mask].double()
    _close(s, ref.mean(0), ref.var(0, unbiased=False), 4)


def test_merge_with_empty_is_exact():
    a = update_running_stats(init_running_stats((3,)), torch.randn(7, 3))
    e = init_running_stats((3,))
    assert (merge_running_stats(a, e) == a).all()
    assert (merge_running_stats(e, a) == a).all()


def test_vmap_over_stacked_stats_equals_loop():
    S = 3
    g = torch.Generator().manual_seed(0)
    stats = torch.stack([init_running_stats((2,)) for _ in range(S)])
    assert stats.batch_size == torch.Size([S])
    xs = [torch.randn(S, 5, 2, generator=g) * (i + 1) + i for i in range(3)]
    xs[1][1, 2, 0] = float("nan")  # a bad row on one member only
    masks = [torch.rand(S, 5, generator=g) > 0.3 for _ in range(3)]
    vupdate = torch.func.vmap(update_running_stats)
    v = stats
    loop = [stats[i] for i in range(S)]
    for x, m in zip(xs, masks):
        v = vupdate(v, x, m)
        loop = [update_running_stats(loop[i], x[i], m[i]) for i in range(S)]
    ref = torch.stack(loop)
    assert v.batch_size == torch.Size([S])
    for key in ("mean", "var", "count"):
        torch.testing.assert_close(v[key], ref[key])
    # merge, normalize and denormalize under vmap too
    other = vupdate(stats, torch.randn(S, 4, 2, generator=g), torch.ones(S, 4, dtype=torch.bool))
    vm = torch.func.vmap(merge_running_stats)(v, other)
    lm = torch.stack([merge_running_stats(v[i], other[i]) for i in range(S)])
    for key in ("mean", "var", "count"):
        torch.testing.assert_close(vm[key], lm[key])
    y = torch.randn(S, 6, 2, generator=g)
    vn = torch.func.vmap(lambda s, x: normalize(s, x, clip=5.0))(v, y)
    torch.testing.assert_close(vn, torch.stack([normalize(v[i], y[i], clip=5.0) for i in range(S)]))


def test_normalize_denormalize_round_trip_and_clip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=g) * torch.tensor([1.0, 10.0, 0.01]) + torch.tensor([5.0, -3.0, 100.0])
    s = update_running_stats(init_running_stats((3,)), x)
    y = normalize(s, x)
    x64 = x.double()
    y_ref = (x64 - x64.mean(0)) / torch.sqrt(x64.var(0, unbiased=False) + 1e-8)
    # column 2 (100 +- 0.01) is quantised by float32 to 7.6e-6 / 0.01 ~ 8e-4 of a std
    torch.testing.assert_close(y.double(), y_ref, atol=2e-3, rtol=0)
    torch.testing.assert_close(y[:, :2].mean(0), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(y[:, :2].var(0, unbiased=False), torch.ones(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(denormalize(s, y), x, atol=1e-4, rtol=1e-5)
    far = normalize(s, x + 1e6, clip=10.0)
    assert far.abs().max().item() == 10.0


def test_scale_reward():
    returns = torch.tensor([1.0, 3.0, 5.0, 7.0])
    s = update_running_stats(init_running_stats(()), returns)
    reward = torch.tensor([[2.0], [-4.0]])
    torch.testing.assert_close(scale_reward(reward, s), reward / torch.sqrt(torch.tensor(5.0 + 1e-8)))
    s1 = update_running_stats(init_running_stats((1,)), returns[:, None])
    torch.testing.assert_close(scale_reward(reward, s1), scale_reward(reward, s))


def test_count_past_2_24_freezes_and_the_update_becomes_an_exponential_average():
    """The float32 count is exact up to 2^24 samples (the docstring used to promise a tiny relative
    error beyond). At count 2^24 one more sample rounds count + 1 back to 2^24 (ties to even): the
    count stays, and every update merges with the same weight 1 / (2^24 + 1) ~ 2^-24 of the frozen
    count, an exponential moving average; larger batches advance it by n_b rounded to float32's
    spacing (2 in [2^24, 2^25))."""
    s = init_running_stats(())
    s["count"] = torch.tensor(2.0**24)
    assert s["count"].dtype == torch.float32  # the stored dtype snapshots hold
    one = update_running_stats(s, torch.tensor([1.0]))
    assert one["count"].item() == 2.0**24  # 16777216: frozen
    assert one["mean"].item() == 2.0**-24 and one["var"].item() == 1.0
    two = update_running_stats(one, torch.tensor([1.0]))
    assert two["count"].item() == 2.0**24
    # m_k = 1 - (1 - w)^k with the fixed weight w = 2^-24 (float32's n_b / fl(count + n_b))
    assert two["mean"].item() == pytest.approx(1 - (1 - 2.0**-24) ** 2, rel=1e-6)
    assert update_running_stats(s, torch.ones(3))["count"].item() == 2.0**24 + 4  # 2^24 + 3 rounds to even
    assert update_running_stats(s, torch.ones(1000))["count"].item() == 2.0**24 + 1000  # a multiple of 2: exact
    s["count"] = torch.tensor(2.0**25)  # spacing 4: batches of 1 and 2 leave it
    assert update_running_stats(s, torch.ones(2))["count"].item() == 2.0**25


def test_normalize_on_another_device_than_the_stats_is_one_line():
    # found by a new user: normalize with stats on another device than x was a RuntimeError from inside
    s = init_running_stats((3,), device="meta")
    with pytest.raises(ShapeError, match=r"^x: on device cpu, but stats are on meta$"):
        normalize(s, torch.zeros(2, 3))
    with pytest.raises(ShapeError, match=r"^y: on device cpu, but stats are on meta$"):
        denormalize(s, torch.zeros(2, 3))
    with pytest.raises(ShapeError, match=r"^x: on device cpu, but stats are on meta$"):
        update_running_stats(s, torch.zeros(2, 3))


def test_init_running_stats_takes_an_int_shape_and_names_a_bad_one():
    # found by a new user: init_running_stats(3) was TypeError: 'int' object is not iterable
    s = init_running_stats(3)
    assert s["mean"].shape == (3,) and s["var"].shape == (3,) and s["count"].shape == ()
    assert init_running_stats(torch.Size([2, 4]))["mean"].shape == (2, 4)
    for bad in ("3", 3.0, (3.0,), None, True):
        with pytest.raises(ConfigError, match=rf"^shape={bad!r}: expected an int or a sequence of ints".replace("(", r"\(").replace(")", r"\)")):
            init_running_stats(bad)


def test_bad_inputs_raise():
    s = init_running_stats((3,))
    with pytest.raises(ShapeError, match="x"):
        update_running_stats(s, torch.zeros(4, 2))
    with pytest.raises(ShapeError, match="mask"):
        update_running_stats(s, torch.zeros(4, 3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ShapeError, match="mask"):
        update_running_stats(s, torch.zeros(4, 3), torch.ones(4))
    with pytest.raises(ShapeError, match="stats"):
        update_running_stats(s.exclude("count"), torch.zeros(4, 3))
    with pytest.raises(ShapeError, match="b"):
        merge_running_stats(s, init_running_stats((2,)))
    with pytest.raises(ShapeError, match="y"):
        denormalize(s, torch.zeros(3, 4))
    with pytest.raises(ShapeError, match="reward"):
        scale_reward(torch.zeros(5, 2), s)
    with pytest.raises(ShapeError, match="vmap"):
        update_running_stats(torch.stack([s, s]), torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="clip"):
        normalize(s, torch.zeros(3), clip=0.0)
    with pytest.raises(ConfigError, match="eps"):
        normalize(s, torch.zeros(3), eps=-1.0)
    with pytest.raises(ConfigError, match="dtype"):
        init_running_stats((3,), dtype=torch.int64)


def test_a_huge_finite_row_is_skipped_not_merged():
    # new-user pass: one 1e20 observation (finite) overflowed the float32 variance to inf for good, and that
    # feature normalised to 0 from then on
    torch.manual_seed(0)
    s = update_running_stats(init_running_stats(3), torch.randn(1000, 3))
    b = torch.randn(16, 3)
    b[0, 0] = 1e20
    merged = update_running_stats(s, b)
    reference = update_running_stats(s, b[1:])  # the row skipped, as a NaN row is
    assert torch.equal(merged["var"], reference["var"]) and torch.equal(merged["count"], reference["count"])
    for _ in range(3):
        merged = update_running_stats(merged, torch.randn(64, 3))
    assert torch.isfinite(merged["var"]).all() and normalize(merged, torch.ones(1, 3)).abs().min() > 0


def test_float64_statistics_are_float64_accurate():
    """TorchRL pass: with float64 mean/var the merge weight n_b / n was formed from the float32 counts
    in float32, so 3 zeros then 7 ones gave mean 0.699999988 and var 0.210000005."""
    s = init_running_stats((), dtype=torch.float64)
    s = update_running_stats(update_running_stats(s, torch.zeros(3, dtype=torch.float64)), torch.ones(7, dtype=torch.float64))
    assert s["mean"].item() == pytest.approx(0.7, abs=1e-15) and s["var"].item() == pytest.approx(0.21, abs=1e-15)
    x = torch.randn(4, 350, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 3 + 1
    s = init_running_stats((3,), dtype=torch.float64)
    for chunk in x:
        s = update_running_stats(s, chunk)
    flat = x.reshape(-1, 3)
    torch.testing.assert_close(s["mean"], flat.mean(0), rtol=0, atol=1e-13)
    torch.testing.assert_close(s["var"], flat.var(0, correction=0), rtol=0, atol=1e-13)


def test_a_non_number_eps_or_clip_is_a_config_error_naming_it():
    """Regression (functional-core pass): eps or clip given as a str or None was a bare TypeError."""
    stats = update_running_stats(init_running_stats(2), torch.randn(10, 2))
    x = torch.randn(3, 2)
    for call, name in ((lambda: normalize(stats, x, eps="1e-8"), "eps="), (lambda: normalize(stats, x, clip="10"), "clip="),
                       (lambda: denormalize(stats, x, eps=None), "eps="),
                       (lambda: scale_reward(x[:, :1], init_running_stats(1), eps="0"), "eps=")):
        with pytest.raises(ConfigError, match=name):
            call()
    torch.testing.assert_close(denormalize(stats, normalize(stats, x, eps=1e-8), eps=1e-8), x)  # numbers still pass
    torch.testing.assert_close(normalize(stats, x, eps=torch.tensor(1e-8), clip=torch.tensor(10.0)), normalize(stats, x, clip=10.0))
