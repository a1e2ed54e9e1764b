"""Tokenizers, chat templates and data pipelines."""

from posttrain.data.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "Tokenizer", "load_tokenizer"]
