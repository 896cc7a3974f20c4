"""QA of the dump readers: a CSV dump without a ``.csv`` suffix is recognised by its header (as
the other formats are by their first bytes), and a ``.npy`` that is not one says so instead of
repeating numpy's advice to load it as a pickle."""

from __future__ import annotations

import numpy as np
import pytest

from launch.profile.readers import DumpError, read_dump


@pytest.mark.parametrize("prefix,newline", [(b"", b"\n"), (b"\xef\xbb\xbf", b"\r\n")])
def test_a_csv_dump_without_its_suffix_is_read_by_its_header(tmp_path, prefix, newline):
    rows = [b"step,layer,e0,e1,e2", b"0,0,1,2,3", b"0,1,0,0,5", b"1,0,4,0,0", b"1,1,1,1,1"]
    path = tmp_path / "counts_export"
    path.write_bytes(prefix + newline.join(rows) + newline)
    dump = read_dump(path)
    assert dump.format == "csv"
    np.testing.assert_array_equal(dump.logical_count, [[[1, 2, 3], [0, 0, 5]], [[4, 0, 0], [1, 1, 1]]])


def test_a_file_without_suffix_or_known_header_is_still_an_unknown_format(tmp_path):
    path = tmp_path / "notes"
    path.write_text("hello\n")
    with pytest.raises(DumpError, match="unknown dump format"):
        read_dump(path)


def test_a_npy_that_is_not_one_is_named_without_numpys_pickle_advice(tmp_path):
    path = tmp_path / "counts.npy"
    path.write_bytes(b"step,layer,e0\n0,0,1\n")
    with pytest.raises(DumpError) as info:
        read_dump(path)
    message = str(info.value)
    assert message == f"{path}: not a .npy file (it does not start with NumPy's header)"
    assert "pickle" not in message
