"""Option domains: requests of domains that are no adapter, so the router head learns to read descriptions.

Why: a head trained only on items whose options are the four bundled adapter descriptions learns those four
descriptions by heart; beside them a fifth adapter registered later (with its description only, through
`adapter_admin`) never wins (measured: 0% of its own requests, docs/routing_zero_shot.md). Zero-shot routing needs
training items whose option sets vary, so that the only way to be right is to match the request against what each
option says:

- `build_option_items`: requests about other domains (classic novels, news stories, films, products), built from the
  prepared data like the adapter requests (seeded, many phrasings), whose options are the four adapter descriptions
  plus that domain's description (one of several wordings) and sometimes other option domains' descriptions; the
  answer is the option domain. Train items come from the sources' train splits, the `option_benchmark` items (a
  report of the head on them, never trained on) from their test splits.
- `vary_options`: the adapter-routing and request-routing train items again, with 0-3 option-domain descriptions
  added beside the four adapters (the answer unchanged).

None of these domains, descriptions or phrasings is the zero-shot test domain (Shakespeare's plays, `requests.
zero_shot_requests`): the plays are not read here, and no description names plays, drama or verse.
"""

from __future__ import annotations

import collections
import random
import re
from pathlib import Path
from typing import Any

from build_engines.data.corpora import reader

OPTION_TASK = "option_routing"
OPTION_BENCHMARK_TASK = "option_benchmark"
OPTION_TASKS = (OPTION_TASK, OPTION_BENCHMARK_TASK)
DEFAULT_OPTION_TRAIN_PER_DOMAIN = 600
DEFAULT_OPTION_BENCH_PER_DOMAIN = 100
VARIED_TASKS = ("adapter_routing", "request_routing")  # train tasks whose option sets `vary_options` widens
EXTRA_OPTIONS = (0, 1, 1, 2, 3)  # how many option-domain descriptions `vary_options` adds (drawn per item)

# Several wordings per domain: the head must match meaning, not one string.
OPTION_DOMAINS: dict[str, tuple[str, ...]] = {
    "novels": (
        "discusses classic novels: their characters, chapters, plots, famous passages and the authors' prose",
        "talks about nineteenth-century fiction: novels, heroes and heroines, storylines and literary style",
        "explains literature: who the characters of a novel are, what happens in each chapter, what a passage means",
    ),
    "news": (
        "reports and summarises news stories: business, politics, sport, entertainment and technology",
        "answers questions about current events and headlines in the news",
    ),
    "films": (
        "reviews films and discusses movies: actors, plots, directors and critics' verdicts",
        "gives opinions on cinema: whether a movie is worth watching, its performances and story",
    ),
    "products": (
        "reviews products and purchases: quality, price, delivery and whether to buy",
        "helps with shopping: compares products and summarises customer reviews",
    ),
}

# (source kind, source name, label filter) per domain: a corpus read chapter by chapter, or a labelled set's rows.
_SOURCES = {"novels": ("corpus", "novels", None), "news": ("labelled", "bbc_topic", None),
            "films": ("labelled", "vader_domain", "movie"), "products": ("labelled", "vader_domain", "amazon")}

_BOOKS = {
    "austen-emma": ("Emma", "Jane Austen"), "austen-prideprejudice": ("Pride and Prejudice", "Jane Austen"),
    "austen-sensesensibility": ("Sense and Sensibility", "Jane Austen"),
    "austen-persuasion": ("Persuasion", "Jane Austen"),
    "austen-mansfieldpark": ("Mansfield Park", "Jane Austen"),
    "austen-northangerabbey": ("Northanger Abbey", "Jane Austen"),
    "moby-dick": ("Moby Dick", "Herman Melville"), "great-expectations": ("Great Expectations", "Charles Dickens"),
    "twenty-thousand-leagues-under-the-sea": ("Twenty Thousand Leagues under the Sea", "Jules Verne"),
    "the-war-of-the-worlds": ("The War of the Worlds", "H. G. Wells"),
}

