"""Host-side rollout workers: tasks -> prompts -> samples -> rewards -> trajectories."""

from posttrain.rollout.worker import RolloutWorker, Sample, TrajectoryGroup, group_to_trajectories

__all__ = ["RolloutWorker", "Sample", "TrajectoryGroup", "group_to_trajectories"]
