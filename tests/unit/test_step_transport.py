"""The fast step transport: the compact batch message, the reply encoding and the TCP channel."""

from __future__ import annotations

import dataclasses
import os
import pickle
import socket
import threading
import time

import pytest
import torch

from launch.core import BatchSpec, SampledTokens, SamplingParams, ScheduledSequence
from launch.core.batch import HistoryChunk, PromptLogprobsSpan
from launch.core.wire import SAMPLER_FIELDS, WireBatch, WireError, decode_batch, encode_batch
from launch.step_channel import ChannelClosed, ChannelTimeout, RemoteError, StepClient, StepServer
from launch.worker import StepResult

VIEWS = ("is_empty", "num_seqs", "num_tokens", "input_ids", "positions", "query_lens", "context_lens", "block_tables",
         "sample_rows", "logits_indices", "sampling_params", "output_indices", "history", "released_seq_ids",
         "prompt_logprobs")


def make_batch(seed: int = 0) -> BatchSpec:
    """Prefill chunks (sampled and not), decodes, two requests sharing params, one distinct."""
    g = torch.Generator().manual_seed(seed)
    greedy, seeded = SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, seed=3, logprobs=2)
    rows, block = [], 16
    for b, (q, computed, sample) in enumerate([(5, 0, False), (1, 37, True), (3, 16, True), (1, 3, True)]):
        ctx = computed + q
        blocks = tuple(torch.randint(0, 100, (-(-ctx // block),), generator=g).tolist())
        rows.append(ScheduledSequence(
            request_id=f"req-{b}", seq_id=b, index=0, token_ids=tuple(torch.randint(0, 500, (q,), generator=g).tolist()),
            positions=tuple(range(computed, ctx)), num_computed_tokens=computed, block_ids=blocks, do_sample=sample,
            params=seeded if b == 2 else greedy, num_output_tokens=b * 2))
    return BatchSpec(dp_rank=1, block_size=block, seqs=tuple(rows))


def test_wire_batch_has_every_view_of_the_batch():
    batch = make_batch()
    wire = decode_batch(encode_batch(batch))
    assert isinstance(wire, WireBatch)
    for name in VIEWS:
        assert getattr(wire, name) == getattr(batch, name), name
    assert (wire.dp_rank, wire.block_size) == (1, 16)
    assert len(wire.input_ids_arr) == batch.num_tokens and len(wire.query_lens_arr) == 4
    # one params object per distinct SamplingParams, not one per row
    assert len(wire.params) == 2


def test_wire_keeps_apart_params_that_differ_only_in_a_sampler_field():
    """Rows share a params entry only when every field the worker's sampler reads is equal: a
    request with min_p=1.0 next to one with min_p=0 must not be sampled with the other's min_p."""
    base = SamplingParams(temperature=1.0, seed=7)
    variants = [base, dataclasses.replace(base, min_p=1.0), dataclasses.replace(base, top_k=5),
                dataclasses.replace(base, top_p=0.5), dataclasses.replace(base, logprobs=1),
                dataclasses.replace(base, seed=8), dataclasses.replace(base, temperature=0.5),
                dataclasses.replace(base, repetition_penalty=1.3), dataclasses.replace(base, presence_penalty=0.5),
                dataclasses.replace(base, frequency_penalty=-0.5), dataclasses.replace(base, min_tokens=3),
                dataclasses.replace(base, min_tokens=3, stop_token_ids=[4]),
                dataclasses.replace(base, logit_bias={4: 2.5, 1: -1.0}), dataclasses.replace(base, logit_bias={4: 2.0}),
                dataclasses.replace(base, allowed_token_ids=[3, 1]), dataclasses.replace(base, allowed_token_ids=[3]),
                dataclasses.replace(base, bad_words_token_ids=[[3, 1], [2]]),
                dataclasses.replace(base, bad_words_token_ids=[[3, 1]])]
    rows = [ScheduledSequence(request_id=f"r{b}", seq_id=b, index=0, token_ids=(1,), positions=(0,),
                              num_computed_tokens=0, block_ids=(b,), do_sample=True, params=p, num_output_tokens=0)
            for b, p in enumerate(variants)]
    wire = decode_batch(encode_batch(BatchSpec(dp_rank=0, block_size=16, seqs=tuple(rows))))
    assert wire.sampling_params == variants
    # every field the sampler reads is part of the key; the rest act on the driver only (ignore_eos
    # too: min_tokens masks the EOS ids whatever it says, as vLLM; prompt_logprobs travels in its spans)
    driver_only = {"n", "max_tokens", "stop", "ignore_eos", "include_stop_str_in_output", "prompt_logprobs",
                   "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens",
                   "output_kind", "best_of"}
    # vLLM's sampler fields this engine refuses unless None (launch.core.sampling_params.UNSUPPORTED_FIELDS)
    driver_only |= {"logits_processors"}
    driver_only |= {"bad_words"}  # the engine turns them into bad_words_token_ids, which the sampler reads
    # vLLM's constrained decoding and logits-processor arguments: None only (CONSTRAINED_DECODING_FIELDS)
    driver_only |= {"structured_outputs", "guided_decoding", "extra_args"}
    assert {f.name for f in dataclasses.fields(SamplingParams)} == set(SAMPLER_FIELDS) | driver_only


def test_wire_carries_history_releases_and_prompt_spans():
    """The optional sections: history chunks (with and without a cached prefix), released sequences
    and prompt-logprob spans come back equal; a plain batch's message only grows by their lengths."""
    batch = make_batch()
    plain = len(encode_batch(batch))
    extra = dataclasses.replace(batch, history=(HistoryChunk(0, 10, 4, (9, 8, 7)), HistoryChunk(2, 12, 19)),
                                released_seq_ids=(3, 5), prompt_logprobs=(PromptLogprobsSpan(0, 1, 5, 77, 2),))
    wire = decode_batch(encode_batch(extra))
    for name in VIEWS:
        assert getattr(wire, name) == getattr(extra, name), name
    assert len(encode_batch(extra)) == plain + 8 * (2 * 4 + 2) + 4 * (3 + 5)  # history, released: int64


def test_wire_empty_batch_and_bad_bytes():
    empty = decode_batch(encode_batch(BatchSpec(dp_rank=0, block_size=16)))
    assert empty.is_empty and empty.input_ids == [] and empty.block_tables == [] and empty.logits_indices == []
    data = encode_batch(make_batch())
    with pytest.raises(WireError, match="not a step message"):
        decode_batch(b"XXXX" + data[4:])
    with pytest.raises(WireError, match="truncated"):
        decode_batch(data[:40])
    with pytest.raises(WireError, match="shorter than its header"):
        decode_batch(b"MO")


def test_wire_message_is_smaller_than_the_pickled_batch():
    """32 decoding requests, each with its own (equal) params object: one params entry."""
    seqs = tuple(ScheduledSequence(f"req-{i}", i, 0, (7,), (40,), 40, tuple(range(i, i + 3)), True,
                                   SamplingParams(temperature=0.0), 9) for i in range(32))
    batch = BatchSpec(0, 16, seqs)
    wire = decode_batch(encode_batch(batch))
    assert len(wire.params) == 1 and wire.sampling_params == [SamplingParams(temperature=0.0)] * 32
    assert wire.block_tables == batch.block_tables and wire.input_ids_arr.itemsize == 4
    assert len(encode_batch(batch)) < len(pickle.dumps(batch)) / 2


@pytest.mark.parametrize("case", ["plain", "logprobs", "follower", "no_load", "prompt", "prompt_only"])
def test_step_result_round_trip(case):
    load = torch.arange(12, dtype=torch.int64).reshape(2, 6)  # [L, P]
    logprobs = [{5: -0.1, 7: -2.5}, None] if case in ("logprobs", "prompt") else None
    prompt = [[{3: -1.5, 4: -0.25}], [{8: -0.5}, {2: -3.0, 1: -0.1}]] if case.startswith("prompt") else None
    sampled = None if case == "follower" else SampledTokens([5, 9], logprobs, prompt)
    result = StepResult(sampled, None if case == "no_load" else load, [(3, 1), (0, 2)], 0.0125, 0.0093)
    back = StepResult.from_bytes(result.to_bytes())
    assert back.seconds == result.seconds and back.capacity == [(3, 1), (0, 2)]
    assert back.cpu_seconds == result.cpu_seconds  # the sweep's critical-path CPU time travels too
    if case == "no_load":
        assert back.slot_load is None
    else:
        assert back.slot_load.dtype == torch.int64 and back.slot_load.shape == (2, 6)
        assert torch.equal(back.slot_load, load)
    if case == "follower":
        assert back.sampled is None
    else:
        assert back.sampled.token_ids == [5, 9] and back.sampled.logprobs == logprobs
        assert back.sampled.prompt_logprobs == prompt
        if prompt is not None:  # the order of each entry (the scored token first) travels too
            assert [list(e) for e in back.sampled.prompt_logprobs[1]] == [[8], [2, 1]]


def test_step_result_rejects_mismatched_load():
    with pytest.raises(ValueError, match="slot load"):
        StepResult(None, torch.zeros(3, 4, dtype=torch.int64), [(0, 0)]).to_bytes()


class Boom(RuntimeError):
    pass


def echo_handler(payload: bytearray) -> bytes:
    text = bytes(payload)
    if text == b"fail":
        raise Boom("handler failed on purpose")
    if text == b"sleep":
        time.sleep(3.0)
    return text[::-1] * (50_000 if text == b"big" else 1)


def test_channel_round_trips_to_every_rank_and_survives_a_handler_error():
    servers = [StepServer(echo_handler) for _ in range(3)]
    client = StepClient([s.address for s in servers])
    try:
        assert client.num_ranks == 3
        for step in range(20):
            payloads = [f"step {step} rank {r}".encode() for r in range(3)]
            assert [bytes(b) for b in client.roundtrip(payloads, 10.0)] == [p[::-1] for p in payloads]
        assert [len(b) for b in client.roundtrip([b"big", b"a", b"b"], 10.0)] == [150_000, 1, 1]
        with pytest.raises(RemoteError, match="rank 1: Boom: handler failed") as info:
            client.roundtrip([b"x", b"fail", b"y"], 10.0)
        assert info.value.rank == 1 and info.value.cause.type_name == "Boom" and str(info.value.cause) == "handler failed on purpose"
    finally:
        client.close()
    time.sleep(0.2)
    assert not any(s.serving for s in servers)  # the close frame ends every server loop


def test_channel_names_a_closed_and_a_slow_rank():
    servers = [StepServer(echo_handler) for _ in range(2)]
    client = StepClient([s.address for s in servers])
    try:
        with pytest.raises(ChannelTimeout, match=r"ranks \[1\] did not answer") as info:
            client.roundtrip([b"a", b"sleep"], 1.0)  # rank 0 answers well within it
        assert info.value.ranks == [1]
    finally:
        client.close()
    servers = [StepServer(echo_handler) for _ in range(2)]
    client = StepClient([s.address for s in servers])
    try:
        servers[0].close()  # what the driver sees when a worker process dies
        with pytest.raises(ChannelClosed, match="rank 0") as info:
            client.roundtrip([b"a", b"b"], 5.0)
        assert info.value.rank == 0
    finally:
        client.close()
        for s in servers:
            s.close()


def test_server_refuses_a_connection_without_its_token():
    server = StepServer(echo_handler)
    host, port, token = server.address
    with socket.create_connection((host, port), timeout=5) as intruder:
        intruder.sendall(os.urandom(len(token)))
        intruder.settimeout(5)
        assert intruder.recv(1) == b""  # dropped
    client = StepClient([server.address])  # the driver still gets in
    try:
        assert bytes(client.roundtrip([b"ok"], 5.0)[0]) == b"ko"
    finally:
        client.close()


@pytest.mark.slow
def test_worker_serves_steps_over_the_channel(tiny_ckpt):
    """A real one-rank Worker answers the same tokens over the channel as by a direct call."""
    from launch.worker import Worker, WorkerSpec

    direct, served = Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0), \
        Worker(WorkerSpec(str(tiny_ckpt), dtype="float32", num_kv_blocks=16), 0)
    direct.setup(), served.setup()
    client = StepClient([served.open_step_channel("127.0.0.1")])
    try:
        params = SamplingParams(temperature=0.0)
        prompt = (3, 17, 29, 4, 8)
        batch = BatchSpec(0, 16, (ScheduledSequence("r", 0, 0, prompt, tuple(range(5)), 0, (2,), True, params, 0),))
        for step in range(3):
            want = direct.execute(batch, True)
            got = StepResult.from_bytes(client.roundtrip([b"\x01" + encode_batch(batch)], 30.0)[0])
            assert got.sampled.token_ids == want.sampled.token_ids
            assert torch.equal(got.slot_load, want.slot_load) and got.capacity == want.capacity
            token, pos = want.sampled.token_ids[0], 5 + step
            batch = BatchSpec(0, 16, (ScheduledSequence("r", 0, 0, (token,), (pos,), pos, (2,), True, params,
                                                        step + 1),))
        with pytest.raises(RemoteError, match="not a step message"):
            client.roundtrip([b"\x01garbage" + bytes(32)], 30.0)
    finally:
        client.close()
        served.shutdown()
        direct.shutdown()


class FakeGroup:
    """The parts of launch.cluster.WorkerGroup the executor's channel code uses."""

    call_timeout_s = 5.0

    def __init__(self, servers=None, open_error=None, dead=()):
        self.servers, self.open_error, self.dead, self.calls = servers or [], open_error, set(dead), []

    def call(self, method, *args, ranks=None):
        self.calls.append((method, ranks))
        if method == "open_step_channel":
            if self.open_error:
                raise self.open_error
            return [s.address for s in self.servers]
        return [None] * len(self.servers)

    @property
    def actors(self):
        from types import SimpleNamespace

        return [SimpleNamespace(ping=SimpleNamespace(remote=lambda r=r: r)) for r in range(len(self.servers))]

    def wait(self, refs, method, ranks, timeout_s=None):
        from launch.recovery import WorkerDiedError

        self.calls.append((method, ranks, timeout_s))
        for r in refs:
            if r in self.dead:
                raise WorkerDiedError(f"worker rank {r} on node 0 (node) died (its process exited)", rank=r)
        return [None] * len(refs)

    def _node(self, rank):
        return "0 (node)"

    def blame_dead_peer(self, err):  # the real one asks Ray (tests/ray/test_worker_faults.py)
        self.calls.append(("blame_dead_peer", err.rank, err.detail))
        return err


def fake_executor(transport, group):
    from launch.executor import RayExecutor

    ex = object.__new__(RayExecutor)
    ex.transport, ex.channel, ex.group, ex._reopen = transport, None, group, False
    ex.dp_of_rank, ex.dp_leaders = list(range(len(group.servers))), list(range(len(group.servers)))
    return ex


def test_auto_transport_falls_back_to_ray_calls_and_socket_does_not(caplog):
    ex = fake_executor("auto", FakeGroup(open_error=ConnectionRefusedError("no route")))
    ex.open_channel()
    assert ex.active_transport == "ray" and "steps go through Ray actor calls" in caplog.text
    with pytest.raises(ConnectionRefusedError):
        fake_executor("socket", FakeGroup(open_error=ConnectionRefusedError("no route"))).open_channel()
    ex = fake_executor("ray", FakeGroup())
    ex.open_channel()
    assert ex.active_transport == "ray" and ex.group.calls == []


def step_output(num_ranks):
    from launch.core import SchedulerOutput

    batch = make_batch()
    return SchedulerOutput(0, tuple(BatchSpec(r, batch.block_size, batch.seqs) for r in range(num_ranks)))


def result_handler(payload):
    batch = decode_batch(memoryview(payload)[1:])
    load = torch.full((2, 4), batch.dp_rank, dtype=torch.int64) if payload[0] else None
    return StepResult(SampledTokens(batch.logits_indices), load, [(batch.dp_rank, 0)] * 2, 0.001).to_bytes()


def test_executor_steps_over_the_channel_and_maps_faults_to_the_ray_errors():
    from launch.recovery import WorkerCallError, WorkerDiedError, WorkerTimeoutError

    release = threading.Event()

    def slow(payload):
        release.wait(30)
        return result_handler(payload)

    def crash(payload):
        raise ValueError("bad batch")

    servers = [StepServer(result_handler), StepServer(result_handler)]
    ex = fake_executor("socket", FakeGroup(servers))
    ex.open_channel()
    assert ex.active_transport == "socket"
    results = ex.execute(step_output(2), collect_load=True)
    assert [r.sampled.token_ids for r in results] == [make_batch().logits_indices] * 2
    assert [int(r.slot_load[0, 0]) for r in results] == [0, 1] and results[1].capacity == [(1, 0), (1, 0)]
    assert ex.execute(step_output(2), collect_load=False)[0].slot_load is None
    # a dead rank: the channel closes, the executor asks Ray, Ray's typed error comes out
    servers[1].close()
    ex.group.dead.add(1)
    with pytest.raises(WorkerDiedError, match="rank 1"):
        ex.execute(step_output(2), collect_load=True)
    assert ex.group.calls[-1] == ("ping", [1], ex.fault_ping_timeout_s)  # bounded
    assert ex.active_transport == "ray"  # a broken channel is never reused
    # a rank whose step raises: WorkerCallError naming it, with the worker's exception as the cause
    servers = [StepServer(result_handler), StepServer(crash)]
    ex = fake_executor("socket", FakeGroup(servers))
    ex.open_channel()
    with pytest.raises(WorkerCallError, match="rank 1 .* failed in execute: bad batch") as info:
        ex.execute(step_output(2), collect_load=True)
    assert info.value.rank == 1 and info.value.detail == "ValueError"
    assert ex.group.calls[-1] == ("blame_dead_peer", 1, "ValueError")  # a survivor's report may name a dead peer
    # the next step connects afresh (after a recovery rebuild the ranks serve new channels)
    ex.group.servers = [StepServer(result_handler), StepServer(result_handler)]
    assert len(ex.execute(step_output(2), collect_load=False)) == 2 and ex.active_transport == "socket"
    ex.close_channel()
    # a rank that does not answer within the call timeout: WorkerTimeoutError naming it
    ex = fake_executor("socket", FakeGroup([StepServer(result_handler), StepServer(slow)]))
    ex.group.call_timeout_s = 1.0  # rank 0 answers well within it, rank 1 never does
    ex.open_channel()
    with pytest.raises(WorkerTimeoutError, match=r"ranks \[1\] did not finish execute") as info:
        ex.execute(step_output(2), collect_load=True)
    release.set()
    assert info.value.rank == 1
    # a channel closed under a live actor is still a fault the engine recovers from
    ex.group.servers = [StepServer(result_handler), StepServer(result_handler)]
    ex.open_channel()
    ex.group.servers[0].close()
    with pytest.raises(WorkerCallError, match=r"^worker rank 0 on node 0 \(node\): step channel (closed|reset)") as info:
        ex.execute(step_output(2), collect_load=True)
    assert info.value.rank == 0 and info.value.detail == "ChannelClosed"
