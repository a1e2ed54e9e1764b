"""One model and one sampler for the whole folder, so compiled programs are shared."""

import pytest

from posttrain import models
from posttrain.sampling import Sampler
from sampling_refs import CFG, MAX_LEN


@pytest.fixture(scope="session")
def model():
  return models.create_model(CFG, seed=0)


@pytest.fixture(scope="session")
def sampler(model):
  return Sampler(model, max_len=MAX_LEN)
