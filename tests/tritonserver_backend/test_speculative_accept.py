"""Accepting a verified speculative block (tritonserver_backend/sampling/speculative.py).

What must hold: under greedy decoding the emitted tokens are exactly the tokens the turn's own sampler chooses one
position at a time (penalties that read the reply so far included), wherever the drafts go wrong; under sampling,
each emitted token is distributed as the sampler's own draw, whatever the drafter proposed (here: the first token's
frequencies over many seeded blocks against the sampler's distribution, with a one-hot and a diffuse drafter).
"""

from __future__ import annotations

import pytest
import torch

from tritonserver_backend.sampling.sampler import Sampler, SamplingParams
from tritonserver_backend.sampling.speculative import accept_block


def _plain(sampler: Sampler, logits: torch.Tensor, generated: list[int]) -> list[int]:
    """One token per position, each chosen after the previous one: what decoding without drafts emits."""
    out: list[int] = []
    for row in logits:
        out.append(sampler(row, generated + out))
    return out


@pytest.mark.parametrize("penalty", [1.0, 1.3])
def test_greedy_keeps_drafts_exactly_while_they_are_the_samplers_choices(penalty: float) -> None:
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(repetition_penalty=penalty)
    for trial in range(40):
        logits = torch.randn(5, 12, generator=generator) * 3
        generated = torch.randint(0, 12, (6,), generator=generator).tolist()
        plain = _plain(Sampler(params), logits, generated)
        for wrong_at in range(5):  # drafts right up to wrong_at, then wrong (wrong_at 4: every draft right)
            drafts = plain[:4]
            if wrong_at < 4:
                drafts = drafts[:wrong_at] + [(plain[wrong_at] + 1) % 12] + drafts[wrong_at + 1:]
            got = accept_block(Sampler(params), logits, drafts, generated)
            assert got == plain[:wrong_at + 1], (trial, wrong_at, got, plain)


def test_a_block_of_no_drafts_is_one_plain_step() -> None:
    logits = torch.randn(1, 9)
    assert accept_block(Sampler(SamplingParams()), logits, [], []) == [int(logits[0].argmax())]


def test_shapes_are_checked() -> None:
    with pytest.raises(ValueError, match="verified by 3 rows"):
        accept_block(Sampler(SamplingParams()), torch.zeros(2, 5), [1, 2], [])
    with pytest.raises(ValueError, match="draft_probs has 1 rows"):
        accept_block(Sampler(SamplingParams(temperature=1.0)), torch.zeros(3, 5), [1, 2], [], torch.ones(1, 5) / 5)


@pytest.mark.parametrize("drafter", ["one-hot", "diffuse"])
def test_sampling_emits_the_targets_distribution_whatever_the_drafts(drafter: str) -> None:
    vocab, trials = 6, 12000
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [1.0] * 6])
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=0)
    target = Sampler(params).probabilities(Sampler(params).shaped(logits[0], []))
    q = torch.tensor([0.05, 0.05, 0.1, 0.5, 0.2, 0.1])  # a drafter that favours a token the target rarely picks
    draw = torch.Generator().manual_seed(1)
    counts = torch.zeros(vocab)
    kept = 0
    for t in range(trials):
        sampler = Sampler(SamplingParams(temperature=0.8, top_p=0.95, seed=t))
        if drafter == "one-hot":
            drafts, probs = [3, 1], None
        else:
            drafts = torch.multinomial(q, 2, replacement=True, generator=draw).tolist()
            probs = q.expand(2, vocab)
        out = accept_block(sampler, logits, drafts, [], probs)
        assert 1 <= len(out) <= 3
        counts[out[0]] += 1
        kept += out[0] == drafts[0]
    frequencies = counts / trials
    # 4.5 standard deviations of a frequency at these counts: a wrong rule (keeping drafts as they come, or
    # resampling from p instead of the residual) is off by 0.05 or more
    assert torch.allclose(frequencies, target, atol=4.5 * (0.25 / trials) ** 0.5), (frequencies, target)
    assert 0 < kept < trials  # drafts were both kept and corrected


def test_sampled_blocks_of_a_one_hot_drafter_are_the_plain_draws() -> None:
    """At temperature > 0 a drafter of single tokens (DSpark drafts greedily, prompt lookup copies) is checked against
    the turn's own draws: a seeded sampler emits, through a block, exactly the tokens it emits one step at a time."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 0.3], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6],
                           [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]])
    params = dict(temperature=0.9, top_k=5, repetition_penalty=1.2)
    lengths = set()
    for seed in range(200):
        out = accept_block(Sampler(SamplingParams(seed=seed, **params)), logits, [0, 5], [4])
        plain, history = Sampler(SamplingParams(seed=seed, **params)), [4]
        for i, token in enumerate(out):
            assert token == plain(logits[i], history)
            history.append(token)
        lengths.add(len(out))
    assert lengths == {1, 2, 3}  # blocks cut at the first and second draft, and fully kept
