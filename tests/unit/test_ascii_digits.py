"""Numbers users type (ports, rank counts, token ids) are ASCII digits: '²' passes ``str.isdigit``
and then ``int`` raises, which gave a traceback where each parser means to give its one-line error."""

from __future__ import annotations

from pathlib import Path

import pytest

SUPERSCRIPT_TWO = "\u00b2"


def test_rendezvous_port(monkeypatch):
    from parallel.groups import parse_init_method

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", SUPERSCRIPT_TWO)
    with pytest.raises(ValueError, match="rendezvous port must be 1..65535"):
        parse_init_method(None)


def test_commbench_ranks():
    from parallel.bench.dispatch import parse_ranks

    with pytest.raises(ValueError, match="comma-separated rank counts"):
        parse_ranks(f"1,{SUPERSCRIPT_TWO}", 8)


def test_ray_address_port():
    from launch.cluster import _host_port

    assert _host_port(f"127.0.0.1:{SUPERSCRIPT_TWO}") is None
    assert _host_port("127.0.0.1:6379") == ("127.0.0.1", 6379)


@pytest.mark.parametrize("field, key, message", [
    ("multi_rank_overheads", f"tp:{SUPERSCRIPT_TWO}", "multi_rank_overheads key"),
    ("collectives", f"alltoall:{SUPERSCRIPT_TWO}", "must be 'OP:NRANKS'"),
])
def test_hardware_file_keys(field, key, message):
    from parallel.costmodel import Hardware

    data = dict(name="toy", flops={"bfloat16": 1e12}, memory_bandwidth=1e11, memory_bytes=80e9, gpus_per_node=8,
                intra_node_bandwidth=1e9, inter_node_bandwidth=1e8)
    data[field] = {key: 1e-3} if field == "multi_rank_overheads" else {key: [[1024, 1e-5]]}
    with pytest.raises(ValueError, match=message):
        Hardware.from_dict(data)


def test_calibrate_flags(tmp_path: Path, capsys):
    from launch.calibrate import main as calibrate_main

    table = tmp_path / "a2a.txt"
    table.write_text("# nothing here\n")
    out = str(tmp_path / "hw.yaml")
    assert calibrate_main(["--out", out, "--nprocs", f"2,{SUPERSCRIPT_TWO}"]) == 2
    assert "--nprocs takes comma-separated integers" in capsys.readouterr().err
    assert calibrate_main(["--base", "h100", "--out", out, "--nccl-table", f"{table}:alltoall:{SUPERSCRIPT_TWO}"]) == 2
    assert "NRANKS must be an integer >= 2" in capsys.readouterr().err


def test_added_tokens_decoder_key(tmp_path: Path):
    from launch.tokenizer_backend import TokenizerError, _config_added_tokens

    with pytest.raises(TokenizerError, match="the key must be a token id"):
        _config_added_tokens({"added_tokens_decoder": {SUPERSCRIPT_TWO: {"content": "<x>"}}},
                             tmp_path / "tokenizer_config.json")
