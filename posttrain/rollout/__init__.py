"""posttrain.rollout."""
