"""Constructor checks of rlfunc.nets' MLP and GaussianActorCritic, and gSDE over an empty hidden."""

import pytest
import torch

from rlfunc.core import func
from rlfunc.errors import ConfigError
from rlfunc.nets.actor_critic import GaussianActorCritic, actor_critic_apply
from rlfunc.nets.mlp import MLP


def test_an_unknown_activation_lists_the_accepted_ones():
    # found by a new user: MLP(3, 2, (4,), "gelu") was a bare KeyError: 'gelu'
    with pytest.raises(ConfigError, match=r"^MLP: activation='gelu': expected one of 'tanh', 'relu', 'elu', 'silu'$"):
        MLP(3, 2, (4,), "gelu")
    with pytest.raises(ConfigError, match="activation='gelu'"):
        GaussianActorCritic(3, 2, (4,), "gelu")


def test_an_unknown_exploration_lists_the_accepted_ones():
    # found by a new user: exploration="gSDE" (any value but "gaussian") silently built gSDE
    for exploration in ("gSDE", "sde", None):
        with pytest.raises(ConfigError, match=rf"^GaussianActorCritic: exploration={exploration!r}: expected one of 'gaussian', 'gsde'$"):
            GaussianActorCritic(3, 2, exploration=exploration)
    assert GaussianActorCritic(3, 2, (4,), exploration="gsde").log_std.shape == (4, 2)


def test_gsde_over_an_empty_hidden_uses_the_observation_as_its_features():
    # found by a new user: GaussianActorCritic(3, 2, (), exploration="gsde") was IndexError (hidden[-1]);
    # with no hidden layer the actor is one linear layer and gSDE's z(s) is its input, the observation
    for full_std, shape in ((True, (3, 2)), (False, (3, 1))):
        net = GaussianActorCritic(3, 2, (), exploration="gsde", full_std=full_std)
        assert net.log_std.shape == shape and len(net.actor) == 1
        params = func.params_from_module(net)
        obs = torch.randn(5, 3)
        loc, log_std, value, latent = actor_critic_apply(net, params, obs)
        assert torch.equal(latent, obs) and loc.shape == (5, 2) and value.shape == (5, 1)
        for a, b in zip((loc, log_std, value, latent), func.apply(net, params, obs, return_latent=True)):
            assert torch.equal(a, b)
