"""The asynchronous collector (issue 16, item 2): a worker process steps the envs with the weights the
learner publishes. Its stream equals the in-process rollout of the same policy; a publish reaches the
worker's actions and is stamped with its version; warm-up steps use the warm policy; a worker that
raises or is killed is an EnvError naming what happened."""

import os
import signal
import threading
import time

import pytest
import torch
from tensordict import TensorDict

from rlfunc.envs import collect
from rlfunc.envs.async_collect import AsyncCollector
from rlfunc.errors import ConfigError, EnvError

ENV, N = "Pendulum-v1", 2


class LinearPolicy:
    """action = tanh(observation @ w + b) * 2 (deterministic); warm: the constant -1."""

    def __call__(self, weights, generator, warm):
        if warm:
            return lambda obs: (torch.full((obs.shape[0], 1), -1.0), None)
        return lambda obs: (torch.tanh(obs @ weights["w"] + weights["b"]) * 2, None)


class Broken:
    def __call__(self, weights, generator, warm):
        raise ValueError("no policy here")


def _weights(scale=0.3):
    g = torch.Generator().manual_seed(0)
    return TensorDict({"w": torch.randn(3, 1, generator=g) * scale, "b": torch.zeros(1)}, batch_size=[])


def test_the_stream_is_the_in_process_rollout_of_the_same_policy():
    seeds = collect.env_seeds(7, N)
    weights = _weights()
    c = AsyncCollector(ENV, N, seeds, LinearPolicy(), weights, steps_per_item=3)
    try:
        got = [c.next() for _ in range(4)]
    finally:
        c.close()
    venv = collect.make_vec_env(ENV, N)
    carry = collect.reset(venv, seeds)
    policy = LinearPolicy()(weights, None, False)
    for batch, version in got:
        assert version == 0 and batch.batch_size == torch.Size([N, 3])
        want, carry = collect.rollout(venv, policy, carry, 3, device=torch.device("cpu"))
        for key in want.keys(True, True):
            torch.testing.assert_close(batch[key], want[key], rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    venv.close()


def test_a_publish_reaches_the_actions_and_its_version_is_stamped():
    seeds = collect.env_seeds(1, N)
    zero = TensorDict({"w": torch.zeros(3, 1), "b": torch.zeros(1)}, batch_size=[])
    c = AsyncCollector(ENV, N, seeds, LinearPolicy(), zero, queue_size=2)
    try:
        batch, version = c.next()
        assert version == 0 and torch.equal(batch["action"], torch.zeros(N, 1, 1))
        assert c.publish(TensorDict({"w": torch.zeros(3, 1), "b": torch.full((1,), 0.25)}, batch_size=[])) == 1
        versions = []
        for _ in range(10):  # at most queue_size + 1 items were collected with the old weights
            batch, version = c.next()
            versions.append(version)
            want = 0.0 if version == 0 else 2 * torch.tanh(torch.tensor(0.25))
            torch.testing.assert_close(batch["action"], torch.full((N, 1, 1), float(want)))
        assert versions[:4].count(0) <= 3 and versions[-1] == 1 and versions == sorted(versions)
    finally:
        c.close()


def test_warm_steps_act_with_the_warm_policy_then_the_weights():
    c = AsyncCollector(ENV, N, collect.env_seeds(2, N), LinearPolicy(), _weights(0.0), warm_steps=3 * N, start_steps=N)
    try:
        actions = [c.next()[0]["action"] for _ in range(4)]
    finally:
        c.close()
    assert [float(a.flatten()[0]) for a in actions] == [-1.0, -1.0, 0.0, 0.0]  # env steps N and 2N warm, 3N not


def test_a_worker_that_raises_or_is_killed_is_an_env_error():
    c = AsyncCollector(ENV, N, collect.env_seeds(0, N), Broken(), _weights())
    try:
        with pytest.raises(EnvError, match="collector process: ValueError: no policy here"):
            c.next()
    finally:
        c.close()
    c = AsyncCollector(ENV, N, collect.env_seeds(0, N), LinearPolicy(), _weights(), timeout_s=30)
    try:
        c.next()
        os.kill(c.process.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EnvError, match=r"the collector process ended \(exit code -9\)"):
            for _ in range(10):  # the items already queued come first
                c.next()
        assert time.monotonic() - t0 < 10
    finally:
        c.close()


def test_a_worker_killed_while_it_holds_the_weights_lock_is_an_env_error_not_a_hang():
    # SIGKILL of the collector as it copied the weights left their lock held: the learner's next
    # publish waited forever, and SIGTERM could not stop it (its handler waits for the iteration's end)
    c = AsyncCollector(ENV, N, collect.env_seeds(0, N), LinearPolicy(), _weights(), timeout_s=30)
    try:
        c.next()
        assert c.lock.acquire(timeout=5)  # held, as by a worker killed inside its copy
        os.kill(c.process.pid, signal.SIGKILL)
        raised = []

        def publish():  # in a daemon thread, so that a regression fails here instead of hanging the suite
            try:
                c.publish(_weights(1.0))
            except EnvError as e:
                raised.append(str(e))

        thread = threading.Thread(target=publish, daemon=True)
        thread.start()
        thread.join(timeout=10)
        assert not thread.is_alive(), "publish still waits on the dead worker's lock"
        assert raised == ["the collector process ended (exit code -9)"]
    finally:
        c.close()


def test_bad_sizes_are_config_errors():
    with pytest.raises(ConfigError, match="queue_size=0"):
        AsyncCollector(ENV, N, [0, 1], LinearPolicy(), _weights(), queue_size=0)
    with pytest.raises(ConfigError, match="seeds: 1 given, expected num_envs=2"):
        AsyncCollector(ENV, N, [0], LinearPolicy(), _weights())
