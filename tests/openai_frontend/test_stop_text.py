"""Stop strings cut from a streamed reply, whatever the piece boundaries."""

from __future__ import annotations

import random

import pytest

from openai_frontend.stop_text import StopText


def _stream(text: str, stops: tuple[str, ...], cuts: list[int]) -> str:
    st = StopText(stops)
    bounds = [0, *sorted(cuts), len(text)]
    out = "".join(st.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    return out + st.flush()


@pytest.mark.parametrize("text,stops,want", [
    (", you're a little.", ("a l",), ", you're "),
    ("abc</s>def", ("</s>",), "abc"),
    ("no stop here", ("zz",), "no stop here"),
    ("aaab", ("ab", "aab"), "a"),
    ("tail a", ("a l",), "tail a"),  # a held tail that never becomes a stop string comes out at the end
    ("plain", (), "plain"),
])
def test_stop_text_matches_the_text_before_the_first_stop_for_any_split(text: str, stops: tuple[str, ...], want: str,
                                                                        seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(50):
        cuts = rng.sample(range(1, len(text)), rng.randint(0, len(text) - 1)) if len(text) > 1 else []
        assert _stream(text, stops, cuts) == want, cuts
