"""The run's settings, shared by every algorithm: :class:`RunConfig`, nested as ``config.run`` in each
algorithm's config (which holds only its hyperparameters); :func:`replace`, a copy of a config with
changes (run fields routed into ``run``); :func:`from_dict`, a config from its JSON form (a snapshot's
meta "config", config.json), nested or of the flat layout written before RunConfig existed.

It sits at the top of the package beside ``device.py`` and ``errors.py``, not in ``rlfunc/run/``:
every algorithm's config (``rlfunc/algos/``) nests it, and ``run/`` sits above ``algos/``, so there
it would be an upward import.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from rlfunc.errors import CheckpointError, ConfigError

T = TypeVar("T")

VMAP_MODES = ("auto", "vmap", "loop")
PRECISIONS = ("off", "auto", "bf16", "fp16")
FLOAT32_MAX = 3.4028234663852886e38  # a finite float field beyond it overflows in a float32 op
# an evaluation steps one env per episode (and seed) at once: ~1 MB each for a MuJoCo env, so 10,000
# is ~10 GB; more was an out-of-memory traceback (`rlfunc eval RUN --episodes 100000000`)
MAX_EVAL_ENVS = 10_000


def check_episodes(episodes, copies: int = 1, name: str = "episodes") -> None:
    """ConfigError unless ``episodes`` is an int >= 1 with ``episodes * copies`` (the seeds evaluated
    together) at most :data:`MAX_EVAL_ENVS`, the envs an evaluation steps at once."""
    if isinstance(episodes, bool) or not isinstance(episodes, numbers.Integral) or episodes < 1:
        raise ConfigError(f"{name}={episodes!r}: expected an integer >= 1")
    if episodes * copies > MAX_EVAL_ENVS:
        per = f" per seed, {copies} seeds" if copies > 1 else ""
        most = MAX_EVAL_ENVS // copies  # 0 for more seeds than the limit: the seeds alone are too many (it said "at most 0")
        want = f"at most {most}" if most else f"fewer than {MAX_EVAL_ENVS + 1} seeds x episodes (evaluate fewer seeds together)"
        raise ConfigError(f"{name}={episodes}{per}: expected {want} (an evaluation steps one env "
                          f"per episode at once, at most {MAX_EVAL_ENVS}: about 1 MB each for a MuJoCo env)")


def check_eval_seed(seed) -> None:
    """ConfigError unless ``seed`` (an evaluation's first reset seed, ``rlfunc eval --seed``) is None or an
    integer in [0, 2**31) (-5 or 1e11 reached numpy's or an env's own error, or were taken silently)."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**31):
        raise ConfigError(f"seed={seed!r}: expected an integer in [0, 2**31)")


@dataclass(frozen=True)
class RunConfig:
    """How a run is run: seeds, device, threads, how seeds are mapped, mixed precision, the snapshot
    and version cadence, metrics lines and the final evaluation. Each algorithm's config nests one
    (``config.run``) with its own defaults; an algorithm that cannot honour a field refuses a value
    other than the default in its config's ``__post_init__``."""

    seed: int = 0  # first seed (init, env and noise); seed i of --num-seeds is seed + i
    num_seeds: int = 1  # independent agents trained together (stacked params; ppo, grpo)
    device: str = "auto"  # auto | cpu | cuda | npu (rlfunc.device)
    torch_threads: int = 1  # intra-op CPU threads (0: torch's default); small nets run best on 1
    vmap: Literal["auto", "vmap", "loop"] = "auto"  # how seeds are mapped (loop on npu; ppo, grpo)
    precision: Literal["off", "auto", "bf16", "fp16"] = "off"  # autocast of the networks (rlfunc.optim.amp; bc, dppo, td3-diffusion, sac-diffusion, ppo-encoder; fp16 scales the loss)
    checkpoint_every: int = 10  # iterations between snapshots in RUN_DIR/checkpoints (0: only at the end)
    keep_checkpoints: int = 3  # snapshots kept in RUN_DIR/checkpoints (0: all)
    version_every: int = 0  # iterations between versions in RUN_DIR/versions (0: off); see rlfunc.run.versions
    version_keep_last: int = 20  # newest versions kept per branch (0: all)
    version_keep_every: int = 0  # also keep versions whose iteration is a multiple of this (0: no such rule)
    log_every: int = 1  # iterations between metrics lines (bc)
    eval_episodes: int = 10  # episodes of the final evaluation (mappo: per eval seed)
    nproc: int = 1  # data-parallel processes on this node: `rlfunc train` starts them with torchrun (every algorithm: ppo, ppo-encoder, bc, dppo, grpo, gspo, mappo, sac, td3, td3-diffusion, sac-diffusion)
    profile: int = 0  # iterations to record with the device's profiler into RUN_DIR/profile (0: none)
    compile: Literal["off", "auto", "on"] = "auto"  # torch.compile of the gradient step (ppo, sac, td3, dppo, bc, ppo-encoder, sac-diffusion, td3-diffusion, grpo, gspo, mappo; auto: where it pays off, else eager)
    env_workers: int = 0  # worker processes stepping the envs, num_envs / env_workers each (0: in the learner's process; ppo, ppo-encoder, dppo, grpo, gspo, sac, td3, td3-/sac-diffusion)

    def __post_init__(self) -> None:
        check_fields(self, "run.")
        for name in ("num_seeds", "log_every", "eval_episodes", "nproc"):
            _check_int(name, getattr(self, name), 1, "a positive integer")
        for name in ("profile", "torch_threads", "env_workers", "checkpoint_every", "keep_checkpoints", "version_every", "version_keep_last",
                     "version_keep_every"):
            _check_int(name, getattr(self, name), 0, "an integer >= 0")
        check_episodes(self.eval_episodes, self.num_seeds, "run.eval_episodes")
        _check_int("seed", self.seed, 0, "an integer in [0, 2**31 - num_seeds]")
        if self.seed + self.num_seeds > 2**31:
            raise ConfigError(f"run.seed={self.seed}: expected an integer in [0, 2**31 - num_seeds], "
                              f"num_seeds={self.num_seeds} (every seed used is < 2**31)")
        if not isinstance(self.device, str) or not self.device:
            raise ConfigError(f"run.device={self.device!r}: expected a device name (auto, cpu, cuda, npu ...)")
        if self.vmap not in VMAP_MODES:
            raise ConfigError(f"run.vmap={self.vmap!r}: expected 'auto', 'vmap' or 'loop'")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"run.precision={self.precision!r}: expected off, auto, bf16 or fp16")
        if self.compile not in ("off", "auto", "on"):
            raise ConfigError(f"run.compile={self.compile!r}: expected off, auto or on")

    @property
    def seeds(self) -> list[int]:
        """The seeds of the run's members: seed, seed + 1, ..., seed + num_seeds - 1."""
        return [self.seed + i for i in range(self.num_seeds)]


