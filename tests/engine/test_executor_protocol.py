"""Every executor offers ExecutorVerbs with the same signatures."""
import inspect

import pytest

from triton_backend.engine.executor import Executor
from triton_backend.engine.executor_protocol import ExecutorVerbs
from triton_backend.engine.process.executor import ProcessExecutor
from triton_backend.naive.executor import NaiveExecutor

VERBS = [name for name, member in vars(ExecutorVerbs).items()
         if inspect.isfunction(member) and not name.startswith("_")]


def test_the_protocol_has_the_verbs():
    assert set(VERBS) == {"enqueue_request", "cancel_request", "await_responses", "is_alive",
                          "get_stats", "shutdown"}


@pytest.mark.parametrize("executor", [Executor, ProcessExecutor, NaiveExecutor])
@pytest.mark.parametrize("verb", VERBS)
def test_each_executor_has_each_verb_with_the_protocols_signature(executor, verb):
    assert inspect.signature(getattr(executor, verb)) == \
        inspect.signature(getattr(ExecutorVerbs, verb)), f"{executor.__name__}.{verb}"
