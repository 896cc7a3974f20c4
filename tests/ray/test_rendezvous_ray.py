"""On Ray, rank 0's rendezvous store listens on loopback when every rank is on this machine."""

from __future__ import annotations

import psutil
import pytest

from launch import LLM, SamplingParams


@pytest.mark.slow
def test_ray_ranks_meet_on_loopback(ray_local, hf_checkpoints):
    path = hf_checkpoints["deepseek_v3"]
    with LLM(str(path), dtype="float32", data_parallel_size=2, enable_expert_parallel=True) as llm:
        executor = llm.engine.executor
        host_port = executor.init_method.removeprefix("tcp://")
        host, port = host_port.rsplit(":", 1)
        assert host == "127.0.0.1"
        listens = [(c.laddr.ip, c.laddr.port) for c in psutil.Process(executor.infos[0]["pid"]).net_connections("inet")
                   if c.status == psutil.CONN_LISTEN]
        assert ("127.0.0.1", int(port)) in listens, listens
        assert not [s for s in listens if s[1] == int(port) and s[0] != "127.0.0.1"]
        out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3,
                                                                           ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 3
