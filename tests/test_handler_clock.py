"""The train handler's ``cpu-seconds`` counts the silo's work, not the threads of the process
around it (a warm silo's handler runs inside its SuperNode)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dpcfl_flwr.client_app import handler_cpu_clock


@pytest.fixture
def torch_threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def test_with_one_torch_thread_a_busy_neighbour_thread_is_not_counted(torch_threads):
    torch_threads(1)
    clock = handler_cpu_clock()
    assert clock is time.thread_time
    stop = threading.Event()

    def spin() -> None:  # the SuperNode's threads, at their busiest
        while not stop.is_set():
            pass

    neighbour = threading.Thread(target=spin)
    process_before, started = time.process_time(), clock()
    neighbour.start()
    time.sleep(0.3)
    stop.set()
    neighbour.join()
    assert clock() - started < 0.05
    assert time.process_time() - process_before > 0.1  # what the process clock would count


def test_with_several_torch_threads_the_whole_process_is_counted(torch_threads):
    torch_threads(2)  # torch's own workers compute part of the handler's work
    assert handler_cpu_clock() is time.process_time
