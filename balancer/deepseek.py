"""DeepSeek's EPLB algorithm (policy "deepseek"), re-implemented from its
published description, vectorised across layers with numpy.

Hierarchical when num_groups % num_nodes == 0:
  Step 1: pack expert groups to nodes (greedy, heaviest group to the lightest node
          that still has room, num_groups / num_nodes groups per node);
  Step 2: replicate experts within each node (each redundant slot goes to the expert
          with the highest load per replica);
  Step 3: pack the node's replicas to its GPUs the same greedy way.
Otherwise global: one group on one node. Arithmetic is float32 like the reference,
and ties are ordered by torch.sort like the reference's, so ties break the same way and the README example is reproduced exactly.
"""

from __future__ import annotations

import numpy as np

from balancer.packing import greedy_pack, replicate


def pack_groups(group_weight: np.ndarray, num_packs: int) -> tuple[np.ndarray, np.ndarray]:
    """group_weight [L, G] -> (pack_of_group [L, G], rank_in_pack [L, G]) int64.
    With one group per pack, group g goes to pack g."""
    num_rows, num_groups = group_weight.shape
    if num_groups == num_packs:
        ids = np.broadcast_to(np.arange(num_groups), (num_rows, num_groups)).copy()
        return ids, np.zeros_like(ids)
    return greedy_pack(group_weight, None, num_packs, torch_order=True)


def domain_experts(pack_of_group: np.ndarray, rank_in_pack: np.ndarray, group_size: int) -> np.ndarray:
    """Experts hosted by each node, ordered by the group's rank in its pack then by id.

    pack_of_group, rank_in_pack: [L, G]. Returns: [L, N, E / N] int64 global expert ids.
    """
    num_layers, num_groups = pack_of_group.shape
    num_nodes = int(pack_of_group.max()) + 1
    groups_per_node = num_groups // num_nodes
    position = pack_of_group * groups_per_node + rank_in_pack  # [L, G]: where group g goes
    group_at = np.empty_like(position)
    np.put_along_axis(group_at, position, np.broadcast_to(np.arange(num_groups), position.shape), 1)
    experts = group_at[:, :, None] * group_size + np.arange(group_size)  # [L, G, group_size]
    return experts.reshape(num_layers, num_nodes, -1)


def place_domain_deepseek(weight: np.ndarray, num_slots: int, num_bins: int) -> np.ndarray:
    """Steps 2 and 3 for X independent domains.

    weight: [X, e] float32; Returns: slots [X, num_slots] int64 local expert index per
    slot, GPU b holding slots b*k .. b*k+k-1, k = num_slots / num_bins.
    """
    num_rows, num_experts = weight.shape
    counts, extra = replicate(weight, num_slots)
    item_expert = np.concatenate([np.broadcast_to(np.arange(num_experts), (num_rows, num_experts)), extra], 1)
    per_replica = weight / counts.astype(np.float32)
    item_weight = np.take_along_axis(per_replica, item_expert, 1)
    per_bin = num_slots // num_bins
    if per_bin == 1:
        return item_expert
    bin_of, rank_of = greedy_pack(item_weight, None, num_bins, torch_order=True)
    slots = np.empty_like(item_expert)
    np.put_along_axis(slots, bin_of * per_bin + rank_of, item_expert, 1)
    return slots


def rebalance_deepseek(weight: np.ndarray, num_replicas: int, num_groups: int, num_nodes: int,
                       num_gpus: int) -> np.ndarray:
    """weight: [L, E] float; Returns: phy2log [L, num_replicas] int64.
    Arguments are validated by the caller."""
    weight = weight.astype(np.float32)
    num_layers, num_experts = weight.shape
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1
    group_size = num_experts // num_groups
    # Step 1: groups to nodes.
    group_weight = weight.reshape(num_layers, num_groups, group_size).sum(-1)
    pack_of, rank_in = pack_groups(group_weight, num_nodes)
    experts = domain_experts(pack_of, rank_in, group_size)  # [L, N, E/N]
    # Steps 2-3: replicate within each node, pack replicas to the node's GPUs.
    dom_weight = np.take_along_axis(weight, experts.reshape(num_layers, -1), 1)
    dom_weight = dom_weight.reshape(num_layers * num_nodes, -1)
    slots = place_domain_deepseek(dom_weight, num_replicas // num_nodes, num_gpus // num_nodes)
    phy = np.take_along_axis(experts.reshape(num_layers * num_nodes, -1), slots, 1)
    return phy.reshape(num_layers, num_replicas)
