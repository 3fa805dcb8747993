"""Repetition, frequency and presence penalties of the sampler (what the OpenAI frontend passes through)."""

from __future__ import annotations

import pytest
import torch

from tritonserver_backend.errors import BadRequest
from tritonserver_backend.sampling.sampler import Sampler, SamplingParams, penalise


def test_penalties_follow_their_definitions() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0])
    generated = [0, 0, 1, 3]
    out = penalise(logits, generated,
                   SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0))
    assert torch.allclose(out,
                          torch.tensor([2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 0.5, 3.0 / 2 - 0.5 - 0.25]))
    assert torch.equal(logits, torch.tensor([2.0, -1.0, 0.5, 3.0])), "the engine's logits stay untouched"


def test_a_penalty_moves_the_greedy_choice_off_a_repeated_token() -> None:
    logits = torch.tensor([1.0, 0.9, 0.0])
    assert Sampler(SamplingParams())(logits, [0, 0]) == 0
    assert Sampler(SamplingParams(presence_penalty=0.2))(logits, [0, 0]) == 1
    assert Sampler(SamplingParams(frequency_penalty=0.1))(logits, [0, 0]) == 1
    assert Sampler(SamplingParams(repetition_penalty=1.2))(logits, [0]) == 1
    assert Sampler(SamplingParams(presence_penalty=2.0))(logits, []) == 0, "nothing generated yet: nothing to penalise"


@pytest.mark.parametrize("kwargs", [dict(frequency_penalty=2.5), dict(presence_penalty=-3.0),
                                    dict(repetition_penalty=0.0), dict(repetition_penalty=11.0)])
def test_out_of_range_penalties_are_bad_requests(kwargs: dict) -> None:
    with pytest.raises(BadRequest):
        SamplingParams(**kwargs)
