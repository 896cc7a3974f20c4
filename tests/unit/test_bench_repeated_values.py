"""A benchmark flag that lists a value twice is refused by name: the row would run again and count twice
in any total (bench eplb's copies moved), as --impls and --shapes already were."""

from __future__ import annotations

import pytest

from launch.bench import decode, eplb, moe_layer, repeated_value_problem, sampler


def test_the_first_repeated_value_is_named() -> None:
    assert repeated_value_problem("--tokens", [1, 32, 512]) is None
    assert repeated_value_problem("--tokens", None) is None
    assert repeated_value_problem("--tokens", [1, 32, 1, 32]) == "--tokens lists 1 twice"


@pytest.mark.parametrize(("main", "argv", "line"), [
    (moe_layer.main, ["--tokens", "2", "2"], "error: --tokens lists 2 twice"),
    (sampler.main, ["--settings", "greedy", "greedy"], "error: --settings lists greedy twice"),
])
def test_repeated_values_are_refused_before_anything_runs(capsys, main, argv, line) -> None:
    assert main(argv) == 2
    assert capsys.readouterr().err.strip() == line


def test_decode_and_eplb_refuse_them_too(tiny_ckpt, capsys) -> None:
    assert decode.main(["--model", str(tiny_ckpt), "--batch-sizes", "2", "4", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --batch-sizes lists 2 twice"
    with pytest.raises(SystemExit) as e:
        eplb.main(["--scenario", "mixtral-ep8", "--scenario", "mixtral-ep8"])
    assert e.value.code == 2
    assert "error: --scenario lists mixtral-ep8 twice" in capsys.readouterr().err
