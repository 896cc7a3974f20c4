"""QA of ``profile report`` / ``profile run``: a ``--redundant`` count past 3 x E refused before
anything is allocated, no ``--eplb-config`` recommended when no schedule beats no EPLB, an SGLang
per_pass rank file missing from a dump, the EP size a recommendation is for, token-id workloads
(as ``sweep --workload`` reads them), and the default what-if EP sizes as documented."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest

from launch import cli
from launch.profile.commands import report_main, run_main
from launch.profile.readers import DumpError, read_recording
from launch.profile.report import summary_of
from launch.profile.study import ReportOptions, analyze
from launch.profile.whatif import (
    MAX_COPIES_PER_EXPERT,
    default_ep_sizes,
    max_redundant,
    recommend_eplb_config,
)
from tests.unit.profile_dumps import skewed_counts, write_sglang_per_pass

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "profiling.md"


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


# ---- 1. --redundant is bounded ------------------------------------------------------------------


def test_a_redundant_count_past_three_times_the_experts_is_refused_naming_the_flag(tmp_path, capsys, monkeypatch):
    import launch.profile.study

    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(6, 2, 8, seed=1))
    monkeypatch.setattr(launch.profile.study, "compute_what_if", lambda *a, **k: pytest.fail("the what-if ran"))
    out = tmp_path / "r"
    assert report_main([str(counts), "--out", str(out), "--ep", "2", "--redundant", "0", "100000",
                        "--no-progress"]) == 2
    assert _one_line(capsys) == ("error: --redundant 100000: at most 24 redundant experts per layer for 8 experts "
                                 "(3 x E, so 4 slots per expert on average; EPLB deployments use a few per EP rank)")
    assert not out.exists() and max_redundant(8) == 24


def test_the_largest_redundant_count_allowed_is_drawn(tmp_path, capsys):
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(6, 2, 8, seed=1))
    assert report_main([str(counts), "--out", str(tmp_path / "r"), "--ep", "8", "--redundant", "24",
                        "--no-progress"]) == 0
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert {r["redundant"] for r in summary["what_if"]} == {24}


def test_a_repeated_ep_size_is_drawn_once(tmp_path):
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(6, 2, 8, seed=1))
    rows = summary_of(analyze(read_recording([counts]), ReportOptions(ep_sizes=[4, 4, 4], progress=False)))["what_if"]
    assert len(rows) == len({(r["ep"], r["redundant"], r["policy"]) for r in rows}) > 0


def test_the_help_and_docs_state_the_bound_the_code_applies(capsys):
    with pytest.raises(SystemExit):
        report_main(["--help"])
    assert f"at most {MAX_COPIES_PER_EXPERT - 1} x E" in " ".join(capsys.readouterr().out.split())
    assert f"above {MAX_COPIES_PER_EXPERT - 1} x E is an error" in " ".join(DOCS.read_text().split())


def test_profile_run_refuses_a_redundant_count_past_the_bound_before_running(tiny_ckpt, tmp_path, capsys,
                                                                              monkeypatch):
    import launch.profile.runner

    monkeypatch.setattr(launch.profile.runner, "run_and_report", lambda *a, **k: pytest.fail("the workload ran"))
    assert run_main(["--model", str(tiny_ckpt), "--workload", "prose", "--out", str(tmp_path / "r"),
                     "--redundant", "25"]) == 2
    assert _one_line(capsys).startswith("error: --redundant 25: at most 24 redundant experts per layer for 8 experts")
    assert not (tmp_path / "r").exists()


# ---- 2. no --eplb-config when rebalancing does not pay ------------------------------------------


def _noise(seed: int = 0) -> np.ndarray:
    """[50, 3, 16] uniform noise: the last 10 steps say nothing about the next, so every replayed
    schedule realizes less than the identity placement (checked below, not assumed)."""
    return np.random.default_rng(seed).integers(0, 30, size=(50, 3, 16)).astype(float)


def test_no_schedule_is_recommended_when_none_beats_no_eplb():
    rec = recommend_eplb_config(_noise(), 4, 0, {}, progress=False)
    assert max(c["balancedness"] for c in rec["candidates"]) < rec["no_eplb_balancedness"]
    assert rec["window_size"] is None and rec["step_interval"] is None and rec["pays"] is False
    assert "rebalancing does not pay on this load" in rec["basis"] and "leave EPLB off" in rec["basis"]
    assert f"no EPLB {rec['no_eplb_balancedness']:.3f}" in rec["basis"]


def test_the_report_says_rebalancing_does_not_pay_instead_of_a_config(tmp_path, capsys):
    counts = tmp_path / "c.npy"
    np.save(counts, _noise().astype(np.int64))
    out = tmp_path / "r"
    assert cli.main(["profile", "report", str(counts), "--ep", "4", "--out", str(out), "--no-progress"]) == 0
    eplb = json.loads((out / "summary.json").read_text())["recommendation"]["eplb_config"]
    assert eplb["window_size"] is None and eplb["pays"] is False
    page = (out / "index.html").read_text()
    assert "--eplb-config &#x27;" not in page and "--eplb-config '" not in page
    assert "rebalancing does not pay on this load" in page and "class=best" not in page.split("id='schedule'")[1]


# ---- 3. SGLang per_pass rank files --------------------------------------------------------------


def _local_rank_files(tmp_path, num_ranks: int = 2) -> list[pathlib.Path]:
    """One per_pass file per rank whose records count only that rank's slots (DeepEP's counts)."""
    phy2log = np.tile(np.arange(16), (3, 1))
    rng = np.random.default_rng(0)
    block = 16 // num_ranks
    paths = []
    for rank in range(num_ranks):
        physical = np.zeros((5, 3, 16), dtype=np.int64)
        physical[:, :, rank * block:(rank + 1) * block] = rng.integers(1, 30, size=(5, 3, block))
        paths.append(write_sglang_per_pass(tmp_path / f"pp_{rank}.pt", physical, phy2log, rank, list(range(5))))
    return paths


def test_one_ranks_per_pass_file_of_a_two_rank_dump_is_refused_naming_the_missing_rank(tmp_path, capsys):
    rank0, rank1 = _local_rank_files(tmp_path)
    with pytest.raises(DumpError) as info:
        read_recording([rank0])
    assert str(info.value) == (f"{rank0}: SGLang per_pass dump holds the records of rank(s) 0; each counts only "
                               "its own 8 of the 16 slots, so the run had 2 ranks, and the file(s) of rank(s) 1 "
                               "are missing: give every rank's file of the dump together")
    assert report_main([str(rank1), "--out", str(tmp_path / "r"), "--no-progress"]) == 2
    assert _one_line(capsys).endswith("the file(s) of rank(s) 0 are missing: give every rank's file of the dump "
                                      "together")
    summary = summary_of(analyze(read_recording([rank0, rank1]), ReportOptions(progress=False)))
    assert summary["recorded_ep"] == 2 and all(min(x["rank_load"]) > 0 for x in summary["layers"])


def test_per_pass_ranks_that_skip_one_name_it(tmp_path):
    files = _local_rank_files(tmp_path, num_ranks=4)
    with pytest.raises(DumpError, match=r"of rank\(s\) 0, 1, 3; each counts only its own 4 of the 16 slots, so "
                                        r"the run had 4 ranks, and the file\(s\) of rank\(s\) 2 are missing"):
        read_recording([files[0], files[1], files[3]])
    phy2log = np.tile(np.arange(8), (2, 1))
    full = np.random.default_rng(1).integers(1, 9, size=(3, 2, 8))  # every slot counted: no block to infer
    a = write_sglang_per_pass(tmp_path / "a.pt", full, phy2log, 0, [0, 1, 2])
    b = write_sglang_per_pass(tmp_path / "b.pt", full, phy2log, 2, [0, 1, 2])
    with pytest.raises(DumpError, match=r"rank ids run to 2, and the file\(s\) of rank\(s\) 1 are missing"):
        read_recording([a, b])
    assert read_recording([a]).num_steps == 3  # one rank's file of every slot's counts stands on its own
    huge = write_sglang_per_pass(tmp_path / "huge.pt", full, phy2log, 10**12, [0, 1, 2])
    with pytest.raises(DumpError, match=r"rank ids run to 1000000000000, and the file\(s\) of rank\(s\) "
                                        r"0-999999999999 are missing"):
        read_recording([huge])  # named as a run, not listed


# ---- 4. the EP size a recommendation is for -----------------------------------------------------


def test_the_recommendation_says_which_ep_size_it_is_for(tmp_path, capsys):
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(40, 3, 16, seed=2))
    out = tmp_path / "r"
    assert cli.main(["profile", "report", str(counts), "--ep", "4", "--recorded-ep", "8", "--out", str(out),
                     "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    rec = summary["recommendation"]
    assert summary["recorded_ep"] == 8 and rec["ep"] == 4 and rec["num_redundant_experts"]["ep"] == 4
    assert rec["ep_basis"] == ("for EP 4, the first what-if EP size: the recording ran at EP 8, which is not "
                               "among the what-if EP sizes (add --ep 8 for one at it)")
    assert "For EP 4, the first what-if EP size: the recording ran at EP 8" in (out / "index.html").read_text()
    again = summary_of(analyze(read_recording([counts]), ReportOptions(ep_sizes=[4, 8], recorded_ep=8,
                                                                       progress=False)))["recommendation"]
    assert again["ep"] == 8 and again["ep_basis"] == "for EP 8, the recorded EP size"
    assert again["num_redundant_experts"]["ep"] == 8 and "at EP 8 " in again["eplb_config"]["basis"]


# ---- 5. profile run reads the workloads sweep reads ---------------------------------------------


def test_token_id_workload_lines_are_read_as_sweep_reads_them(tmp_path):
    """profile run and sweep read a workload through the same reader (``launch.workloads``): text and
    token-id lines of one file, phases joined by ``+``, the same one-line errors."""
    from launch.sweep.workload import load_prompts
    from launch.workloads import load_workload_phases

    tok = tmp_path / "tok.jsonl"
    tok.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt": "mixed text"}\n')
    phases = load_workload_phases(f"{tok}+prose")
    assert [name for name, _ in phases] == [str(tok), "prose"]
    assert phases[0][1] == load_prompts(str(tok))[1] == [(1, 2, 3), "mixed text"]
    assert all(isinstance(p, str) for p in phases[1][1]) and phases[1][1]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    for read in (load_workload_phases, load_prompts):
        with pytest.raises(ValueError, match=r"bad.jsonl:1: expected an object with a string \"prompt\" or a list"):
            read(str(bad))
    sampling = tmp_path / "s.jsonl"
    sampling.write_text('{"prompt_token_ids": [4], "max_tokens": 3}\n')
    for read in (load_workload_phases, load_prompts):
        with pytest.raises(ValueError, match=r"sampling field\(s\) \['max_tokens'\]"):
            read(str(sampling))


def test_token_ids_outside_the_vocabulary_are_refused_before_the_model_loads(tiny_ckpt, tmp_path, capsys,
                                                                            monkeypatch):
    import launch.llm

    monkeypatch.setattr(launch.llm, "LLM", lambda *a, **k: pytest.fail("the model was loaded"))
    tok = tmp_path / "tok.jsonl"
    tok.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [99999]}\n')
    assert run_main(["--model", str(tiny_ckpt), "--workload", str(tok), "--out", str(tmp_path / "r"),
                     "--no-progress"]) == 2
    assert _one_line(capsys) == (f"error: workload {tok}: prompt 2 has token id 99999, outside the vocabulary "
                                 f"[0, 512) of {tiny_ckpt}")
    assert run_main(["--model", str(tiny_ckpt), "--workload", "prose", "--out", str(tmp_path / "r"),
                     "--no-progress"]) == 2  # text, and tiny_ckpt has no tokenizer.json
    assert "prompt 1 is text but" in _one_line(capsys)


@pytest.mark.slow
def test_profile_run_over_token_ids_on_a_checkpoint_without_a_tokenizer(tiny_ckpt, tmp_path, capsys):
    tok = tmp_path / "tok.jsonl"
    tok.write_text('{"prompt_token_ids": [1, 2, 3]}\n{"prompt_token_ids": [40, 41, 42, 43]}\n')
    out = tmp_path / "r"
    assert run_main(["--model", str(tiny_ckpt), "--workload", str(tok), "--steps", "4", "--max-tokens", "4",
                     "--ep", "2", "--out", str(out), "--no-progress"]) == 0, capsys.readouterr().err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 4 and sum(x["tokens"] for x in summary["layers"]) > 0


# ---- 6. default what-if EP sizes, as documented --------------------------------------------------


def test_default_ep_sizes_match_the_docs(capsys):
    assert default_ep_sizes(7) == [7] and default_ep_sizes(12) == [2, 4] and default_ep_sizes(256)[-1] == 64
    docs = " ".join(DOCS.read_text().split())
    assert "the powers of two up to 64 that divide E, or E itself when none does: EP 7 for 7 experts" in docs
    assert "powers of two up to 64 that divide E)" not in docs


def test_a_recording_that_names_no_ep_size_is_not_called_the_recorded_one(tmp_path):
    """A .npy (or a one-rank run's dump) says no EP size: it is analysed at the first --ep, and the
    recommendation said "the recorded EP size" of it."""
    counts = tmp_path / "c.npy"
    np.save(counts, skewed_counts(40, 3, 16, seed=2))
    summary = summary_of(analyze(read_recording([counts]), ReportOptions(ep_sizes=[4, 8], progress=False)))
    assert summary["recorded_ep"] == 4 and summary["recommendation"]["ep"] == 4
    assert summary["recommendation"]["ep_basis"] == (
        "for EP 4, the first --ep, which the recording is analysed at: it ran without expert parallelism (one "
        "rank, or tensor / data parallel ranks without EP), or its dumps name no EP size (--recorded-ep names one)")