def _check_int(name: str, value: Any, low: int, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"run.{name}={value!r}: expected {expected}")


RUN_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig))


def require_default(run: RunConfig, **why: str) -> None:
    """ConfigError for the first of ``why``'s run fields that ``run`` sets to a value other than
    RunConfig's default: the algorithm cannot honour it, and ``why[name]`` says so ("bc trains one
    seed per run").

    Raises:
        ConfigError: "run.NAME=VALUE: WHY"; or ``run`` is not a RunConfig.
    """
    if not isinstance(run, RunConfig):
        raise ConfigError(f"run={run!r}: expected a RunConfig")
    for name, reason in why.items():
        value = getattr(run, name)
        if value != getattr(_RUN_DEFAULTS, name):
            raise ConfigError(f"run.{name}={value!r}: {reason}")


def check_new_ppo_run(config: Any, *, per_micro_batch: bool = False) -> None:
    """ConfigError for a PPO-family config (``minibatch_size``, ``normalize_advantages``) that would
    train nothing, or nothing on some samples: a one-sample group's advantage normalises to 0, so its
    policy loss and gradient are 0. The groups are the minibatches, or with ``per_micro_batch`` (dppo
    in one process) the pieces of ``micro_batch_size`` a minibatch is split into (the last one is the
    remainder). Checked where a new run is built, not in the config's validation, so that a run saved
    with it can still be evaluated and resumed."""
    if not config.normalize_advantages:
        return
    if config.minibatch_size == 1:
        raise ConfigError("minibatch_size=1 with normalize_advantages: a one-sample minibatch's advantage normalises to 0, "
                          "so the policy would never move; use minibatch_size >= 2 or turn normalize_advantages off")
    micro = getattr(config, "micro_batch_size", None) if per_micro_batch else None
    if micro is not None and micro < config.minibatch_size and (micro == 1 or config.minibatch_size % micro == 1):
        raise ConfigError(f"micro_batch_size={micro} with minibatch_size={config.minibatch_size} and normalize_advantages: the "
                          "advantages are normalised per micro-batch, and a one-sample micro-batch's normalises to 0 (its "
                          "samples would never move the policy); choose a micro_batch_size that leaves no piece of one sample")


