"""launch.sweep.grid: grid items, the cross product, point keys, invalid points."""

from __future__ import annotations

import pytest

from launch.config_schema import ConfigError
from launch.sweep.grid import (
    expand_grid,
    format_settings,
    parse_grid,
    parse_grid_item,
    point_config,
    point_key,
)

BASE = {"model": "ckpt", "parallel": {"enable_expert_parallel": True}}


def test_parse_item_yaml_list_and_scalar():
    axis = parse_grid_item("parallel.data_parallel_size=[1, 2]")
    assert axis.key == "parallel.data_parallel_size" and axis.values == (1, 2)
    assert parse_grid_item("moe.capacity_factor=[0, 1.25]").values == (0, 1.25)
    assert parse_grid_item("engine.max_num_seqs=8").values == (8,)
    assert parse_grid_item("balancer.enable_eplb=[false,true]").values == (False, True)
    # values of the schema's types: null where it allows None, 1e-3 for a float, anything under model_overrides
    assert parse_grid_item("engine.max_model_len=[null,128]").values == (None, 128)
    assert parse_grid_item("moe.capacity_factor=[0,1e-3]").values == (0, "1e-3")
    assert parse_grid_item("model_overrides.num_experts=[8,x]").values == (8, "x")


@pytest.mark.parametrize("item, needle", [
    ("parallel.data_paralel_size=[1,2]", "'parallel.data_paralel_size' (did you mean 'parallel.data_parallel_size'?)"),
    ("nosuch.key=[1]", "unknown config key 'nosuch.key'"),
    ("parallel=[1]", "--grid: 'parallel' is a section, not a setting: give one of its keys such as "
                     "parallel.tensor_parallel_size, parallel.data_parallel_size or parallel.enable_expert_parallel"),
    ("engine.max_num_seqs=2,4", "'2,4' is one value; a list needs brackets: engine.max_num_seqs=[2,4]"),
    ("engine.max_num_seqs=[abc,4]", "--grid engine.max_num_seqs: expected int, found str 'abc'"),
    ("balancer.enable_eplb=[0,1]", "--grid balancer.enable_eplb: expected bool, found int 0"),
    ("parallel.tensor_parallel_size,parallel.enable_expert_parallel=[[1,true],[2,3]]",
     "--grid parallel.enable_expert_parallel: expected bool, found int 3"),
    ("engine.max_num_seqs", "expects key=[v1,v2,...]"),
    ("engine.max_num_seqs=[1,", "engine.max_num_seqs"),
    ("engine.max_num_seqs=[]", "engine.max_num_seqs: the value list is empty"),
    ("engine.max_num_seqs=[1,1]", "engine.max_num_seqs: repeated value"),
    ("engine.max_num_seqs=[[1],2]", "engine.max_num_seqs: values must be scalars"),
])
def test_bad_items_name_the_key(item, needle):
    with pytest.raises(ConfigError) as e:
        parse_grid_item(item)
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_duplicate_key_is_an_error():
    with pytest.raises(ConfigError, match="'engine.max_num_seqs' is given twice"):
        parse_grid(["engine.max_num_seqs=[1]", "engine.max_num_seqs=[2]"])


def test_expand_is_the_cross_product_last_axis_fastest():
    axes = parse_grid(["parallel.data_parallel_size=[1,2]", "balancer.num_redundant_experts=[0,2,4]"])
    points = expand_grid(axes)
    assert len(points) == 6
    assert points[0] == {"parallel.data_parallel_size": 1, "balancer.num_redundant_experts": 0}
    assert points[1] == {"parallel.data_parallel_size": 1, "balancer.num_redundant_experts": 2}
    assert points[-1] == {"parallel.data_parallel_size": 2, "balancer.num_redundant_experts": 4}
    assert expand_grid([]) == [{}]


def test_point_key_ignores_order_and_tells_values_apart():
    a = point_key({"x.a": 1, "y.b": True})
    assert a == point_key({"y.b": True, "x.a": 1})
    assert a != point_key({"x.a": 1, "y.b": 1})  # true and 1 are different settings
    assert a != point_key({"x.a": 2, "y.b": True})


def test_point_config_applies_settings_and_rejects_invalid_combinations():
    cfg = point_config(BASE, {"parallel.data_parallel_size": 2, "balancer.enable_eplb": True,
                              "balancer.num_redundant_experts": 2})
    assert cfg.parallel.expert_parallel_size == 2 and cfg.balancer.num_redundant_experts == 2
    assert BASE == {"model": "ckpt", "parallel": {"enable_expert_parallel": True}}  # base untouched
    with pytest.raises(ValueError, match="num_redundant_experts=2 needs"):
        point_config(BASE, {"balancer.num_redundant_experts": 2})


def test_format_settings_is_short():
    assert format_settings({"parallel.data_parallel_size": 2, "balancer.enable_eplb": False}) == "dp=2 eplb=off"
    assert format_settings({}) == "base"


def test_zipped_keys_move_together():
    axes = parse_grid(["parallel.tensor_parallel_size,parallel.data_parallel_size=[[1,1],[1,2],[2,1]]",
                       "engine.max_num_seqs=[8,32]"])
    points = expand_grid(axes)
    assert len(points) == 6
    assert points[0] == {"parallel.tensor_parallel_size": 1, "parallel.data_parallel_size": 1, "engine.max_num_seqs": 8}
    assert points[5] == {"parallel.tensor_parallel_size": 2, "parallel.data_parallel_size": 1, "engine.max_num_seqs": 32}
    with pytest.raises(ConfigError, match="each value must be a list of 2"):
        parse_grid_item("parallel.tensor_parallel_size,parallel.data_parallel_size=[[1,1],[2]]")
    with pytest.raises(ConfigError, match="unknown config key 'parallel.dp'"):
        parse_grid_item("parallel.tensor_parallel_size,parallel.dp=[[1,1]]")
    with pytest.raises(ConfigError, match="'engine.max_num_seqs' is given twice"):
        parse_grid(["engine.max_num_seqs,moe.capacity_factor=[[1,0]]", "engine.max_num_seqs=[2]"])
