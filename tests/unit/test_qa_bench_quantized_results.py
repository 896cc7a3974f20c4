"""bench throughput / decode: a run with int8 experts or an fp8 KV cache says so in its result JSON
(and throughput in its report), so two result files of different runs cannot be mistaken for each other."""

from __future__ import annotations

import json

from launch.bench import decode as bench_decode
from launch.bench import throughput as bench_throughput


def test_throughput_records_quantization_and_kv_cache_dtype(tiny_ckpt, tmp_path, capsys) -> None:
    out = tmp_path / "t.json"
    flags = ["--model", str(tiny_ckpt), "--num-prompts", "2", "--input-len-range", "2", "3", "--output-len-range",
             "1", "2", "--baseline", "none", "--num-threads", "1", "--json", str(out)]
    assert bench_throughput.main([*flags, "-q", "int8", "--kv-cache-dtype", "fp8"]) == 0
    r = json.loads(out.read_text())
    assert (r["quantization"], r["kv_cache_dtype"]) == ("int8", "fp8")
    assert "Ours: routed experts / KV cache:        int8 / fp8" in capsys.readouterr().out
    assert bench_throughput.main(flags) == 0
    r = json.loads(out.read_text())
    assert (r["quantization"], r["kv_cache_dtype"]) == (None, "auto")
    assert "Ours: routed experts / KV cache:        bfloat16 / auto" in capsys.readouterr().out


def test_decode_records_quantization_and_kv_cache_dtype(tiny_ckpt, tmp_path) -> None:
    out = tmp_path / "d.json"
    assert bench_decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "1", "--context-len", "3", "--steps", "1",
                              "--warmup-steps", "0", "--copy-mib", "1", "--num-threads", "1", "-q", "int8",
                              "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["quantization"], r["kv_cache_dtype"]) == ("int8", "auto")