def check_dependents(config: Any, base: Any) -> None:
    """ConfigError for a field that ``config`` sets away from ``base`` (what the run was configured
    from: the class defaults or an env preset) while the switch that field serves is off, so the run
    would record it and train as without it (``--sde-sample-freq 8`` without gSDE). The rules are the
    config class's ``dependents`` (a ClassVar beside its fields; none without it): (the switch in
    words, ``on(config) -> bool``, the fields only it reads). Checked where a new run is configured
    (``rlfunc train``, the algorithms' ``preset``), not on every config: runs saved with such a field
    still evaluate and resume.

    Raises:
        ConfigError: "NAME=VALUE: read only with SWITCH, which this run does not have ...".
    """
    for switch, on, names in getattr(type(config), "dependents", ()):
        if on(config):
            continue
        for name in names:
            value = getattr(config, name)
            if value != getattr(base, name):
                raise ConfigError(f"{name}={value!r}: read only with {switch}, which this run does not have (it would be "
                                  f"recorded and change nothing); set that too, or leave {name} at {getattr(base, name)!r}")


def check_env_workers(run: RunConfig, num_envs: int, per: str = "") -> None:
    """ConfigError unless ``run.env_workers`` (0: no workers) divides ``num_envs``, the envs one
    process steps (``per`` says how they were counted, e.g. "num_envs=8 x num_seeds=2"): each
    worker steps ``num_envs / env_workers`` of them.

    Raises:
        ConfigError: "run.env_workers=K: N envs (PER) are not divisible by it ...".
    """
    k = run.env_workers
    if k and num_envs % k:
        raise ConfigError(f"run.env_workers={k}: num_envs={num_envs}{f' ({per})' if per else ''} is not divisible by it "
                          "(each worker process steps num_envs / env_workers envs)")


def replace(config: T, **changes: Any) -> T:
    """A copy of ``config`` (a config dataclass) with ``changes`` applied, validated as a new one. A
    name that is not a field of ``config`` but is one of RunConfig goes into its ``run`` field, so
    ``replace(PPOConfig(), seed=3, lr=1e-3)`` sets ``run.seed`` and ``lr``; a ``run`` given in
    ``changes`` is the one those go into.

    Raises:
        ConfigError: a name that is neither a field of ``config`` nor (for a config with ``run``) of
            RunConfig; or a value the config refuses.
    """
    names = {f.name for f in dataclasses.fields(config)}
    nested = "run" in names and isinstance(config.run, RunConfig)
    unknown = [k for k in changes if k not in names and not (nested and k in RUN_FIELDS)]
    if unknown:
        also = " nor of RunConfig" if nested else ""
        raise ConfigError(f"{unknown[0]}: not a field of {type(config).__name__}{also}")
    run_changes = {k: changes.pop(k) for k in list(changes) if k not in names}
    for owner, given in ((config, changes), (getattr(config, "run", None), run_changes)):
        hints = typing.get_type_hints(type(owner)) if given else {}
        for name, value in given.items():
            given[name] = _check_kind(name, _check_hint(name, value, hints.get(name)), getattr(owner, name))
    if run_changes:
        changes["run"] = dataclasses.replace(changes.get("run", config.run), **run_changes)
    return dataclasses.replace(config, **changes)


