"""all_reduce_running_stats: ranks that each saw part of the data end with the statistics of all of it."""

import torch

from rlfunc.core import func
from rlfunc.core.normalize import all_reduce_running_stats, init_running_stats, merge_running_stats, update_running_stats


def _data(stacked: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    shape = (2, 1000, 3) if stacked else (1000, 3)  # [S,] samples, features
    return torch.randn(shape, generator=g) * torch.tensor([1.0, 3.0, 0.1]) + torch.tensor([5.0, -2.0, 0.5])


def _reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # float64, population variance
    x = x.double()
    return x.mean(-2), x.var(-2, correction=0)


def _ranks(dist):
    for stacked in (False, True):
        x = _data(stacked)
        history, mine = x[..., :100, :], x[..., 100:, :].chunk(2, dim=-2)[dist.rank]  # 450 samples each
        update = func.vmap(update_running_stats) if stacked else update_running_stats
        merge = func.vmap(merge_running_stats) if stacked else merge_running_stats
        empty = init_running_stats((3,))
        if stacked:
            empty = torch.stack([empty, empty])
        shared = update(empty, history)  # the same on both ranks
        batch = update(empty, mine)  # this rank's increment
        total = merge(shared, all_reduce_running_stats(batch))
        mean, var = _reference(x)
        torch.testing.assert_close(total["mean"].double(), mean, rtol=1e-6, atol=0)
        torch.testing.assert_close(total["var"].double(), var, rtol=1e-6, atol=0)
        assert torch.equal(total["count"], torch.full(total["count"].shape, 1000.0))
        # a rank without data contributes nothing
        alone = all_reduce_running_stats(batch if dist.rank == 0 else empty)
        for k in ("mean", "var", "count"):
            gathered = [torch.empty_like(alone[k]) for _ in range(2)]
            torch.distributed.all_gather(gathered, batch[k] if dist.rank == 0 else torch.empty_like(batch[k]))
            torch.testing.assert_close(alone[k], gathered[0], rtol=1e-6, atol=1e-6)
        # no data anywhere: unchanged
        assert torch.equal(all_reduce_running_stats(empty)["var"], empty["var"])


def test_two_ranks_with_half_the_data_each_end_with_the_whole_datas_statistics(gloo):
    gloo(_ranks)


def test_all_reduce_running_stats_is_a_copy_in_one_process():
    stats = update_running_stats(init_running_stats((3,)), _data(False))
    out = all_reduce_running_stats(stats)
    assert out is not stats and all(torch.equal(out[k], stats[k]) for k in ("mean", "var", "count"))
