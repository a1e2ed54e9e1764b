"""posttrain.sandbox."""
