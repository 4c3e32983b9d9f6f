"""engine.background: one piece of work on a daemon thread beside the main one."""

import threading

import pytest

from classify.engine.background import Background


def test_the_work_runs_beside_the_caller_and_its_value_comes_back():
    asked = threading.Event()

    def work():
        assert asked.wait(timeout=30)       # only the caller, still running, can set it
        return threading.current_thread().name, threading.current_thread().daemon

    job = Background(work, "n-gram-teacher")
    asked.set()
    assert job.result() == ("n-gram-teacher", True)


def test_an_error_of_the_work_is_raised_where_the_result_is_asked_for():
    def work():
        raise ValueError("liblinear failed")

    job = Background(work, "failing")
    with pytest.raises(ValueError, match="liblinear failed"):
        job.result()