_PHRASINGS: dict[str, tuple[str, ...]] = {
    "novels": (
        "Who is {character} in {book}?", "Tell me about the character {character} from {book}.",
        "What happens to {character} in {book}?", "Summarise chapter {chapter} of {book}.", "What is {book} about?",
        "Explain this passage from {book}: \"{sentence}\"", "What does {character} mean when saying \"{sentence}\"",
        "Rewrite in plain English: \"{sentence}\"", "Who wrote {book}, and what is it about?",
        "Describe the relationship between {character} and {other} in {book}.",
        "Write a paragraph in the style of {author}.",
        "Quote a memorable line from {book}.", "Why does {character} matter to the story of {book}?",
        "Continue this passage from {book}: \"{sentence}\"",
    ),
    "news": ("Summarise this news story: {text}", "What's the latest on this: {text}?",
             "Tell me more about the headline \"{text}\"", "Is this true: {text}?", "Explain the news that {text}"),
    "films": ("Is this film review positive or negative? \"{text}\"", "What do you make of this movie review: {text}",
              "Would you watch a film described like this: {text}", "Give me your verdict on this film: {text}"),
    "products": ("Is this product review favourable? \"{text}\"", "Should I buy this, judging by the review: {text}",
                 "Summarise this customer review: {text}"),
}
_OPENERS = ("", "Hi, ", "Please, ", "Quick question: ", "Hey. ")
_NOT_NAMES = {"Mrs", "Miss", "The", "And", "But", "Chapter", "CHAPTER"}
_HEADLINE_WORDS = 25


def _chapter_slots(doc_id: str, text: str) -> dict[str, Any] | None:
    """What a request about one novel chapter can name: book, author, chapter number, its most frequent names
    (capitalised words never written in lower case in the chapter) and sentences of 6-22 words."""
    book = doc_id.split("/")[0]
    if book not in _BOOKS:
        return None
    lower = set(re.findall(r"\b[a-z]{3,}\b", text))
    names = collections.Counter(w for w in re.findall(r"\b[A-Z][a-z]{2,}\b", text)
                                if w.lower() not in lower and w not in _NOT_NAMES)
    characters = [w for w, k in names.most_common(6) if k >= 2]
    sentences = [" ".join(s.split()) for s in re.split(r"(?<=[.!?])\s+", text) if 6 <= len(s.split()) <= 22]
    if not characters or not sentences:
        return None
    title, author = _BOOKS[book]
    chapter = int(re.sub(r"\D", "", doc_id.split("/")[-1]) or 1)
    return {"book": title, "author": author, "chapter": chapter, "characters": characters, "sentences": sentences}


def _novel_requests(data_dir: Path, split: str, n: int, rng: random.Random) -> list[str]:
    out = []
    for record in reader.iter_records(data_dir, "novels", split):
        slots = _chapter_slots(record["doc_id"], record["text"])
        if slots is None:
            continue
        for _ in range(4):
            character = rng.choice(slots["characters"])
            other = rng.choice([c for c in slots["characters"] if c != character] or slots["characters"])
            phrase = rng.choice(_PHRASINGS["novels"]).format(
                character=character, other=other, book=slots["book"], author=slots["author"], chapter=slots["chapter"],
                sentence=rng.choice(slots["sentences"]))
            out.append(rng.choice(_OPENERS) + phrase)
    rng.shuffle(out)
    return out[:n]


def _labelled_requests(data_dir: Path, domain: str, split: str, n: int, rng: random.Random) -> list[str]:
    _, name, label = _SOURCES[domain]
    rows = [r for r in reader.load_labelled(data_dir, name)
            if r["split"] == split and (label is None or r["label"] == label)]
    rng.shuffle(rows)
    out = []
    for row in rows[:n]:
        text = " ".join(row["text"].strip().split("\n")[0].split()[:_HEADLINE_WORDS])
        if text:
            out.append(rng.choice(_OPENERS) + rng.choice(_PHRASINGS[domain]).format(text=text))
    return out


