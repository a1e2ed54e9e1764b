"""posttrain: JAX-native post-training for Llama/Qwen-class models.

Importing this package is cheap: it initialises no devices and imports no submodules.
"""

__version__ = "0.1.0"
