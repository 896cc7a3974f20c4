"""The cost model against published serving figures, through the ``simulate`` command.

DeepSeek's day-6 post (per H800 node: ~73.7k input tok/s in prefill with EP32 + 32
redundant experts, cache hits (56.3 %) included; ~14.8k output tok/s in decode with EP144;
average KV length 4,989) within 20 %; SGLang's 96-H100 blog (per node: 52.3k input tok/s
prefill, 22.3k output tok/s decode, 2000-token inputs) within 25 %. The layouts are the
shipped configs; the efficiencies are the ones in configs/hardware (one set for Hopper).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch.simulate import main

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
OVERLAP = ["--two-batch-overlap", "--dispatch-dtype", "fp8"]

CASES = [
    ("deepseek-v3-prefill-ep32", "h800", ["--input-len", "4989", "--prefix-hit-rate", "0.563"],
     "prefill_input_tokens_per_s_per_node", 73_700, 0.20),
    ("deepseek-v3-decode-ep144", "h800", ["--input-len", "4989", "--kv-len", "4989"],
     "decode_output_tokens_per_s_per_node", 14_800, 0.20),
    ("sglang-h100-prefill-ep32", "h100", ["--input-len", "2000"],
     "prefill_input_tokens_per_s_per_node", 52_300, 0.25),
    ("sglang-h100-decode-ep72", "h100", ["--input-len", "2000", "--output-len", "100"],
     "decode_output_tokens_per_s_per_node", 22_300, 0.25),
]


@pytest.mark.parametrize(("config", "hardware", "flags", "key", "published", "bound"), CASES,
                         ids=[c[0] for c in CASES])
def test_prediction_within_bound_of_published_figure(tmp_path, config, hardware, flags, key, published, bound):
    out = tmp_path / "report.json"
    rc = main(["--config", str(CONFIGS / f"{config}.yaml"), "--hardware", hardware, *flags, *OVERLAP,
               "--json", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    predicted = report[key]
    assert abs(predicted - published) / published <= bound, f"{config}: predicted {predicted:,.0f} vs {published:,}"
    assert report["decode"]["breakdown_ms"] and report["prefill"]["breakdown_ms"]
