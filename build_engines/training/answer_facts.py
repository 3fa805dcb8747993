"""What a reply to a request must contain, and which facts are held out for evaluating it.

The adapters are fine-tuned on request -> answer pairs (`answer_pairs`) and judged on held-out requests by one
question: does the reply contain the request's key fact? This module fixes, per domain, what the key fact is and
how facts are split so that no fact of an evaluation request is ever trained on:

- agent: the key is the option (`-r`, `--recursive`) when the request names one, else the command; code: the
  function or class name; design: the CSS property; chat: a content word of the user's utterance (a reply that
  relates to it picks up what it is about; movie dialogue does this constantly).
- A key string (an option, a command, a function name, a property) is *held out* when a seeded hash of it falls
  under `HELDOUT_SHARE`: a property such as `border-radius`, once held out, appears in no training pair of any
  stylesheet. Evaluation requests come from the corpora's **test** documents and only from facts whose key is
  held out; training pairs come from the **train** documents and only from facts none of whose keys is held out.
  So an evaluation reply can hit its key only by relating to the request, never by recalling a trained fact.
- Chat: evaluation utterances come from test dialogues; a training pair whose utterance or reply equals one of
  them (case and spacing ignored) is dropped.
"""

from __future__ import annotations

import hashlib
import re

from build_engines.routing.request_facts import Fact

HELDOUT_SHARE = 0.25
# Fields that identify a fact, per domain: a training fact is dropped when any of them is held out.
IDENTITY_FIELDS: dict[str, tuple[str, ...]] = {"agent": ("cmd", "option", "option2"), "code": ("name",),
                                               "design": ("property",)}
# Common English words that say nothing about what an utterance is about (the chat key is any other word).
_STOPWORDS = frozenset("""
about above after again against also always another anything around because been before being below between
both cannot could didn does doing done down during each else even ever every from gonna gotta have having here
hers herself himself into itself just know like made make many maybe more most much must myself never nothing
once only other ought ours ourselves over really right same said says should some something still such sure take
tell than that thats their theirs them themselves then there these they thing things think this those though
through time told under until upon very want wanna well were what whats when where which while will with without
would yeah your yours yourself yourselves okay good going come came back away look little where's what's that's
there's don't didn't can't won't it's i'm you're they're we're he's she's i've you've i'll you'll i'd you'd isn't
wasn't aren't doesn't haven't let's
""".split())
_WORD = re.compile(r"[a-z][a-z']{3,}")


def is_heldout(key: str, seed: int, kind: str) -> bool:
    """Whether `key` (an option, command, function name or property of domain `kind`) is held out: a seeded hash,
    independent of corpus order, so the same key is held out in every document and every run."""
    digest = hashlib.sha256(f"{seed}:answers:{kind}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < HELDOUT_SHARE


def key_field(kind: str, template_fields: set[str]) -> str:
    """The fact field whose value the reply must contain, for a request built from a template with these fields."""
    if kind == "agent":
        return "option" if "option" in template_fields else "cmd"
    return {"code": "name", "design": "property", "chat": "utterance"}[kind]


def trainable(kind: str, fact: Fact, seed: int) -> bool:
    """A training fact may be used only when none of its identifying keys is held out."""
    return not any(fact.get(f) and is_heldout(fact[f], seed, kind) for f in IDENTITY_FIELDS.get(kind, ()))


def content_words(text: str) -> list[str]:
    """The words of an utterance that say what it is about (lower case, 4+ letters, not a stopword), in order."""
    out: list[str] = []
    for word in _WORD.findall(text.lower()):
        word = word.strip("'")
        if len(word) >= 4 and word not in _STOPWORDS and word not in out:
            out.append(word)
    return out


def key_hit(kind: str, key: str, reply: str) -> bool:
    """Whether `reply` contains the key: an identifier as a whole token (so `-s` is not found in `--size`, nor
    `top` in `top-level`), case-sensitive; for chat, any of the key's content words (`key` is the utterance)."""
    if kind == "chat":
        words = set(content_words(reply))
        return any(w in words for w in content_words(key))
    pattern = r"(?<![A-Za-z0-9_\-])" + re.escape(key) + r"(?![A-Za-z0-9_\-])"
    return re.search(pattern, reply) is not None


def normalised(text: str) -> str:
    """Lower case, single spaces: how chat utterances are compared across splits."""
    return " ".join(text.lower().split())


_SPEAKER = re.compile(r"^[A-Z]:\s*")


ECHO_WITHIN = 4  # a chat reply relates to the utterance when one of its first words picks up a content word of it


def dialogue_pairs(doc_id: str, text: str) -> list[Fact]:
    """(utterance, reply) facts of a movie-dialogue document: each line and the next line of the same exchange
    (exchanges are blank-line separated), utterance 4-30 words, reply 2-30 words, and the reply picking up a content
    word of the utterance within its first `ECHO_WITHIN` words ("landon! send a last signal." -> "what signal?"):
    the replies we want the chat adapter to learn are the ones that relate to what was said, and a reply that
    relates early is one a 48-token answer can show."""
    facts: list[Fact] = []
    for block in text.split("\n\n"):
        lines = [_SPEAKER.sub("", ln).strip() for ln in block.splitlines() if ln.strip()]
        for said, reply in zip(lines, lines[1:]):
            if not (4 <= len(said.split()) <= 30 and 2 <= len(reply.split()) <= 30):
                continue
            opening = content_words(" ".join(reply.split()[:ECHO_WITHIN]))
            if sum(ch.isalpha() for ch in said) < 12 or not set(content_words(said)) & set(opening):
                continue
            facts.append({"utterance": said, "reply": reply, "doc": doc_id})
    return facts
