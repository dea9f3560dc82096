"""The xdist groups of `make test` (tests/xdist_groups.py): pure functions, no worker started."""

from __future__ import annotations

from xdist_groups import module_groups


def test_modules_sharing_an_expensive_session_fixture_form_one_group_through_chains():
    groups = module_groups({
        "a.py": {"smollm2_reference"},
        "b.py": {"smollm2_reference", "server"},
        "c.py": {"server"},                      # linked to a.py through b.py
        "d.py": {"redis_service"},
        "e.py": {"mooncake_service", "redis_service"},
        "f.py": {"model_path", "tiny_swa"},      # cheap session fixtures: its own group
        "g.py": set(),
    })
    assert groups["a.py"] == groups["b.py"] == groups["c.py"] == "session-smollm2_reference"
    assert groups["d.py"] == groups["e.py"] == "session-redis_service"
    assert groups["f.py"] == "f.py" and groups["g.py"] == "g.py"


def test_group_is_independent_of_module_order():
    uses = {"x.py": {"server"}, "y.py": {"hf_model"}, "z.py": {"server", "smollm2_reference"}}
    forward = module_groups(uses)
    backward = module_groups(dict(reversed(list(uses.items()))))
    assert forward == backward
    assert forward["x.py"] == forward["z.py"] == "session-smollm2_reference"
    assert forward["y.py"] == "session-hf_model"