def prepared_domains(data_dir: str | Path) -> list[str]:
    """The option domains whose source is prepared in `data_dir` (a domain without one is left out, not an error:
    these items widen the head's training, they are not what it routes to)."""
    manifest = reader.load_manifest(data_dir)
    return [d for d, (kind, name, _) in _SOURCES.items()
            if name in manifest.get("sources" if kind == "corpus" else "labelled", {})]


def domain_requests(data_dir: str | Path, domain: str, split: str, n: int, seed: int) -> list[str]:
    """`n` (or fewer, when the split runs out) seeded requests about one option domain from one split."""
    rng = random.Random(f"{seed}:option:{domain}:{split}")
    if _SOURCES[domain][0] == "corpus":
        return _novel_requests(Path(data_dir), split, n, rng)
    return _labelled_requests(Path(data_dir), domain, split, n, rng)


def _with_options(adapter_descriptions: list[str], answer: str, extra: list[str],
                  rng: random.Random) -> tuple[list[str], int]:
    options = list(adapter_descriptions) + ([answer] if answer not in adapter_descriptions else []) + extra
    rng.shuffle(options)
    return options, options.index(answer)


def build_option_items(data_dir: str | Path, adapter_descriptions: dict[str, str], seed: int = 0,
                       train_per_domain: int = DEFAULT_OPTION_TRAIN_PER_DOMAIN,
                       bench_per_domain: int = DEFAULT_OPTION_BENCH_PER_DOMAIN) -> list[dict[str, Any]]:
    """Option-domain items: train split -> `option_routing`, test split -> `option_benchmark` (see the module doc).
    Each offers the four adapters, the domain's description (one wording, drawn) and 0-2 other domains'."""
    adapters = list(adapter_descriptions.values())
    domains = prepared_domains(data_dir)
    items: list[dict[str, Any]] = []
    for split, task, n in (("train", OPTION_TASK, train_per_domain), ("test", OPTION_BENCHMARK_TASK, bench_per_domain)):
        for domain in domains:
            rng = random.Random(f"{seed}:option-items:{domain}:{split}")
            for i, query in enumerate(domain_requests(data_dir, domain, split, n, seed)):
                answer = rng.choice(OPTION_DOMAINS[domain])
                others = [rng.choice(d) for name, d in OPTION_DOMAINS.items() if name != domain]
                options, index = _with_options(adapters, answer, rng.sample(others, rng.choice((0, 0, 1, 2))), rng)
                items.append({"id": f"{task}:{domain}:{i:05d}", "task": task, "query": query, "options": options,
                              "answer": index, "split": split, "label": domain})
    return items


def vary_options(items: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """The items of `VARIED_TASKS` with 0-3 (`EXTRA_OPTIONS`) option-domain descriptions (one wording per domain) added
    to their options, the answer re-indexed to the same description; other items unchanged. Seeded per item id."""
    out = []
    for item in items:
        if item["task"] not in VARIED_TASKS:
            out.append(item)
            continue
        rng = random.Random(f"{seed}:vary:{item['id']}")
        answer = item["options"][item["answer"]]
        extra = rng.sample([rng.choice(d) for d in OPTION_DOMAINS.values()], rng.choice(EXTRA_OPTIONS))
        options, index = _with_options(item["options"], answer, extra, rng)
        out.append({**item, "options": options, "answer": index})
    return out


def manifest_record(items: list[dict[str, Any]], seed: int, train_per_domain: int,
                    bench_per_domain: int) -> dict[str, Any]:
    """How the option items were made, for the routing data manifest."""
    counts: dict[str, dict[str, int]] = collections.defaultdict(dict)
    for item in items:
        counts[item["task"]][item["label"]] = counts[item["task"]].get(item["label"], 0) + 1
    return {"seed": seed, "train_per_domain": train_per_domain, "bench_per_domain": bench_per_domain,
            "sources": {d: {"kind": k, "name": n, "label": lab, "train_split": "train", "benchmark_split": "test"}
                        for d, (k, n, lab) in _SOURCES.items()},
            "descriptions": {d: list(v) for d, v in OPTION_DOMAINS.items()},
            "phrasings": {d: list(v) for d, v in _PHRASINGS.items()}, "openers": list(_OPENERS), "counts": dict(counts)}
