"""The trainer's canary scores (trainer/rl/parity.py): written at gate steps only, each token's logprob given
its prefix under the trainer's weights, as the servers' prompt logprobs report them."""

import json

import pytest
import torch

from prime_rl.configs.trainer import TrainerConfig
from prime_rl.protocol.parity import read_trainer_scores, trainer_scores_file, write_canaries
from prime_rl.trainer.errors import TrainerError
from prime_rl.trainer.model import build_model
from prime_rl.trainer.rl.parity import score_canaries


def test_gate_steps_get_the_trainers_logprobs_of_every_canary_token(tiny_model, tmp_path):
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, parity={"interval": 2})
    model = build_model(str(tiny_model))
    ids = [5, 9, 2, 7, 11]
    write_canaries(tmp_path, [{"env": "a", "token_ids": ids, "scored": [False, False, True, True, True]}])
    for step in (1, 2, 3):
        score_canaries(config, model, torch.device("cpu"), step, main=True)
    assert not trainer_scores_file(tmp_path, 1).exists() and not trainer_scores_file(tmp_path, 3).exists()
    [got] = read_trainer_scores(tmp_path, 2)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    expected = [0.0] + [torch.log_softmax(logits[t - 1], -1)[ids[t]].item() for t in range(1, len(ids))]
    assert got[0] == 0.0 and max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-5
    assert model.training  # put back as it was
    assert json.loads(trainer_scores_file(tmp_path, 2).read_text())["step"] == 2


def test_a_canary_outside_the_vocabulary_is_a_trainer_error_naming_the_file(tiny_model, tmp_path):
    """canary.json is read from the shared output dir: an id past the vocabulary was an embedding IndexError
    traceback here, and would be a device-side assert on CUDA."""
    config = TrainerConfig(model={"name": str(tiny_model)}, output_dir=tmp_path, parity={"interval": 1})
    model = build_model(str(tiny_model))
    vocab = model.get_input_embeddings().num_embeddings
    write_canaries(tmp_path, [{"env": "a", "token_ids": [5, vocab + 3, 2], "scored": [False, True, True]}])
    with pytest.raises(
        TrainerError, match=rf"canary.json: token ids outside the model's vocabulary \[0, {vocab}\): \[{vocab + 3}\]"
    ):
        score_canaries(config, model, torch.device("cpu"), 1, main=True)
    assert not trainer_scores_file(tmp_path, 1).exists()
