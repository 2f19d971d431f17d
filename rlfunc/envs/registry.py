"""The env registry: env id -> what rlfunc can do with that env beyond gymnasium's ``make``.

rlfunc never names an environment; it asks here. An entry says how to build the env torch-batched on
the device, its scripted expert, its own episode statistics and, for a multi-agent env, how to build
and evaluate it. Any gymnasium id works without an entry (through gymnasium vector envs and
:class:`rlfunc.envs.chunk.GymChunkEnv`); an entry only adds what gymnasium cannot give.

Environments register themselves: the repository's top-level ``envs`` package (whose
``envs/registry_entries.py`` calls :func:`register`) is imported on the first :func:`find`,
:func:`lookup`, :func:`ids` or :func:`ensure_loaded`; importing it also registers its ids with
gymnasium. This is the one place in rlfunc that imports ``envs``. Other packages plug in the same
way, without touching rlfunc: each module named by an entry point of the group ``"rlfunc.envs"``
(``[project.entry-points."rlfunc.envs"] my_robot = "my_robot.rlfunc_entries"`` in its
pyproject.toml, as gymnasium's ``"gymnasium.envs"`` plugins do) is imported then too and calls
:func:`register` (and ``gymnasium.register`` for its ids).

An id ending in ``*`` is a pattern (:func:`fnmatch.fnmatchcase`) matched when no exact id is
registered, e.g. ``"rware-*"`` for a family of ids built by one function.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from rlfunc.errors import EnvError


@dataclass(frozen=True)
class EnvEntry:
    """What rlfunc can do with one env id; every field is optional (None / False: the env has none).

    Calling conventions (N = num_envs):

    - ``torch_env(N, *, act_steps=1, device, seed)`` -> a TorchRL ``EnvBase`` with batch [N] on
      ``device``, Box "observation" [N, D] float32, actions [N, A] (``act_steps == 1``) or
      [N, act_steps, A] chunks in [-1, 1], and ``state`` / ``set_state`` / ``rng_state`` /
      ``set_rng_state`` for grouped rollouts and exact resume. A data-parallel run (dppo) passes
      ``split=(rank, world_size)``: the N envs are then envs rank*N .. (rank+1)*N - 1 of the
      world_size*N that one env of ``seed`` steps (every reset draws for all and keeps its rows),
      and ``any_done_of_split(done_here: bool) -> bool`` (a collective, once per step): whether an env
      of any rank is done, so every rank draws when the single process would
      (:class:`rlfunc.envs.split.SplitEnv` does this part).
    - ``demonstrations(env_id, num_episodes, horizon, *, seed, noise_std, device)`` -> (dataset,
      summary) as :func:`rlfunc.envs.demos.expert_demonstrations`: the scripted expert's episodes.
    - ``episode_metrics(rollout)`` -> TensorDict of 0-d tensors: the env's own statistics of the
      episodes that end in ``rollout`` (("next", "done") bool and the env's keys, any batch shape),
      e.g. which goal was reached.
    - ``multi_agent_env(config, N, device, seed)`` -> a TorchRL ``EnvBase`` with batch [N], ``n_agents``,
      ("agents", "observation" | "action") keys and ("agents", "action_mask") where it masks actions,
      on ``device`` or on the host; ``config`` is the run's
      :class:`rlfunc.algos.mappo.MAPPOConfig` (its env fields: ``env``, ``n_agents``, ``episode_steps``,
      ``shaping_scale``, ``conflict_penalty``; ``multi_agent_fields`` names those it reads, and a
      new run refuses the others set away from their defaults). With ``multi_agent_split``, a
      data-parallel run passes ``split=(rank, world_size)`` and ``any_done_of_split`` as to ``torch_env``.
    - ``multi_agent_eval(config, act, device)`` -> eval.json's content for the policy
      ``act(observation [N, A, D], action_mask [N, A, K] | None) -> action [N, A]``.
    """

    torch_env: Callable[..., Any] | None = None  # builder of the torch-batched TorchRL env (see above)
    demonstrations: Callable[..., Any] | None = None  # the scripted expert's BC dataset (see above)
    episode_metrics: Callable[[Any], Any] | None = None  # the env's statistics of ended episodes (see above)
    multi_agent_env: Callable[..., Any] | None = None  # builder of the batched multi-agent env (see above)
    multi_agent_eval: Callable[..., dict] | None = None  # final evaluation of a multi-agent policy (see above)
    settable_state: bool = False  # multi-agent: state / set_state / rng_state capture it (grouped resets, exact resume)
    multi_agent_split: bool = False  # multi-agent: multi_agent_env takes split= and any_done_of_split= (a data-parallel run)
    multi_agent_fields: tuple[str, ...] = ()  # multi-agent: the MAPPOConfig env fields multi_agent_env reads (see above)


_ENTRIES: dict[str, EnvEntry] = {}
_loaded = False
PLUGIN_GROUP = "rlfunc.envs"  # entry points whose modules register envs (see the module docstring)


def ensure_loaded() -> None:
    """Import the ``envs`` package once, so that its entries are here and its ids in gymnasium's
    registry. Without it (rlfunc installed on its own) the registry stays empty; gymnasium ids still work."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: an env that looks an id up while it registers must not import envs again
    try:
        import envs  # (envs/registry_entries.py registers our environments)
    except ModuleNotFoundError as e:
        if e.name != "envs":
            raise
    else:
        if not getattr(envs, "RLFUNC_ENVS", False):  # the bug: a user's own top-level `envs` hid ours, silently
            import warnings

            warnings.warn(f"the package 'envs' imported from {getattr(envs, '__file__', None) or envs.__path__} is not rlfunc's: "
                          "rlfunc's own environments are not registered (run from another directory, or rename that package)",
                          stacklevel=2)
    for plugin in importlib.metadata.entry_points(group=PLUGIN_GROUP):  # other packages' envs
        try:
            plugin.load()
        except Exception as e:  # noqa: BLE001  a broken plugin is named, in one line
            _loaded = False  # named again on the next call (it went on without the plugin, silently)
            raise EnvError(f"env plugin {plugin.name!r} ({plugin.value}, entry point group {PLUGIN_GROUP!r}) failed to load: "
                           f"{type(e).__name__}: {e}") from e


def register(env_id: str, entry: EnvEntry) -> None:
    """Register ``entry`` under ``env_id`` (an exact id, or a pattern ending in ``*``).

    Raises:
        EnvError: ``env_id`` is not a non-empty str, ``entry`` is not an :class:`EnvEntry`, or the id
            is already registered.
    """
    if not isinstance(env_id, str) or not env_id:
        raise EnvError(f"env_id={env_id!r}: expected a non-empty str")
    if not isinstance(entry, EnvEntry):
        raise EnvError(f"entry={entry!r} for env={env_id!r}: expected an rlfunc.envs.registry.EnvEntry")
    if env_id in _ENTRIES:
        raise EnvError(f"env={env_id!r}: already in the env registry")
    _ENTRIES[env_id] = entry


def find(env_id: str) -> EnvEntry | None:
    """The entry of ``env_id`` (an exact id first, then the first matching pattern), None if it has none."""
    ensure_loaded()
    if env_id in _ENTRIES:
        return _ENTRIES[env_id]
    if isinstance(env_id, str):
        for pattern, entry in _ENTRIES.items():
            if pattern.endswith("*") and fnmatch.fnmatchcase(env_id, pattern):
                return entry
    return None


def lookup(env_id: str) -> EnvEntry:
    """The entry of ``env_id``, as :func:`find`.

    Raises:
        EnvError: no entry matches; the message names the id and the registered ids.
    """
    entry = find(env_id)
    if entry is None:
        raise EnvError(f"env={env_id!r}: not in rlfunc's env registry (registered: {', '.join(_ENTRIES) or 'none'})")
    return entry


def torch_builder(env_id: str) -> Callable[..., Any] | None:
    """The :attr:`EnvEntry.torch_env` builder of ``env_id``; None when it has no entry or no torch-batched env."""
    entry = find(env_id)
    return None if entry is None else entry.torch_env


def ids(having: str | None = None) -> tuple[str, ...]:
    """Registered ids (and patterns), in registration order; with ``having``, only those whose entry
    sets that field (not None / False), e.g. ``ids("torch_env")``.

    Raises:
        EnvError: ``having`` is not a field of :class:`EnvEntry`.
    """
    ensure_loaded()
    if having is None:
        return tuple(_ENTRIES)
    names = [f.name for f in fields(EnvEntry)]
    if having not in names:
        raise EnvError(f"having={having!r}: expected a field of EnvEntry ({', '.join(names)})")
    return tuple(k for k, e in _ENTRIES.items() if getattr(e, having) not in (None, False))


def lazy(target: str) -> Callable[..., Any]:
    """A callable that imports ``"module:attribute"`` on its first call and forwards every call to it,
    so that registering an env does not import its (heavy) module."""
    module, _, attribute = target.partition(":")
    if not module or not attribute:
        raise EnvError(f"target={target!r}: expected 'module:attribute'")
    resolved: list[Callable[..., Any]] = []

    def call(*args: Any, **kwargs: Any) -> Any:
        if not resolved:
            resolved.append(getattr(importlib.import_module(module), attribute))
        return resolved[0](*args, **kwargs)

    call.__name__ = call.__qualname__ = attribute
    call.__doc__ = f"{target}, imported on first call."
    return call
