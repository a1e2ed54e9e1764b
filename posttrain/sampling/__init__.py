"""posttrain.sampling."""
