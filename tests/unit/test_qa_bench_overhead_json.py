"""bench overhead: the result JSON names the dtype the run computed in, not the flag's "auto"."""

from __future__ import annotations

import json

from launch.bench import overhead as bench_overhead
from launch.engine import resolve_dtype
from moe.config import ModelConfig


def test_json_dtype_is_the_resolved_compute_dtype(tiny_ckpt, tmp_path, capsys) -> None:
    out = tmp_path / "overhead.json"
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--batch", "2", "--context-len", "3", "--steps", "2",
                                "--warmup-steps", "0", "--num-threads", "1", "--json", str(out)]) == 0
    dtype = json.loads(out.read_text())["dtype"]
    assert dtype == resolve_dtype("auto", ModelConfig.from_hf(tiny_ckpt)) and dtype != "auto"
    assert bench_overhead.main(["--model", str(tiny_ckpt), "--dtype", "bfloat16", "--batch", "2", "--context-len",
                                "3", "--steps", "2", "--warmup-steps", "0", "--num-threads", "1", "--json",
                                str(out)]) == 0
    assert json.loads(out.read_text())["dtype"] == "bfloat16"
