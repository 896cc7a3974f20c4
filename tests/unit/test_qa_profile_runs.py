"""QA of ``profile run``'s step budget per workload phase and of ``--init-expert-location`` dumps
whose placement does not fit the layout: both must be one-line errors naming the problem."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from launch import cli
from launch.expert_location import placement_from_dump
from launch.profile.runner import ProfileRunError, drive


def test_steps_fewer_than_phases_is_one_line_error_before_the_model_loads(tiny_ckpt, tmp_path, capsys,
                                                                           monkeypatch):
    import launch.llm

    monkeypatch.setattr(launch.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    out = tmp_path / "r"
    rc = cli.main(["profile", "run", "--model", str(tiny_ckpt), "--workload", "prose+code+tables+french",
                   "--steps", "3", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == "error: --steps 3 is fewer than the 4 workload phases: every phase needs at least one step\n"
    assert not out.exists()


class _Counters:
    num_steps = 0


class _FakeEngine:
    """Just enough of LLMEngine for ``drive``: every step runs (and records) one engine step."""

    class config:  # noqa: N801 - mirrors engine.config.engine / .parallel
        class engine:  # noqa: N801
            max_num_seqs = 1

        class parallel:  # noqa: N801
            data_parallel_size = 1

    def __init__(self) -> None:
        self.counters = _Counters()
        self.ids = 0
        self.max_model_len = 64

    class tokenizer:  # noqa: N801
        @staticmethod
        def encode(text):
            return [1, 2, 3]

    def next_request_id(self):
        self.ids += 1
        return str(self.ids)

    def add_request(self, *args, **kwargs):
        pass

    def step(self):
        self.counters.num_steps += 1
        return []

    def abort_request(self, rid):
        pass


@pytest.mark.parametrize("steps,want", [(7, [1, 2, 2, 2]), (8, [2, 2, 2, 2]), (5, [1, 1, 1, 2]), (4, [1, 1, 1, 1])])
def test_steps_are_split_evenly_over_the_phases(steps, want):
    phases = [(name, ["a prompt"]) for name in ("prose", "code", "tables", "french")]
    spans = drive(_FakeEngine(), phases, steps, max_tokens=4, progress=False)
    assert [end - start for _, start, end in spans] == want
    assert spans[-1][2] == steps and all(a[2] == b[1] for a, b in zip(spans, spans[1:]))


def test_drive_refuses_a_phase_without_steps():
    phases = [("prose", ["p"]), ("code", ["c"]), ("tables", ["t"])]
    with pytest.raises(ProfileRunError, match="--steps 2 is fewer than the 3 workload phases"):
        drive(_FakeEngine(), phases, 2, max_tokens=4, progress=False)


@pytest.mark.parametrize("phy2log,problem", [
    ([[0, 1, 2, 3, 4, 5, 6, 7, 8, 9]] * 2, "phy2log holds expert ids outside [0, 8)"),
    ([[0, 1, 2, 3, 4, 5, 6, 0, 0, 1]] * 2, "expert 7 of layer 0 has no physical slot"),
])
def test_a_dump_placement_that_does_not_fit_names_the_file(tmp_path, phy2log, problem):
    path = tmp_path / "dump.safetensors"
    save_file({"phy2log": np.array(phy2log, dtype=np.int64)}, str(path))
    with pytest.raises(ValueError) as info:
        placement_from_dump(path, num_layers=2, num_experts=8, num_physical_experts=10, num_gpus=2)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and problem in message and "\n" not in message
