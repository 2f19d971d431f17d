"""The algorithm registry: name -> :class:`AlgorithmEntry`, what ``rlfunc train|eval|resume`` and
snapshot loading dispatch through.

Each algorithm registers itself in the module under rlfunc/algos/ that holds its config
(``register("bc", AlgorithmEntry(...))`` in :mod:`rlfunc.algos.bc`); the registry imports every
module of rlfunc/algos/ when first read. The entry's callables are "module:attribute" strings,
imported only when used (:func:`resolve`): reading the registry (the usage text of ``rlfunc --help``,
an unknown name's error) imports no run or CLI code and makes no env.

The name is also the ``"algo"`` a snapshot's meta.json records. Adding an algorithm = its config and
``make_NAME`` under algos/ (its loss under losses/), its Run under run/, its ``rlfunc train NAME``
command and snapshot evaluation (docs/ARCHITECTURE.md, "Where a new piece goes") + one ``register``
call; no other file changes. A module of algos/ that fails to import is named in a warning and the
others still register. An algorithm of another package registers from a
module that an entry point of the group ``"rlfunc.algorithms"`` names (in its pyproject.toml:
``[project.entry-points."rlfunc.algorithms"] my_algo = "my_package.my_algo"``); the registry imports
those modules after its own, so ``rlfunc train|eval|resume`` reach it with no edit of rlfunc.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import pkgutil
from typing import Any

from rlfunc.errors import ConfigError

# The order in which the usage text and messages list the algorithms, by the module of their config;
# those of other modules follow in registration order.
ORDER = (
    "rlfunc.algos.ppo",
    "rlfunc.algos.ppo_encoder",
    "rlfunc.algos.bc",
    "rlfunc.algos.dppo",
    "rlfunc.algos.td3_diffusion",
    "rlfunc.algos.sac_diffusion",
    "rlfunc.algos.sac",
    "rlfunc.algos.td3",
    "rlfunc.algos.grpo",
    "rlfunc.algos.mappo",
)

# The entry a run is given whose snapshot names no registered algorithm (or that has no snapshot: a
# ppo run can continue from a version); its loaders refuse a snapshot that is not theirs with one line.
FALLBACK = "ppo"

PLUGIN_GROUP = "rlfunc.algorithms"  # entry points naming other packages' modules that call register()


@dataclasses.dataclass(frozen=True)
class AlgorithmEntry:
    """How rlfunc runs, evaluates and loads one algorithm. Every callable is a "module:attribute"
    string, imported on first use (:func:`resolve`).

    Signatures (``result``: a run's result with ``run_dir``, ``interrupted`` and ``evaluation``):
        config: its config dataclass (hyperparameters; ``rlfunc train NAME --help`` shows them). A
            snapshot's meta "config" is read back into it (:func:`config_from_meta`).
        run: ``(config, device, *, dist=None, resumed=False) -> rlfunc.run.Run``, one run of it
            (usually the :class:`rlfunc.run.Run` subclass itself); :func:`rlfunc.run.train` and
            :func:`rlfunc.resume` drive it.
        command: ``rlfunc train NAME ARGS...``: ``(name, argv) -> exit code`` (parses the flags,
            trains, reports).
        evaluate: ``(run_dir, episodes=None, *, seed=None, device="auto") -> dict``, the JSON line
            of ``rlfunc eval`` (``run_dir``: a run dir or a snapshot dir).
        report: ``(result) -> exit code``, how ``rlfunc resume`` prints the run it continued.
        accepts: with ``variant_of``, ``(env_id) -> bool``: this entry trains ``env_id`` when
            ``rlfunc train VARIANT_OF --env ENV_ID`` is asked for.
    """

    config: str  # "module:Class" of its config dataclass
    run: str  # "module:Class" of its rlfunc.run.Run (or a function building one)
    command: str  # "module:function", `rlfunc train NAME ARGS...`
    evaluate: str  # "module:function", evaluate a run's latest snapshot
    needs: str  # the env interface it needs, e.g. "box-actions", "dict-observation", "multi-agent": a label for readers,
    # not enforced: the Run checks its env when it builds it and refuses another in one EnvError line (ppo's run.ppo.env_spec)
    usage: str  # its lines of `rlfunc --help` (newline-joined; "": listed in another entry's lines)
    report: str = "rlfunc.cli.common:report_run"  # "module:function", prints a resumed run's end
    variant_of: str | None = None  # reached through `rlfunc train VARIANT_OF` (not a name of its own there)
    accepts: str | None = None  # "module:function", (env_id) -> bool, with variant_of
    family: str = ""  # algorithms whose snapshots one loader reads ("diffusion": a bc snapshot starts dppo)
    budget: str = "total_steps"  # the config field `rlfunc resume --total-steps N` sets
    unit: str = "env steps"  # what ``budget`` counts
    deploy: tuple[tuple[str, ...], ...] = ()  # learner keys of the weights a loaded snapshot acts with


_ENTRIES: dict[str, AlgorithmEntry] = {}
_loaded = False


def register(name: str, entry: AlgorithmEntry) -> None:
    """Make ``entry`` the algorithm ``name`` (also the ``"algo"`` of its snapshots).

    Raises:
        ConfigError: ``name`` is registered already with another entry, or ``entry`` is not an
            AlgorithmEntry, or its ``variant_of`` comes without ``accepts`` (or the reverse).
    """
    if not isinstance(entry, AlgorithmEntry):
        raise ConfigError(f"register({name!r}): entry={entry!r}: expected an AlgorithmEntry")
    if (entry.variant_of is None) != (entry.accepts is None):
        raise ConfigError(f"register({name!r}): variant_of={entry.variant_of!r}, accepts={entry.accepts!r}: "
                          "expected both or neither")
    if _ENTRIES.get(name, entry) != entry:
        raise ConfigError(f"register({name!r}): the name is registered already with another entry")
    _ENTRIES[name] = entry


def _load() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        package = importlib.import_module(__package__)
        found = sorted(f"{__package__}.{m.name}" for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
        for module in (*ORDER, *found):
            try:
                importlib.import_module(module)
            except Exception as e:  # noqa: BLE001  (the bug: one module's typo was a traceback in every command)
                if module in ORDER:  # a built-in algorithm's module: the install is broken
                    raise
                import warnings

                warnings.warn(f"{module} failed to import, its algorithms are not registered: {type(e).__name__}: {e}",
                              stacklevel=3)
        for plugin in importlib.metadata.entry_points(group=PLUGIN_GROUP):
            try:
                plugin.load()
            except Exception as e:  # noqa: BLE001  a broken plugin is named, in one line
                _loaded = False  # the next call names it again (it continued without it, silently)
                raise ConfigError(f"algorithm plugin {plugin.name!r} ({plugin.value}, entry point group {PLUGIN_GROUP!r}) "
                                  f"failed to load: {type(e).__name__}: {e}") from e


def _ordered() -> list[tuple[str, AlgorithmEntry]]:
    """The entries in :data:`ORDER` (by their config's module), then the others in registration
    order; the order of imports decides none of it."""
    _load()

    def rank(item: tuple[str, AlgorithmEntry]) -> int:
        module = item[1].config.partition(":")[0]
        return ORDER.index(module) if module in ORDER else len(ORDER)

    return sorted(_ENTRIES.items(), key=rank)  # stable: a module's entries keep their order


def names(*, family: str | None = None, commands: bool = True) -> tuple[str, ...]:
    """The registered names, in :func:`_ordered`'s order: those of ``rlfunc train NAME``
    (``commands``; False: every name, variants such as "ppo-encoder" included), only ``family``'s
    when given."""
    return tuple(n for n, e in _ordered()
                 if (not commands or e.variant_of is None) and (family is None or e.family == family))


def lookup(name: str) -> AlgorithmEntry:
    """The entry registered as ``name``.

    Raises:
        ConfigError: no algorithm is registered as ``name``; the message names it and the known names.
    """
    _load()
    if name not in _ENTRIES:
        raise ConfigError(f"algorithm={name!r}: expected one of {', '.join(names(commands=False))}")
    return _ENTRIES[name]


def for_snapshot(algo: Any) -> AlgorithmEntry:
    """The entry of a snapshot whose meta.json records ``algo``; :data:`FALLBACK`'s for an algo no
    entry is registered as (or None: no snapshot), whose loaders then refuse it with one line."""
    _load()
    return _ENTRIES.get(algo, _ENTRIES[FALLBACK]) if isinstance(algo, str) else _ENTRIES[FALLBACK]


def variant(name: str, env_id: str) -> str:
    """The name that trains ``env_id`` when ``rlfunc train NAME --env ENV_ID`` is asked for: the
    first variant of ``name`` whose ``accepts(env_id)`` holds (ppo on a Dict observation:
    "ppo-encoder"), else ``name``."""
    for n, e in _ordered():
        if e.variant_of == name and resolve(e.accepts)(env_id):
            return n
    return name


def resolve(ref: str) -> Any:
    """Import "module:attribute" and return the attribute.

    Raises:
        ConfigError: ``ref`` is not of that form, or its module has no such attribute.
        ImportError: the module cannot be imported.
    """
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"ref={ref!r}: expected 'module:attribute'")
    imported = importlib.import_module(module)  # an error inside the import is that error, not a missing attribute
    try:
        return getattr(imported, attr)
    except AttributeError:
        raise ConfigError(f"ref={ref!r}: module {module!r} has no attribute {attr!r}") from None


def name_of(config: Any) -> str:
    """The name of the first entry (in :func:`_ordered`'s order) whose config class ``config`` is an
    instance of (exactly; grpo and gspo share one: "grpo").

    Raises:
        ConfigError: ``config`` is no registered algorithm's config; the message names its type.
    """
    for n, e in _ordered():
        if type(config) is resolve(e.config):
            return n
    raise ConfigError(f"config={type(config).__name__}: expected the config of a registered algorithm "
                      f"({', '.join(names(commands=False))})")


def config_from_meta(meta: dict, path: Any = "snapshot", *, of: type | str | None = None) -> Any:
    """The config of a snapshot's meta.json: its "config" read into the config class of the entry
    registered as its ``"algo"`` (:func:`rlfunc.config.from_dict`). ``of``: a config class, or a
    family's name ("diffusion"), the meta must be of (a loader of one algorithm's snapshots).

    Raises:
        CheckpointError: the meta names no registered algorithm (or none of ``of``), or holds no
            valid config of it (the message names ``path``).
    """
    from rlfunc.config import from_dict
    from rlfunc.errors import CheckpointError

    _load()
    allowed = [n for n, e in _ordered()
               if of is None or (e.family == of if isinstance(of, str) else resolve(e.config) is of)]
    algo = meta.get("algo") if isinstance(meta, dict) else None
    if algo not in allowed:
        expected = " or ".join(repr(n) for n in allowed) if len(allowed) < 3 else f"one of {', '.join(allowed)}"
        raise CheckpointError(f"{path}: snapshot algo={algo!r}: expected {expected}")
    return from_dict(resolve(_ENTRIES[algo].config), meta.get("config"), path, algo=algo)


def usage() -> str:
    """The ``rlfunc train`` lines of ``rlfunc --help``: every entry's ``usage``, in :func:`_ordered`'s order."""
    return "\n".join(e.usage for _, e in _ordered() if e.usage)
