"""A fixed ``--num-kv-blocks`` is held to the memory budget as ``simulate`` holds it, and a KV pool
the system will not map ends a command with one line, not a traceback."""

from __future__ import annotations

import mmap

import pytest
import torch

from launch.cli import EXIT_FAILED, _user_error
from launch.config import RuntimeConfig
from launch.engine import check_runtime_config
from moe.host_memory import anonymous_tensor


def _plan(ckpt, **engine):
    return check_runtime_config(RuntimeConfig.from_dict({"model": str(ckpt), "engine": {"block_size": 16, **engine}}))


def test_an_override_past_the_budget_is_refused_naming_the_flag_and_what_fits(tiny_ckpt, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fits = _plan(tiny_ckpt, max_num_seqs=10**6, max_model_len=2048).num_kv_blocks  # what the default budget holds
    assert fits > 1000
    assert _plan(tiny_ckpt, num_kv_blocks=fits).num_kv_blocks == fits  # at the line: taken as given
    assert _plan(tiny_ckpt, num_kv_blocks=7).num_kv_blocks == 7
    with pytest.raises(ValueError) as err:
        _plan(tiny_ckpt, num_kv_blocks=fits + 1)
    msg = str(err.value)
    assert msg.startswith(f"num_kv_blocks {fits + 1:,} (--num-kv-blocks) of 16 tokens hold ")
    assert f"at most {fits:,} blocks fit" in msg and "the CPU default 2GiB" in msg and "--memory" in msg
    assert "\n" not in msg
    # a budget given: that budget, and no word about the default
    assert _plan(tiny_ckpt, num_kv_blocks=4 * fits, memory="8GiB").num_kv_blocks == 4 * fits
    with pytest.raises(ValueError, match=r"over the .* that 0.9 x 8.00 GiB leaves beside the weights") as err:
        _plan(tiny_ckpt, num_kv_blocks=5 * fits, memory="8GiB")
    assert "default" not in str(err.value)


def test_a_mapping_the_system_refuses_is_a_memory_error_naming_its_size(monkeypatch):
    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(mmap, "mmap", refuse)
    with pytest.raises(MemoryError, match=r"^cannot map 2\.00 GiB for a \[1024, 1024, 512\] torch.float32 tensor: "
                                          r"Cannot allocate memory$"):
        anonymous_tensor((1024, 1024, 512), torch.float32)


def test_a_memory_error_ends_a_command_with_one_line():
    line, status = _user_error(MemoryError("cannot map 762.94 GiB for a [100000000, 16] torch.float32 tensor: x"))
    assert status == EXIT_FAILED and "\n" not in line
    assert line.startswith("out of memory: cannot map 762.94 GiB") and line.endswith("(a smaller --memory or "
                                                                                    "--num-kv-blocks)")
    assert _user_error(MemoryError()) is None  # a bare one (the allocator's own): a bug's traceback


def test_an_allocation_other_than_a_pool_names_no_pool_flags():
    """NumPy's or PyTorch's own MemoryError (a command's input too large): one line, without the KV pool
    flags' hint, which the command may not even have."""
    line, status = _user_error(MemoryError("Unable to allocate 10.9 TiB for an array with shape (1000000, 3000000)\n"
                                           "and data type int32"))
    assert status == EXIT_FAILED and "\n" not in line
    assert line.startswith("out of memory: Unable to allocate 10.9 TiB") and "--memory" not in line
