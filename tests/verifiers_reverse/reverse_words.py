"""A taskset written in verifiers' own format (verifiers 0.4's ``vf.Taskset`` and ``@vf.reward``), as a verifiers
user ships one: a package exporting its ``Taskset`` in ``__all__``, whose id verifiers' loader imports. Its task:
reverse a short word; its reward: the reply, stripped, is the word reversed. tests/test_verifiers_tasks.py runs it as
the solver's role of a team (environments/verifiers_tasks.py)."""

import verifiers.v1 as vf

__all__ = ["ReverseTaskset"]

WORDS = ("cat", "dog", "sun", "map", "pen", "cup", "owl", "ant", "bee", "fox")


class ReverseData(vf.TaskData):
    word: str
    answer: str
    """The word reversed: what the reward pays for."""


class ReverseTask(vf.Task[ReverseData]):
    @vf.reward(weight=1.0)
    async def reversed_exactly(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.word[::-1])


class ReverseConfig(vf.TasksetConfig):
    num_tasks: int = 20
    """How many tasks to build."""


class ReverseTaskset(vf.Taskset[ReverseTask, ReverseConfig]):
    def load(self) -> list[ReverseTask]:
        words = [WORDS[i % len(WORDS)] for i in range(self.config.num_tasks)]
        return [ReverseTask(ReverseData(id=f"reverse-{i}", prompt=f"reverse {word}:", word=word, answer=word[::-1]),
                            self.config.task) for i, word in enumerate(words)]
