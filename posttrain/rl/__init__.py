"""posttrain.rl."""
