"""A verifiers taskset whose only reward reads the task's runtime (a sandbox): a team's turn cannot score it."""

import verifiers.v1 as vf

__all__ = ["BoxTaskset"]


class BoxTask(vf.Task[vf.TaskData]):
    @vf.reward(weight=1.0)
    async def file_written(self, trace: vf.Trace, runtime) -> float:
        return 1.0


class BoxTaskset(vf.Taskset[BoxTask, vf.TasksetConfig]):
    def load(self) -> list[BoxTask]:
        return [BoxTask(vf.TaskData(prompt="write a file"), self.config.task)]
