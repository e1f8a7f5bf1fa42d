"""The ingress asks the engines for their model limits once, and asks again when that failed.

A permanent answer of "failed" would be a replica that serves 500s for ever: the question is one
task shared by every request, so a cancelled or failed one must not be kept.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from meshserve.deploy.ingress import OpenAIIngress


class _Engines:
    """Answers ``info`` calls as a Serve handle would, one behaviour per call."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)
        self.asked = 0
        self.handle = SimpleNamespace(info=SimpleNamespace(remote=self._remote))

    def _remote(self) -> asyncio.Future:
        self.asked += 1
        future = asyncio.get_running_loop().create_future()
        answer = self.answers.pop(0)
        if answer == "cancelled":
            future.cancel()
        elif isinstance(answer, Exception):
            future.set_exception(answer)
        else:
            future.set_result(answer)
        return future


class _Unserved(OpenAIIngress.func_or_class):
    """The ingress class outside Serve, which awaits the async ``__del__`` when it stops a
    replica: here nothing would, and Python would warn of the coroutine it made."""

    def __del__(self) -> None:
        pass


def _ingress(engines: _Engines) -> OpenAIIngress:
    ingress = object.__new__(_Unserved)
    ingress.engine = engines
    ingress._info_task = None
    ingress._info_asked_at = 0.0
    return ingress


def test_a_cancelled_question_is_asked_again() -> None:
    async def scenario() -> tuple:
        engines = _Engines("cancelled", "limits")
        ingress = _ingress(engines)
        return await ingress._loaded(0.1), await ingress._loaded(0.1), engines.asked

    assert asyncio.run(scenario()) == (None, "limits", 2)


def test_a_failed_question_is_asked_again_and_an_answer_is_kept() -> None:
    async def scenario() -> tuple:
        engines = _Engines(RuntimeError("no replica yet"), "limits")
        ingress = _ingress(engines)
        answers = [await ingress._loaded(0.1) for _ in range(3)]
        return answers, engines.asked

    assert asyncio.run(scenario()) == ([None, "limits", "limits"], 2)
