"""The demo-model pipeline's training helpers: the CPU turn (pauses for benchmarks), the batch mix,
early-finished runs, and the instruction pairs."""

from __future__ import annotations

import fcntl
import json
import os
import threading

import numpy as np
import pytest

from tools.demo_models.cpu_lock import CpuTurn
from tools.demo_models.instruct import render, task_from_docstring, third_person
from tools.demo_models.train import BatchSampler, finished_step
from tools.demo_models.train_args import parse_mix


def _locked(path, mode: int) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, mode)
    return fd


def test_a_step_holds_the_cpu_shared_and_a_benchmark_cannot_start(tmp_path):
    gate, cpu = tmp_path / "gate", tmp_path / "cpu"
    turn = CpuTurn(True, gate, cpu)
    with turn:
        fd = os.open(cpu, os.O_RDONLY)
        with pytest.raises(BlockingIOError):  # kv-bench's exclusive lock must wait for the step
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # kv-test shares it
        os.close(fd)
    fd = _locked(cpu, fcntl.LOCK_EX | fcntl.LOCK_NB)  # released after the step
    os.close(fd)


def test_a_waiting_benchmark_stops_the_next_step_until_it_is_done(tmp_path):
    gate, cpu = tmp_path / "gate", tmp_path / "cpu"
    bench_gate = _locked(gate, fcntl.LOCK_EX)  # kv-bench holds the gate while it runs
    turn, entered = CpuTurn(True, gate, cpu), threading.Event()

    def step():
        with turn:
            entered.set()

    worker = threading.Thread(target=step)
    worker.start()
    assert not entered.wait(0.3), "the step ran while a benchmark held the gate"
    os.close(bench_gate)  # the benchmark ends
    worker.join(10)
    assert entered.is_set() and turn.waited_s > 0


def test_disabled_turn_takes_no_lock(tmp_path):
    with CpuTurn(False, tmp_path / "gate", tmp_path / "cpu"):
        pass
    assert not (tmp_path / "gate").exists()


def test_mix_rows_per_stream():
    assert parse_mix(None, 8) == {"code": 4, "prose": 4}
    assert parse_mix("code:2,prose:2,sft:4", 8) == {"code": 2, "prose": 2, "sft": 4}
    assert parse_mix("code:3,prose:5,sft:0", 8) == {"code": 3, "prose": 5}
    with pytest.raises(ValueError, match="sum"):
        parse_mix("code:3,prose:3", 8)
    streams = {"a": np.zeros(100, np.uint16), "b": np.ones(100, np.uint16)}
    batch = BatchSampler(streams, {"a": 1, "b": 3}, 16, seed=0).next()
    assert batch.shape == (4, 17) and batch[0].max() == 0 and batch[1:].min() == 1


def test_a_run_ended_by_its_goal_or_budget_is_finished(tmp_path):
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "config.json").write_text("{}")
    log = tmp_path / "train.log"
    log.write_text(json.dumps({"event": "done", "step": 120, "reason": "steps"}) + "\n")
    assert finished_step(tmp_path) == 120
    log.write_text(json.dumps({"event": "done", "step": 90, "reason": "goal"}) + "\n")
    assert finished_step(tmp_path) >= 10**9


def test_instruction_pairs():
    assert third_person("return") == "returns" and third_person("copy") == "copies"
    assert third_person("match") == "matches"
    assert (
        task_from_docstring("Return the sum of a and b.\n\nMore.") == "returns the sum of a and b"
    )
    assert task_from_docstring("The sum of a and b.") is None
    text = render({"user": "Hi?", "assistant": "def f(): pass"})
    assert text == "<|bos|><|user|>\nHi?<|end|>\n<|assistant|>\ndef f(): pass<|end|>\n"