def check_fields(config: Any, prefix: str = "") -> None:
    """Every field of the config dataclass ``config`` checked as :func:`replace` checks a change:
    against its declared type and the kind of its default (an ``int`` field takes only integers, a
    tuple of widths only ints, a number field no str, a nested config only a config of its type).
    Values are converted in place where that loses nothing: numpy integers to ints, lists to tuples.
    Each config's ``__post_init__`` calls it first, so ``PPOConfig(num_epochs=1.5)`` fails here, as
    ``replace`` does, not deep inside a run.

    Raises:
        ConfigError: "PREFIXNAME=VALUE: expected ..." for the first field that does not fit.
    """
    hints = _hints(type(config))
    for f in dataclasses.fields(config):
        value, default, name = getattr(config, f.name), _field_default(f), prefix + f.name
        if dataclasses.is_dataclass(default) and not isinstance(value, type(default)):
            raise ConfigError(f"{name}={value!r}: expected a {type(default).__name__}")
        checked = _check_kind(name, _check_hint(name, value, hints.get(f.name)), default)
        if isinstance(checked, float) and math.isfinite(checked) and abs(checked) > FLOAT32_MAX:
            # lr=1e300 was torch's "value cannot be converted to type float without overflow" traceback
            raise ConfigError(f"{name}={checked!r}: expected a number within float32's range (|x| <= 3.4e38)")
        if checked is not value:
            object.__setattr__(config, f.name, checked)


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _check_hint(name: str, value: Any, hint: Any) -> Any:
    """``value`` checked against a field's declared type where it says more than the current value's
    kind: an ``int`` field takes only integers (num_epochs=2.5 failed deep inside a run, num_envs=2.0
    in the env's constructor), a field that is not Optional refuses None (gamma=None was a raw
    TypeError). numpy integers become ints."""
    if hint is None:
        return value
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        if type(None) in options or not any(o in (int, float) for o in options):
            return value
        raise ConfigError(f"{name}=None: expected {'an integer' if float not in options else 'a number'}")
    numeric = [o for o in options if o is not type(None)]
    if (type(None) in options and numeric and all(o in (int, float) for o in numeric)
            and (isinstance(value, bool) or not isinstance(value, numbers.Real))):
        # a `float | None` field (clip_epsilon_high) took "x" and failed in a comparison, naming nothing (one
        # that is not Optional is named by _check_kind, from the kind of its default)
        raise ConfigError(f"{name}={value!r}: expected {'an integer' if float not in options else 'a number'} or None")
    if int in options and float not in options and isinstance(value, numbers.Real) and not isinstance(value, bool):
        if not isinstance(value, numbers.Integral):
            raise ConfigError(f"{name}={value!r}: expected an integer")
        return int(value)
    return value


def _check_kind(name: str, value: Any, current: Any) -> Any:
    """``value`` (a list as a tuple where the field holds a tuple); ConfigError when it is not of the
    kind of the field's ``current`` value (a number, a bool, a str, a tuple), so ``replace(config,
    lr="fast")`` names lr instead of failing in a comparison. None, and fields whose value is None or
    another kind, are left to the config's own checks."""
    if value is None or current is None:
        return value
    if isinstance(current, bool):
        kind, ok = "a bool", isinstance(value, bool)
    elif isinstance(current, numbers.Real):
        kind, ok = "a number", isinstance(value, numbers.Real) and not isinstance(value, bool)
    elif isinstance(current, str):
        kind, ok = "a str", isinstance(value, str)
    elif isinstance(current, tuple):
        kind, ok = "a tuple", isinstance(value, (tuple, list))
        if ok and current and all(isinstance(c, int) and not isinstance(c, bool) for c in current):
            # widths and the like: the bug was hidden=(8.5,) failing inside torch, (8, "a") in a comparison
            kind, ok = "a tuple of ints", all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in value)
            value = tuple(int(v) for v in value) if ok else value
    else:
        return value
    if not ok:
        raise ConfigError(f"{name}={value!r}: expected {kind}")
    return tuple(value) if isinstance(value, list) else value


