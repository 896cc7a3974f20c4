"""Shipped prompt workloads and user workload files (launch.workloads)."""

from __future__ import annotations

import json
import re

import pytest

from launch.workloads import WORKLOAD_DIR, WORKLOAD_NAMES, WorkloadError, load_workload, load_workload_phases


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_shipped_workloads_load_and_are_distinct(name: str) -> None:
    prompts = load_workload(name)
    assert len(prompts) >= 16
    assert all(isinstance(p, str) and p.strip() for p in prompts)
    assert len(set(prompts)) == len(prompts)
    for other in WORKLOAD_NAMES:
        if other != name:
            assert not set(prompts) & set(load_workload(other))


def test_shipped_workloads_differ_in_kind() -> None:
    code, tables, french = load_workload("code"), load_workload("tables"), load_workload("french")
    assert sum("def " in p or "class " in p for p in code) > len(code) // 2
    assert all(sum(c.isdigit() for c in p) > 10 for p in tables)
    assert all(any(c in "éèàçêùâôî" for c in p) or " le " in p.lower() or " la " in p.lower() for p in french)


def test_phases_join_in_order() -> None:
    prose, code = load_workload("prose"), load_workload("code")
    assert load_workload("prose+code") == prose + code
    assert load_workload(" code + prose ") == code + prose
    phases = load_workload_phases("tables+french+tables")
    assert [name for name, _ in phases] == ["tables", "french", "tables"]
    assert phases[0][1] == phases[2][1] == load_workload("tables")


def test_user_files(tmp_path) -> None:
    jl = tmp_path / "mine.jsonl"
    jl.write_text(json.dumps({"prompt": "a\nb", "id": 3}) + "\n\n" + json.dumps({"prompt": "c"}) + "\n")
    txt = tmp_path / "mine.txt"
    txt.write_text("first prompt\n\n  \nsecond prompt\n")
    assert load_workload(str(jl)) == ["a\nb", "c"]
    assert load_workload(str(txt)) == ["first prompt", "second prompt"]
    assert load_workload(f"{txt}+code") == ["first prompt", "second prompt"] + load_workload("code")
    plus = tmp_path / "a+b.txt"
    plus.write_text("x\n")
    assert load_workload(str(plus)) == ["x"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("poetry", "unknown workload 'poetry'"),
        ("prose+", "empty phase"),
        ("", "empty workload spec"),
        ("missing.jsonl", "missing.jsonl not found"),
        ("prose+nope.txt", "nope.txt not found"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=message) as info:
        load_workload(spec)
    assert "\n" not in str(info.value)


def test_a_directory_is_not_a_workload(tmp_path) -> None:
    with pytest.raises(WorkloadError, match=f"^workload {tmp_path} is a directory: give a .jsonl or .txt file"):
        load_workload(str(tmp_path))


def test_bad_file_lines(tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: expected an object"):
        load_workload(str(bad))
    bad.write_text('{"prompt": "ok"}\nnot json\n')
    with pytest.raises(WorkloadError, match=r"bad.jsonl:2: not JSON"):
        load_workload(str(bad))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(WorkloadError, match="holds no prompts"):
        load_workload(str(empty))
    other = tmp_path / "p.csv"
    other.write_text("a\n")
    with pytest.raises(WorkloadError, match="expected a .jsonl or .txt"):
        load_workload(str(other))


@pytest.mark.parametrize("name", ["bad.txt", "bad.jsonl"])
def test_a_file_that_is_not_utf8_names_the_file(tmp_path, name: str) -> None:
    bad = tmp_path / name
    bad.write_bytes(b'{"prompt": "ok"}\n\xff\xfe{"prompt": "x"}\n')
    with pytest.raises(WorkloadError, match=re.escape(f"{bad}: not UTF-8 text (line 2)") + "$"):
        load_workload(str(bad))


def test_a_byte_order_mark_is_not_part_of_the_first_prompt(tmp_path) -> None:
    for name, text in (("bom.txt", "first\nsecond\n"), ("bom.jsonl", '{"prompt": "first"}\n{"prompt": "second"}\n')):
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + text.encode())
        assert load_workload(str(path)) == ["first", "second"]


def test_every_shipped_file_is_named() -> None:
    assert sorted(p.stem for p in WORKLOAD_DIR.glob("*.jsonl")) == sorted(WORKLOAD_NAMES)


@pytest.mark.parametrize("line, problem", [  # launch.tokenizer.check_prompt's words, as generate's lines get them
    ('{"prompt_token_ids": []}', "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ('{"prompt_token_ids": [1, -2]}', "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ('{"prompt_token_ids": [1, true]}', "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ('{"prompt_token_ids": "1 2"}', "'prompt_token_ids' must be a non-empty list of non-negative integers"),
    ('{"prompt": "a", "prompt_token_ids": [1]}', "(one of the two)"),
    ('{"prompt": [1, 2]}', "'prompt' must be a non-empty string"),
])
def test_token_id_lines_that_are_no_token_ids_are_one_line_errors(tmp_path, line: str, problem: str) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt_token_ids": [5, 6]}\n' + line + "\n")
    with pytest.raises(WorkloadError) as e:
        load_workload(str(path))
    assert str(e.value).startswith(f"{path}:2: ") and problem in str(e.value) and "\n" not in str(e.value)


def test_token_id_lines_are_prompts_of_their_own() -> None:
    from launch.workloads import check_workload_row

    assert check_workload_row({"prompt_token_ids": [0, 7, 3], "id": "x"}, "f:1") == (0, 7, 3)
    assert check_workload_row({"prompt": "text"}, "f:1") == "text"
