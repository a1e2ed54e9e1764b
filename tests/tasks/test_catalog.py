"""Registry listing, filtering and lookup."""

import pytest

from posttrain.tasks import Registry, registry
from posttrain.tasks.procedural import INT, ProceduralDomain


def test_at_least_150_domains_over_all_families():
    assert len(registry) >= 150
    assert {
        "arithmetic",
        "strings",
        "lists",
        "logic",
        "structure",
        "bases",
        "sequences",
        "equations",
    } <= set(registry.families())


def test_every_family_has_a_level_one_domain():
    for family in registry.families():
        assert registry.names(family=family, level=1), family


def test_filters_combine():
    names = registry.names(family="arithmetic", level=1)
    assert "arithmetic/add_d1" in names and "arithmetic/add_d2" not in names
    assert all(registry.get(n).family == "arithmetic" and registry.get(n).level == 1 for n in names)
    assert registry.names(pattern="strings/rev*") == [f"strings/reverse_l{i}" for i in range(1, 6)]
    assert registry.names(family=["logic", "bases"], level=[1, 2], pattern="*parity*") == [
        "logic/parity_l1",
        "logic/parity_l2",
    ]
    assert registry.names() == sorted(registry.names())


def test_names_match_family_and_level():
    for d in registry:
        assert d.name.startswith(d.family + "/")
        assert d.level >= 1


def test_unknown_name_suggests_close_matches():
    with pytest.raises(KeyError, match="arithmetic/add_d1"):
        registry.get("arithmetic/add_d01")


def test_register_rejects_duplicates_and_non_domains():
    reg = Registry()
    d = ProceduralDomain("toy/one_l1", "toy", 1, lambda rng, level: ("q", "1", {}), INT)
    reg.register(d)
    with pytest.raises(ValueError, match="toy/one_l1"):
        reg.register(d)
    reg.register(d, replace=True)
    with pytest.raises(TypeError):
        reg.register("toy/one_l1")
    assert reg.names() == ["toy/one_l1"]
    reg.unregister("toy/one_l1")
    assert len(reg) == 0


def test_track_strips_level_suffix():
    assert registry.get("lists/count_gt_l3").track == "lists/count_gt"
    assert registry.get("arithmetic/add_d2").track == "arithmetic/add"
