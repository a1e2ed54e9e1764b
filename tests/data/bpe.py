"""A small byte-level BPE tokenizer folder for chat-format tests: tokenizer.json trained on
a few texts with the given special tokens, and a tokenizer_config.json."""

import json


def write_folder(path, specials, texts, config, vocab_size=360):
  """Writes tokenizer.json (byte-level BPE of `vocab_size`, `specials` added) and
  tokenizer_config.json (`config`) into the folder `path`."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE(unk_token=None))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(list(texts) * 20, trainer)
  tok.decoder = decoders.ByteLevel()
  tok.save(str(path / "tokenizer.json"))
  (path / "tokenizer_config.json").write_text(json.dumps(config))
