"""Two Ray nodes on one machine (a second raylet joins the head with its own resources):
ranks are node-major, the balancer sees 2 nodes and keeps each expert group on one node."""

from __future__ import annotations

import pytest

from launch import LLM, SamplingParams
from tests.oracles import make_prompts


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"node_a": 1},
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=2, resources={"node_b": 1})
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, runtime_env={"env_vars": {"GLOO_SOCKET_IFNAME": "lo",
                                                                    "MASTER_ADDR": "127.0.0.1"}})
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_node_major_ranks_and_hierarchical_placement(two_nodes, hf_checkpoints):
    path = hf_checkpoints["deepseek_v3"]  # 8 experts in 4 groups
    prompts = make_prompts(11, 6, 96)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    with LLM(str(path), dtype="float32") as llm:
        single = [o.outputs[0].token_ids for o in llm.generate(requests, params)]
    with LLM(str(path), dtype="float32", data_parallel_size=4, enable_expert_parallel=True, enable_eplb=True,
             num_redundant_experts=4) as llm:
        executor = llm.engine.executor
        assert executor.num_nodes == 2
        nodes = [info.node_id for info in executor.group.ranks]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # node-major
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
        assert llm.engine.eplb.num_nodes == 2
        llm.engine.rebalance()
        phy2log = llm.engine.placement.phy2log  # [L, 12]: slots 0-5 on node 0, 6-11 on node 1
        for row in phy2log.tolist():
            node_of_group: dict[int, set[int]] = {}
            for slot, expert in enumerate(row):
                node_of_group.setdefault(expert // 2, set()).add(slot // 6)
            assert all(len(n) == 1 for n in node_of_group.values()), row
        assert [o.outputs[0].token_ids for o in llm.generate(requests, params)] == single
