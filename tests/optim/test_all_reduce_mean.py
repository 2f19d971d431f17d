"""all_reduce_mean, the data-parallel link: the mean of every rank's gradients, one collective per bucket."""

import torch
from tensordict import TensorDict

from rlfunc.optim import adam, all_reduce_mean, chain, clip_by_global_norm, flatten
from rlfunc.optim import distributed as optim_dist


def _grads(rank: int) -> TensorDict:
    g = torch.Generator().manual_seed(100 + rank)
    return TensorDict({"actor": {"0": {"weight": torch.randn(3, 4, generator=g), "bias": torch.randn(3, generator=g)}},
                       "log_std": torch.randn(2, generator=g), "step": torch.arange(5.0) * (rank + 1)}, batch_size=[])


def _mean_on_ranks(dist, bucket_bytes, counts):
    calls = []
    real = torch.distributed.all_reduce
    torch.distributed.all_reduce = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        grads = _grads(dist.rank)
        before = grads.clone()
        link = all_reduce_mean(bucket_bytes=bucket_bytes)
        out, state = link.update(grads, link.init(grads))
    finally:
        torch.distributed.all_reduce = real
    expected = (_grads(0) + _grads(1)) / 2
    for key in expected.keys(include_nested=True, leaves_only=True):
        torch.testing.assert_close(out.get(key), expected.get(key), rtol=0, atol=1e-7)
        assert torch.equal(grads.get(key), before.get(key))  # the input gradients are not written into
    assert len(list(state.keys())) == 0
    counts.append(len(calls))
    assert len(calls) == (1 if bucket_bytes > 1000 else 4), calls  # one collective per bucket


def _ranks(dist):
    _mean_on_ranks(dist, 25 * 2**20, [])
    _mean_on_ranks(dist, 16, [])  # every leaf its own bucket (tiny buckets)
    # the whole chain: every rank takes the same step from different local gradients
    params = TensorDict({"w": torch.zeros(4)}, batch_size=[])
    update = chain(all_reduce_mean(), clip_by_global_norm(100.0), adam(0.1))
    state = update.init(params)
    local = TensorDict({"w": torch.tensor([1.0, -2.0, 3.0, 0.0]) * (dist.rank + 1)}, batch_size=[])
    step, _ = update.update(local, state, params)
    gathered = [torch.empty(4) for _ in range(2)]
    torch.distributed.all_gather(gathered, step["w"])
    assert torch.equal(gathered[0], gathered[1])


def test_all_reduce_mean_is_the_mean_of_the_ranks_gradients(gloo):
    gloo(_ranks)


def test_all_reduce_mean_is_the_identity_in_one_process():
    grads = _grads(0)
    link = all_reduce_mean()
    leaves, treedef = flatten(grads)
    out, _ = link.update_leaves(leaves, treedef, link.init(grads))
    assert all(a is b for a, b in zip(out, leaves))
    assert optim_dist.world_size() == 1


def test_buckets_split_by_size_and_dtype():
    ts = [torch.zeros(4), torch.zeros(4), torch.zeros(2, dtype=torch.float64), torch.zeros(100), torch.zeros(1)]
    assert optim_dist.buckets(ts, 32) == [[0, 1], [2], [3], [4]]
    assert optim_dist.buckets(ts, 10**6) == [[0, 1, 3, 4], [2]]
