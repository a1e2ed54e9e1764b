"""posttrain.tasks."""
