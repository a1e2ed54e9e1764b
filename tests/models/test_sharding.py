import pytest
from jax.sharding import PartitionSpec as P

from posttrain import models


def test_make_mesh_fills_minus_one_and_rejects_bad_products():
  mesh = models.make_mesh((1, -1, 2, 1))
  assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 2, "sequence": 1}
  with pytest.raises(ValueError, match="needs 6 devices"):
    models.make_mesh((1, 3, 2, 1))
  with pytest.raises(ValueError, match="more than one -1"):
    models.make_mesh((-1, -1, 1, 1))
  with pytest.raises(ValueError, match="does not divide"):
    models.make_mesh((3, -1, 1, 1))


def test_logical_rules_use_each_mesh_axis_once():
  mesh = models.make_mesh((2, 2, 2, 1))
  assert models.logical_to_spec(("batch", "length", "embed"), mesh=mesh,
                                shape=(8, 4, 16)) == P(("data", "fsdp"), None, None)
  assert models.logical_to_spec(("embed", "mlp"), mesh=mesh, shape=(16, 32)) == P("fsdp",
                                                                                  "tensor")


def test_rules_from_config_rejects_unknown_mesh_axes():
  with pytest.raises(ValueError, match="unknown mesh axes"):
    models.rules_from_config({"embed": ["model"]})
  assert dict(models.rules_from_config({"embed": "fsdp"}))["embed"] == ("fsdp",)
  with pytest.raises(ValueError, match="not a .name, mesh axes. pair"):
    models.rules_from_config([("experts",)])


def test_rules_from_config_replaces_the_defaults_it_names():
  """A run's sharding_rules name what differs from the defaults (expert parallelism: the
  experts over fsdp); every other name keeps its default, so the rest of the model stays
  sharded as before. Empty or None: the defaults."""
  assert models.rules_from_config(()) == models.rules_from_config(None) == models.DEFAULT_RULES
  rules = models.rules_from_config((("experts", ("fsdp",)), ("mlp", ()), ("extra", "data")))
  table = dict(rules)
  assert table["experts"] == ("fsdp",) and table["mlp"] == () and table["extra"] == ("data",)
  assert {k: v for k, v in table.items() if k not in ("experts", "mlp", "extra")} == {
      k: v for k, v in models.DEFAULT_RULES if k not in ("experts", "mlp")}
  assert [name for name, _ in rules][:len(models.DEFAULT_RULES)] == [
      name for name, _ in models.DEFAULT_RULES]
