"""The prefill steps ``bench decode`` and ``bench overhead`` plan for: a batch near the step's token
budget prefills over many more steps than tokens / budget, because the sequences already prefilled
take their decode tokens out of each step's budget first."""

from __future__ import annotations

import pytest

from launch.bench import decode as bench_decode
from launch.bench import overhead as bench_overhead
from launch.bench.decode import num_prefill_steps


def test_prefill_steps_leave_the_decoding_sequences_their_tokens() -> None:
    assert num_prefill_steps(4, 10, 40) == 1  # the whole batch in one step
    assert num_prefill_steps(4, 10, 12) == 4  # 12, 11, 10, 9 tokens (one sequence decodes more each step)
    # 100 tokens at 12 a step less one per decoding sequence: 12, 11, 10, 9, 8, 7, 7, 6, 5, 5, 4, 4, 4, 3, 3, 3
    assert num_prefill_steps(10, 10, 12) == 16 > -(-100 // 12)
    assert num_prefill_steps(1, 1, 1) == 1


@pytest.mark.slow
def test_decode_and_overhead_run_a_batch_as_large_as_the_token_budget(tiny_ckpt, capsys) -> None:
    """A batch of 120 prompts of 8 tokens under a budget of 120 tokens a step: 41 prefill steps, where
    tokens / budget gives 8 and the first sequences ran out of tokens before the last were prefilled."""
    flags = ["--model", str(tiny_ckpt), "--dtype", "float32", "--context-len", "8", "--steps", "2",
             "--warmup-steps", "1", "--num-threads", "1", "--max-num-batched-tokens", "120"]
    assert num_prefill_steps(120, 8, 120) == 41
    assert bench_decode.main([*flags, "--batch-sizes", "120", "--copy-mib", "4"]) == 0
    assert bench_overhead.main([*flags, "--batch", "120"]) == 0
    assert "error" not in capsys.readouterr().err


@pytest.mark.parametrize("target", ["dir", "under_file"])
def test_decode_refuses_an_unwritable_json_before_loading(tiny_ckpt, tmp_path, monkeypatch, capsys, target) -> None:
    def no_engine(*args, **kwargs):
        raise AssertionError("the engine started before --json was checked")

    monkeypatch.setattr("launch.engine.LLMEngine", no_engine)
    (tmp_path / "file").write_text("x")
    path = tmp_path if target == "dir" else tmp_path / "file" / "out.json"
    assert bench_decode.main(["--model", str(tiny_ckpt), "--json", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "--json" in err and err.count("\n") == 1
