"""Groups for `pytest -n N --dist loadgroup` (make test): every test module is one unit of work
(its module fixtures are set up on one worker only), and the modules that share an expensive
session fixture (SHARED_SESSION_FIXTURES) form one unit, so that fixture is computed once per run
rather than once per worker. Explicit `xdist_group` marks win."""

from __future__ import annotations

import pytest

# Session fixtures worth computing once per run: a loaded SmolLM2 engine and its outputs, HF
# transformers' model, the redis / mooncake servers, the shared `pdkv serve` of tests/serve.
SHARED_SESSION_FIXTURES = ("smollm2_reference", "hf_model", "redis_service", "mooncake_service",
                           "server")


def assign_groups(items: list[pytest.Item]) -> None:
    """Append each item's group to its node id (see set_group)."""
    uses: dict[str, set[str]] = {}
    for item in items:
        uses.setdefault(module_id(item), set()).update(session_fixtures(item))
    groups = module_groups(uses)
    for item in items:
        marked = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                         for m in item.iter_markers("xdist_group")})
        set_group(item, "_".join(marked) or groups[module_id(item)])


def module_groups(uses: dict[str, set[str]]) -> dict[str, str]:
    """Group name per module, given the session fixtures each module's tests use: modules linked
    by a SHARED_SESSION_FIXTURES fixture (directly or through a chain of modules) get one group,
    "session-<its first such fixture>"; any other module is a group of its own, named by its
    path."""
    parent = {m: m for m in uses}

    def root(m: str) -> str:
        while parent[m] != m:
            m = parent[m]
        return m

    first_user: dict[str, str] = {}
    for m, names in uses.items():
        for f in SHARED_SESSION_FIXTURES:
            if f in names:
                parent[root(m)] = root(first_user.setdefault(f, m))
    name_of_root: dict[str, str] = {}
    for f in SHARED_SESSION_FIXTURES:
        if f in first_user:
            name_of_root.setdefault(root(first_user[f]), f"session-{f}")
    return {m: name_of_root.get(root(m), m) for m in uses}


def set_group(item: pytest.Item, group: str) -> None:
    """Append "@group" to the item's node id: the scope xdist's loadgroup scheduler reads. xdist
    3.8 writes it to `_nodeid` itself, which pytest 9.2's structured node ids ignore (the marks
    are then silently dropped: pytest-xdist issue 1386), so it is written here for both."""
    suffixed = f"{item.nodeid}@{group}"
    if hasattr(item, "_id"):
        from _pytest.nodeid import NodeId

        item._id = NodeId.parse(suffixed)
    else:
        item._nodeid = suffixed


def session_fixtures(item: pytest.Item) -> set[str]:
    """Names of the session-scoped fixtures the item uses (a module's own fixture that only
    shares a name, e.g. a module-scoped `server`, does not count)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return set()
    return {
        name for name, defs in info.name2fixturedefs.items() if defs and defs[-1].scope == "session"
    }


def module_id(item: pytest.Item) -> str:
    """The item's file as in its node id (relative to the rootdir)."""
    return item.nodeid.split("::", 1)[0]
