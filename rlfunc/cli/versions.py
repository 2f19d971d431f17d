"""``rlfunc versions list|show|diff|rollback|pin``: the run's version store (rlfunc.run.versions) on the terminal.

    rlfunc versions list RUN_DIR [--json]          one line per version; * marks branch heads
    rlfunc versions show RUN_DIR V                 the manifest as JSON (tensors summarised)
    rlfunc versions diff RUN_DIR V1 V2 [--json]    per-layer ||V2 - V1|| / ||V1|| and hyperparameter changes
    rlfunc versions rollback RUN_DIR V [--branch NAME]
                                                   new branch at V; `rlfunc resume RUN_DIR` continues from V
    rlfunc versions pin RUN_DIR V                  retention never deletes V

Retention (train flags): per branch the newest --version-keep-last versions, every version whose
iteration is a multiple of --version-keep-every, pinned versions and branch points are kept.

Errors (no run dir, no versions, unknown id, corrupt manifest or blob) raise rlfunc's errors, which the
``rlfunc`` command prints as one line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import math

from rlfunc.errors import ConfigError
from rlfunc.run import versions

USAGE = __doc__


def main(argv: list[str]) -> int:
    handlers = {"list": _list, "show": _show, "diff": _diff, "rollback": _rollback, "pin": _pin}
    if argv and argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if not argv or argv[0] not in handlers:
        got = repr(argv[0]) if argv else "nothing"
        raise ConfigError(f"versions command: expected one of {', '.join(handlers)}, got {got} (rlfunc versions --help)")
    command, rest = argv[0], argv[1:]
    return handlers[command](rest)


def _parser(name: str, description: str) -> argparse.ArgumentParser:
    from rlfunc.cli.common import Parser

    p = Parser(prog=f"rlfunc versions {name}", description=description)
    p.add_argument("run_dir")
    return p


def _list(argv: list[str]) -> int:
    p = _parser("list", "List the run's versions, oldest first; * marks branch heads, > the current branch. 'max change': "
                        "the largest per-layer relative change from the version before (a layer that was all zeros, "
                        "whose relative change is inf, is left out of it; `versions diff` shows it).")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    a = p.parse_args(argv)
    manifests = versions.list_versions(a.run_dir, skip_bad=True)  # a damaged manifest: a warning line, the rest listed
    heads = versions.branch_heads(a.run_dir)
    current = versions.current_branch(a.run_dir)
    if a.json:
        for m in manifests:
            print(json.dumps({k: m[k] for k in ("id", "parent", "branch", "iteration", "step", "created_utc")}
                             | {"episode_return": m["metrics"].get("episode_return"), "head_of": _heads_of(m["id"], heads)}))
        return 0
    print(f"{'':2}{'id':<9} {'branch':<16} {'parent':<9} {'iter':>6} {'step':>10} {'return':>9} {'max change':>10}  created")
    for m in manifests:
        mark = ("*" if _heads_of(m["id"], heads) else " ") + (">" if m["id"] == heads.get(current) else " ")
        change = max((c for c in m["layer_change"].values() if math.isfinite(c)), default=None)
        print(f"{mark}{m['id']:<9} {m['branch']:<16} {m['parent'] or '-':<9} {m['iteration']:>6} {m['step']:>10} "
              f"{_num(m['metrics'].get('episode_return')):>9} {_num(change):>10}  {m['created_utc']}")
    for name, vid in heads.items():
        if vid is not None and not any(m["branch"] == name for m in manifests):
            print(f"  branch {name} starts at {vid} (no version of its own yet)" + (" [current]" if name == current else ""))
    return 0


def _show(argv: list[str]) -> int:
    p = _parser("show", "Print one version's manifest as JSON (tensor table summarised).")
    p.add_argument("version")
    a = p.parse_args(argv)
    m = versions.read_manifest(a.run_dir, a.version)
    out = {k: v for k, v in m.items() if k not in ("tensors", "format", "format_version")}
    tensors, blocks = {}, {}
    for k, spec in m["tensors"].items():
        name, sep, index = k.rpartition(versions.BLOCK_SEP)
        if sep and index.isdigit():  # a replay buffer's rows, stored in blocks: one line of them
            blocks.setdefault(name, []).append(spec)
        else:
            tensors[k] = f"{spec['dtype']}{spec['shape']} {spec['blob'][:12]}"
    for name, specs in blocks.items():
        rows = sum(spec["shape"][0] for spec in specs)
        tensors[name] = f"{specs[0]['dtype']}{[rows, *specs[0]['shape'][1:]]} in {len(specs)} blocks of <= {versions.BLOCK_ROWS} rows"
    out["tensors"] = dict(sorted(tensors.items()))
    print(json.dumps(_strict(out), indent=1))
    return 0


def _diff(argv: list[str]) -> int:
    p = _parser("diff", "Per-layer relative parameter change ||V2 - V1|| / ||V1|| and hyperparameter changes, V1 -> V2 "
                        "(inf for a layer that was all zeros in V1; \"inf\" with --json).")
    p.add_argument("a", metavar="V1")
    p.add_argument("b", metavar="V2")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    a = p.parse_args(argv)
    d = versions.diff_versions(a.run_dir, a.a, a.b)
    if a.json:
        print(json.dumps(_strict(d)))
        return 0
    print(f"{d['from']} -> {d['to']} ({d['steps']:+d} env steps)")
    width = max((len(k) for k in d["layers"]), default=5)
    print(f"{'layer':<{width}}  relative change")
    for name, change in d["layers"].items():
        print(f"{name:<{width}}  {_num(change, 6)}")
    if d["hyperparameters"]:
        print("hyperparameters:")
        for name, (old, new) in d["hyperparameters"].items():
            print(f"  {name}: {old!r} -> {new!r}")
    else:
        print("hyperparameters: unchanged")
    return 0


def _rollback(argv: list[str]) -> int:
    p = _parser("rollback", "Start a new branch at a version; `rlfunc resume RUN_DIR` then continues from it. Deletes nothing.")
    p.add_argument("version")
    p.add_argument("--branch", default=None, help="name of the new branch (default: from-VERSION)")
    a = p.parse_args(argv)
    branch = versions.rollback(a.run_dir, a.version, branch=a.branch)
    print(f"branch {branch} starts at {a.version}; continue training with `rlfunc resume {a.run_dir}`")
    return 0


def _pin(argv: list[str]) -> int:
    p = _parser("pin", "Keep a version whatever the retention policy says.")
    p.add_argument("version")
    a = p.parse_args(argv)
    versions.pin(a.run_dir, a.version)
    print(f"{a.version} pinned")
    return 0


def _strict(x):
    """``x`` with its non-finite floats as the strings "inf", "-inf", "nan": strict JSON (Python's json
    writes Infinity, which jq and most parsers refuse)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def _heads_of(vid: str, heads: dict) -> list[str]:
    return [name for name, head in heads.items() if head == vid]


def _num(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, list):  # several seeds
        return "[" + ",".join(_num(v, digits) for v in x) + "]"
    return f"{x:.{digits}g}"
