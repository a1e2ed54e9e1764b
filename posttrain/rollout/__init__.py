"""Host-side rollout workers: tasks -> prompts -> samples -> rewards -> trajectories."""

from posttrain.rollout.worker import (FairLock, RolloutWorker, Sample, TrajectoryGroup,
                                      group_to_trajectories, task_messages)

__all__ = ["FairLock", "RolloutWorker", "Sample", "TrajectoryGroup",
           "group_to_trajectories", "task_messages"]
