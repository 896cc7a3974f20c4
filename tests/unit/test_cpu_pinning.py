"""parallel.enable_cpu_pinning: a rank pins its process to one CPU and one torch thread, and undoes it."""

from __future__ import annotations

import os
import threading

import torch

from launch.config import load_runtime_config
from launch.worker import Worker, WorkerSpec


def test_worker_pins_every_thread_then_restores():
    before, threads = os.sched_getaffinity(0), torch.get_num_threads()
    cpus = sorted(before)
    started = threading.Event()
    stop = threading.Event()
    helper = threading.Thread(target=lambda: (started.set(), stop.wait()))  # a thread that exists before
    helper.start()
    started.wait()
    try:
        worker = Worker(WorkerSpec(model_path="unused", tp=1, dp=4, ep=4, pin_cpu=True), rank=3)
        want = {cpus[3 % len(cpus)]}
        assert os.sched_getaffinity(0) == want and torch.get_num_threads() == 1
        assert os.sched_getaffinity(helper.native_id) == want
        worker.shutdown()
        assert os.sched_getaffinity(0) == before and torch.get_num_threads() == threads
        assert os.sched_getaffinity(helper.native_id) == before
    finally:
        stop.set()
        helper.join()


def test_unpinned_worker_leaves_affinity_alone():
    before = os.sched_getaffinity(0)
    Worker(WorkerSpec(model_path="unused"), rank=0).shutdown()
    assert os.sched_getaffinity(0) == before


def test_config_key_and_flag():
    cfg = load_runtime_config(overrides=["model=ckpt", "parallel.enable_cpu_pinning=true"])
    assert cfg.parallel.enable_cpu_pinning is True
    assert load_runtime_config(overrides=["model=ckpt"]).parallel.enable_cpu_pinning is False
    import argparse

    from launch.config_args import add_runtime_args, runtime_config_from_args

    args = add_runtime_args(argparse.ArgumentParser()).parse_args(["--model", "m", "--enable-cpu-pinning"])
    assert runtime_config_from_args(args).parallel.enable_cpu_pinning is True