def from_dict(config_type: type[T], raw: Any, path: Any = "config", *, algo: str | None = None) -> T:
    """The ``config_type`` whose JSON form (``dataclasses.asdict`` through JSON) is ``raw``.

    RunConfig's fields may come nested in "run" or flat beside the others (the layout written before
    RunConfig existed); JSON lists become tuples where the field's type is a tuple; nested config
    dataclasses (``run``, a diffusion config's ``actor``) are built from their dicts, fields they lack
    taking the values of the field's default (so a flat config of an older rlfunc, without a run
    field added since, keeps the algorithm's default of it).

    Raises:
        CheckpointError: naming ``path`` (and ``algo``, the snapshot's algorithm, when given): ``raw``
            is not a dict, has a key that is no field, a value of the wrong type, or one the config refuses.
    """
    try:
        if not isinstance(raw, dict):
            raise TypeError(f"expected a dict, got {type(raw).__name__}")
        return _build(config_type, _nest_run(config_type, raw), None)
    except (KeyError, TypeError, ValueError) as e:  # ConfigError is a ValueError
        what = f"{algo} config" if algo else "config"
        raise CheckpointError(f"{path}: meta.json holds no valid {what}: not a valid {config_type.__name__} ({e})") from None


def _nest_run(config_type: type, raw: dict) -> dict:
    """``raw`` with the RunConfig fields found at its top level moved into "run" (when
    ``config_type`` nests a RunConfig and has no field of that name itself)."""
    names = {f.name for f in dataclasses.fields(config_type)}
    if "run" not in names:
        return raw
    flat = {k: raw[k] for k in raw if k in RUN_FIELDS and k not in names}
    if not flat:
        return raw
    run = raw.get("run", {})
    if not isinstance(run, dict):
        raise TypeError(f"run={run!r}: expected a dict")
    both = sorted(set(flat) & set(run))
    if both:
        raise ValueError(f"{both[0]!r} is given both flat and in 'run'")
    return {**{k: v for k, v in raw.items() if k not in flat}, "run": {**flat, **run}}


def _build(cls: type, raw: dict, default: Any) -> Any:
    """``cls(**raw)``, its values converted by :func:`_convert` to the field types; fields missing
    from ``raw`` take ``default``'s values (``cls``'s own defaults when ``default`` is None)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        raise TypeError(f"{unknown[0]!r} is not a field of {cls.__name__}")
    values = {} if default is None else {name: getattr(default, name) for name in fields if fields[name].init}
    for name, value in raw.items():
        values[name] = _convert(hints[name], value, _field_default(fields[name]))
    return cls(**values)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def _convert(tp: Any, value: Any, default: Any = None) -> Any:
    """``value`` (parsed JSON) as type ``tp``: a dict as a dataclass, a list as a tuple; else as is
    (the config's own ``__post_init__`` checks it)."""
    origin = typing.get_origin(tp)
    if origin is typing.Union or origin is types.UnionType:
        options = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is None:
            return None
        for option in options:
            if (isinstance(value, dict) and dataclasses.is_dataclass(option)) or (
                    isinstance(value, list) and typing.get_origin(option) is tuple):
                return _convert(option, value)
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return _build(tp, value, default if isinstance(default, tp) else None)
    if origin is tuple and isinstance(value, (list, tuple)):
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v) for v in value)
        if len(args) == len(value):
            return tuple(_convert(a, v) for a, v in zip(args, value))
        return tuple(value)
    return value


_RUN_DEFAULTS = RunConfig()  # after check_fields, which its __post_init__ calls
