"""Pick-one routing items for the MoL2 pointer router: a user turn, natural-language options, the right one's index.

Command line: `python -m build_engines.routing.data --data artifacts/data --out artifacts/routing [--seed 0]`.

Files built deterministically from the prepared data (read only through `corpora.reader`); `requests.jsonl` (see
`requests`) and `options.jsonl` (see `option_domains`) come from their own modules, and:
- `generic.jsonl`: one item per row of every prepared labelled set (BBC topic, TREC coarse/fine, VADER sentiment and
  collection, SMS spam). The options are that task's labels written as descriptions (`LABEL_DESCRIPTIONS`); TREC
  fine draws a random candidate subset of 2..50 labels (always holding the answer) so that the router sees many
  candidate-set sizes. Each row keeps its split (train/val/test) from the labelled file.
- `adapter.jsonl`: user-turn-like snippets of the four adapter domains (one dialogue utterance; a man-page usage
  line, option entry or worked `$ command` example; a few lines of Python; a few lines of CSS/SCSS/HTML) with the
  four `ADAPTER_DESCRIPTIONS` as options. Adapter training never sees the domains' `val`/`test` documents, so the
  router's samples come only from them: `val` documents are split by document group (80/20 of the text, seeded)
  into router train items and router dev items (task "adapter_routing", splits "train" and "val"), `test`
  documents give the held-out adapter benchmark (task "adapter_benchmark", split "test"). Every split is balanced
  over the four domains, and a snippet text (compared with whitespace collapsed) is used at most once in the whole
  file, so no query is in both train and test.

Every item is {"id", "task", "query", "options", "answer", "split", "label"}; adapter items also carry "doc" (the
source document id). `manifest.json` records counts per task and split, the files' sha256, and the settings; no
path or time goes into any output, so the same inputs give byte-identical files.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import json
import math
import random
import re
import sys
import textwrap
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from build_engines.data.corpora import reader
from build_engines.data.corpora.errors import CorporaError
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.routing import option_domains, requests

MAX_QUERY_CHARS = 400
MAX_SNIPPET_LINES = 6
DEFAULT_SEED = 0
DEFAULT_PER_DOMAIN = 250  # adapter benchmark items per domain
TRAIN_FRACTION = 0.8  # share of the domain `val` text (whole document groups) for router train items (rest: dev)
TRAIN_PER_DOMAIN_FACTOR = 4  # router train items per domain = factor * per_domain (dev items = per_domain)
ATTEMPTS_PER_ITEM = 30  # snippet draws per wanted item before a split counts as exhausted

ADAPTER_TASK = "adapter_routing"
BENCHMARK_TASK = "adapter_benchmark"
ADAPTER_TASKS = (ADAPTER_TASK, BENCHMARK_TASK)
RECIPES = ("A", "B", "C")
FILES = ("generic", "adapter", "requests", "options")
MANIFEST = "manifest.json"
FORMAT_VERSION = 1

# What the router reads for each adapter (through the token embedding only). The shipped head was trained on these;
# changing one changes routing, so it goes with a retrained head (see docs/routing.md, natural requests).
ADAPTER_DESCRIPTIONS: dict[str, str] = {
    "L0_chat": "chats casually in everyday conversation: small talk, feelings, opinions and personal back-and-forth",
    "L1_agent": "uses command-line tools: shell commands with their options, flags and arguments, as in Unix man pages",
    "L2_code": "writes, reads and explains Python source code: functions, classes, imports and standard library calls",
    "L3_design": "styles and marks up web pages: CSS and SCSS rules, selectors, colours, layout and HTML elements",
}
# Request-aware rewording tried with recipe R (docs/routing.md); not shipped: the head that reads them is not.
REQUEST_AWARE_DESCRIPTIONS: dict[str, str] = {
    "L0_chat": "chats casually in everyday conversation: small talk, feelings, opinions, plans, jokes and personal "
               "back-and-forth",
    "L1_agent": "uses command-line tools and answers questions about them: shell commands in a terminal with their "
                "options, flags and arguments, as in Unix man pages",
    "L2_code": "writes, reads, fixes and explains Python code: functions, classes, methods, modules, imports, "
               "docstrings and standard library calls",
    "L3_design": "styles and lays out web pages: CSS and SCSS properties and values, selectors, colours, spacing, "
                 "centring, flexbox and grid layout, HTML elements",
}

# The corpus kind whose held-out documents give each adapter's routing snippets.
ADAPTER_KINDS: dict[str, str] = {"L0_chat": "chat", "L1_agent": "agent", "L2_code": "code", "L3_design": "design"}

_SENTIMENT = {
    "positive": "expresses a positive opinion or feeling",
    "negative": "expresses a negative opinion or feeling",
}

LABEL_DESCRIPTIONS: dict[str, dict[str, str]] = {
    "bbc_topic": {
        "business": "news about business, companies, markets or the economy",
        "entertainment": "news about entertainment: films, music, television or celebrities",
        "politics": "news about politics, government, parties or elections",
        "sports": "news about sport: matches, players, teams or competitions",
        "tech": "news about technology: computers, the internet, phones or gadgets",
    },
    "trec_coarse": {
        "ABBR": "asks about an abbreviation: what it stands for, or how something is abbreviated",
        "DESC": "asks for a description, definition, explanation, manner or reason",
        "ENTY": "asks for a thing: an object, animal, substance, event, product, work or other entity",
        "HUM": "asks about a person or a group of people",
        "LOC": "asks for a place or location",
        "NUM": "asks for a number: a count, date, amount, distance or other numeric value",
    },
    "trec_fine": {
        "ABBR:abb": "asks for the abbreviated form of something",
        "ABBR:exp": "asks what an abbreviation or acronym stands for",
        "DESC:def": "asks for the definition of something",
        "DESC:desc": "asks for a description of something",
        "DESC:manner": "asks how something is done or happens",
        "DESC:reason": "asks why something happens: a reason or cause",
        "ENTY:animal": "asks for an animal",
        "ENTY:body": "asks for an organ or part of the body",
        "ENTY:color": "asks for a colour",
        "ENTY:cremat": "asks for a creative work: a book, film, song, painting or TV show",
        "ENTY:currency": "asks for a currency",
        "ENTY:dismed": "asks for a disease or a medicine",
        "ENTY:event": "asks for an event",
        "ENTY:food": "asks for a food or drink",
        "ENTY:instru": "asks for a musical instrument",
        "ENTY:lang": "asks for a language",
        "ENTY:letter": "asks for a letter or character",
        "ENTY:other": "asks for some other kind of thing",
        "ENTY:plant": "asks for a plant",
        "ENTY:product": "asks for a product",
        "ENTY:religion": "asks for a religion",
        "ENTY:sport": "asks for a sport or game",
        "ENTY:substance": "asks for a substance, element or material",
        "ENTY:symbol": "asks for a symbol or sign",
        "ENTY:techmeth": "asks for a technique or method",
        "ENTY:termeq": "asks for the term or name that matches a description",
        "ENTY:veh": "asks for a vehicle",
        "ENTY:word": "asks for a word with a particular property",
        "HUM:desc": "asks for a description of a person",
        "HUM:gr": "asks for a group or organisation of people: a company, team or band",
        "HUM:ind": "asks for an individual person",
        "HUM:title": "asks for a person's title or position",
        "LOC:city": "asks for a city",
        "LOC:country": "asks for a country",
        "LOC:mount": "asks for a mountain",
        "LOC:other": "asks for some other kind of place",
        "LOC:state": "asks for a state or province",
        "NUM:code": "asks for a code such as a postcode or telephone number",
        "NUM:count": "asks how many: a count",
        "NUM:date": "asks for a date or time",
        "NUM:dist": "asks for a distance, length or height",
        "NUM:money": "asks for a price or amount of money",
        "NUM:ord": "asks for a rank or ordinal position",
        "NUM:other": "asks for some other kind of number",
        "NUM:perc": "asks for a percentage or fraction",
        "NUM:period": "asks for a length of time or an age",
        "NUM:speed": "asks for a speed",
        "NUM:temp": "asks for a temperature",
        "NUM:volsize": "asks for a size, area or volume",
        "NUM:weight": "asks for a weight or mass",
    },
    "vader_movie_sentiment": _SENTIMENT,
    "vader_tweet_sentiment": _SENTIMENT,
    "vader_amazon_sentiment": _SENTIMENT,
    "vader_nyt_sentiment": _SENTIMENT,
    "vader_domain": {
        "movie": "a snippet of a film review",
        "tweet": "a tweet: a short social-media post",
        "amazon": "a snippet of a customer's product review",
        "nyt": "a sentence from a newspaper editorial or opinion piece",
    },
    "sms_spam": {
        "ham": "an ordinary personal text message",
        "spam": "an unsolicited advertising or scam text message (spam)",
    },
}

# Tasks whose candidate set is a random subset of the labels (size 2..all, always holding the answer).
SUBSET_TASKS = frozenset({"trec_fine"})


class RoutingDataError(CorporaError):
    """The routing data cannot be built or read (an empty domain, an unknown label, a bad recipe request)."""


class RoutingDataMissing(RoutingDataError, FileNotFoundError):
    """A routing data file has not been written (yet)."""


# ---------------------------------------------------------------------------------------------------------- text


def truncate_words(text: str, limit: int = MAX_QUERY_CHARS) -> str:
    """`text` stripped and cut to at most `limit` characters, at the last whitespace when one is not too early."""
    text = text.strip()
    if len(text) <= limit:
        return text
    head = text[: limit + 1]
    breaks = [match.start() for match in re.finditer(r"\s", head)]
    if breaks and breaks[-1] >= limit // 2:
        return text[: breaks[-1]].rstrip()
    return text[:limit].rstrip()


def _key(text: str) -> str:
    """A snippet compared with whitespace collapsed (the unit of "the same query")."""
    return " ".join(text.split())


def _join_lines(lines: Sequence[str]) -> str:
    """Lines dedented, blank edges dropped, trailing lines dropped until the text fits, then cut at a word."""
    lines = list(lines)
    while lines and not lines[0].strip():
        lines.pop(0)
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines:
        return ""
    text = textwrap.dedent("\n".join(line.rstrip() for line in lines))
    while len(text) > MAX_QUERY_CHARS and "\n" in text:
        text = text.rsplit("\n", 1)[0].rstrip()
    return truncate_words(text)


def _usable(text: str, min_words: int = 1) -> bool:
    """Enough content to route on: 12+ characters, 4+ letters or digits, `min_words`+ words."""
    return (len(text) >= 12 and sum(ch.isalnum() for ch in text) >= 4 and len(text.split()) >= min_words)


# ------------------------------------------------------------------------------------------------------ snippets
#
# Each domain turns a document into "units" (candidate starting points) and a unit plus a random generator into one
# snippet. Documents are drawn with weight sqrt(number of units), so long documents give more snippets without
# drowning out the short ones.


class _Snippets:
    min_words = 1

    def units(self, text: str) -> list[Any]:
        raise NotImplementedError

    def snippet(self, unit: Any, rng: random.Random) -> str:
        raise NotImplementedError


class _ChatSnippets(_Snippets):
    """One utterance of a dialogue, without its speaker tag ("A: ", "B: ")."""

    min_words = 3
    _speaker = re.compile(r"^[A-Z]:\s*")

    def units(self, text: str) -> list[str]:
        return [self._speaker.sub("", line).strip() for line in text.splitlines() if line.strip()]

    def snippet(self, unit: str, rng: random.Random) -> str:
        return truncate_words(unit)


class _LineSnippets(_Snippets):
    """A contiguous chunk of 1..6 lines starting at a non-blank line (code and design sources)."""

    def units(self, text: str) -> list[tuple[list[str], int]]:
        lines = text.splitlines()
        return [(lines, i) for i, line in enumerate(lines) if line.strip()]

    def snippet(self, unit: tuple[list[str], int], rng: random.Random) -> str:
        lines, start = unit
        return _join_lines(lines[start: start + rng.randint(1, MAX_SNIPPET_LINES)])


class _ManSnippets(_Snippets):
    """A usage line of SYNOPSIS, an option entry (the option line and up to 5 lines of its description), or 1..6
    lines of a worked example (an EXAMPLES section, or a `$ command` line and what follows it).

    Man-page text (from our groff converter) has section headings at column 0 and indented content; an option entry
    is a line starting with "-" followed by the more deeply indented lines below it (blank lines skipped). A page
    with none of these falls back to chunks of its indented lines.
    """

    _option = re.compile(r"^-{1,2}[A-Za-z0-9?#@]")

    def units(self, text: str) -> list[tuple[list[str], int]]:
        lines = text.splitlines()
        units: list[tuple[list[str], int]] = []
        section = ""
        for i, line in enumerate(lines):
            stripped = line.strip()
            if not stripped:
                continue
            indent = len(line) - len(line.lstrip())
            if indent == 0:
                section = stripped.upper()
                continue
            if section == "SYNOPSIS":
                units.append(([line], 0))
            elif section.startswith("EXAMPLE") or stripped.startswith("$ "):
                units.append((lines, i))
            elif self._option.match(stripped):
                entry = [line]
                for follow in lines[i + 1:]:
                    if not follow.strip():
                        continue
                    if len(follow) - len(follow.lstrip()) <= indent or len(entry) == MAX_SNIPPET_LINES:
                        break
                    entry.append(follow)
                units.append((entry, 0))
        if not units:
            content = [line for line in lines if line.strip() and line[:1].isspace()]
            units = [(content, i) for i in range(len(content))]
        return units

    def snippet(self, unit: tuple[list[str], int], rng: random.Random) -> str:
        lines, start = unit
        return _join_lines(lines[start: start + rng.randint(1, MAX_SNIPPET_LINES)])


_SNIPPETS: dict[str, _Snippets] = {"chat": _ChatSnippets(), "agent": _ManSnippets(), "code": _LineSnippets(),
                                   "design": _LineSnippets()}


def _domain_documents(data_dir: Path, adapter: str, split: str) -> list[tuple[str, str]]:
    """(doc_id, text) of every source of the adapter's kind, for one split; a clear error when there are none."""
    kind = ADAPTER_KINDS[adapter]
    names = reader.sources(data_dir, kind)
    if not names:
        raise RoutingDataError(f"no prepared source of kind {kind!r} (adapter {adapter}) in {data_dir}: run "
                               f"`python -m build_engines.data.corpora prepare --out {data_dir}`")
    docs = [(f"{name}/{record['doc_id']}", record["text"])
            for name in names for record in reader.iter_records(data_dir, name, split)]
    if not any(text.strip() for _, text in docs):
        raise RoutingDataError(f"domain {kind!r} (adapter {adapter}, source {', '.join(names)}) has no {split} "
                               f"documents in {data_dir}")
    return docs


Docs = list[tuple[str, str]]  # (doc_id, text)


def _group_split(docs: Docs, rng: random.Random) -> tuple[Docs, Docs]:
    """Documents split by document group (the parts of one long document stay together): groups in seeded random
    order go to dev until dev holds 1 - TRAIN_FRACTION of the characters (at least one group, and one is left for
    train), the rest to train. Measured in characters, not groups, so a few short pages do not starve dev."""
    size: dict[str, int] = Counter()
    for doc_id, text in docs:
        size[reader.group_of(doc_id)] += len(text)
    groups = sorted(size)
    rng.shuffle(groups)
    dev_groups: set[str] = set()
    dev_chars, total = 0, sum(size.values())
    for group in groups[:-1]:
        if dev_groups and dev_chars >= (1 - TRAIN_FRACTION) * total:
            break
        dev_groups.add(group)
        dev_chars += size[group]
    train = [doc for doc in docs if reader.group_of(doc[0]) not in dev_groups]
    dev = [doc for doc in docs if reader.group_of(doc[0]) in dev_groups]
    return train, dev


def _sample_snippets(docs: list[tuple[str, str]], kind: str, n: int, rng: random.Random,
                     taken: set[str]) -> list[tuple[str, str]]:
    """Up to `n` (doc_id, snippet) pairs with snippets not in `taken` (which grows); fewer if the documents run dry."""
    maker = _SNIPPETS[kind]
    pool = [(doc_id, units) for doc_id, text in docs if (units := maker.units(text))]
    if not pool or n <= 0:
        return []
    weights = list(_cumulative([math.sqrt(len(units)) for _, units in pool]))
    out: list[tuple[str, str]] = []
    for _ in range(n * ATTEMPTS_PER_ITEM):
        doc_id, units = pool[_pick(weights, rng)]
        snippet = maker.snippet(units[rng.randrange(len(units))], rng)
        key = _key(snippet)
        if key in taken or not _usable(snippet, maker.min_words):
            continue
        taken.add(key)
        out.append((doc_id, snippet))
        if len(out) == n:
            break
    return out


def _cumulative(values: list[float]) -> list[float]:
    total, out = 0.0, []
    for value in values:
        total += value
        out.append(total)
    return out


def _pick(cumulative: list[float], rng: random.Random) -> int:
    return min(bisect.bisect_right(cumulative, rng.random() * cumulative[-1]), len(cumulative) - 1)


# --------------------------------------------------------------------------------------------------------- items


def _shuffled_options(descriptions: list[str], answer: str, rng: random.Random) -> tuple[list[str], int]:
    options = list(descriptions)
    rng.shuffle(options)
    return options, options.index(answer)


def build_generic_items(data_dir: str | Path, seed: int = DEFAULT_SEED) -> list[dict[str, Any]]:
    """One item per row of each prepared labelled set that has descriptions (sorted by task, then file order)."""
    data_dir = Path(data_dir)
    manifest = reader.load_manifest(data_dir)
    tasks = [name for name in sorted(manifest.get("labelled", {})) if name in LABEL_DESCRIPTIONS]
    if not tasks:
        raise RoutingDataError(f"no labelled set with routing descriptions is prepared in {data_dir} (known: "
                               f"{', '.join(sorted(LABEL_DESCRIPTIONS))})")
    items: list[dict[str, Any]] = []
    for task in tasks:
        described = LABEL_DESCRIPTIONS[task]
        labels = sorted(described)
        rng = random.Random(f"{seed}:generic:{task}")
        for index, row in enumerate(reader.load_labelled(data_dir, task)):
            label = row["label"]
            if label not in described:
                raise RoutingDataError(f"labelled set {task!r} has label {label!r} without a description (known: "
                                       f"{', '.join(labels)}); add it to LABEL_DESCRIPTIONS")
            query = truncate_words(row["text"])
            if not query:
                continue
            if task in SUBSET_TASKS:
                others = [other for other in labels if other != label]
                size = rng.randint(2, len(labels))
                candidates = [label] + rng.sample(others, size - 1)
            else:
                candidates = labels
            options, answer = _shuffled_options([described[c] for c in candidates], described[label], rng)
            items.append({"id": f"{task}:{index:06d}", "task": task, "query": query, "options": options,
                          "answer": answer, "split": row["split"], "label": label})
    return items


def build_adapter_items(data_dir: str | Path, seed: int = DEFAULT_SEED, per_domain: int = DEFAULT_PER_DOMAIN, *,
                        train_per_domain: int | None = None, dev_per_domain: int | None = None,
                        stats: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Adapter-routing items: router train/dev items from the domains' `val` documents (split by document group),
    and the benchmark (`per_domain` items per domain) from their `test` documents. Each split is balanced over the
    domains (cut to the smallest domain's count) and interleaved domain by domain; `stats`, when given, receives
    the counts drawn per split and domain before balancing."""
    if per_domain < 1:
        raise ValueError(f"per_domain must be positive, got {per_domain}")
    data_dir = Path(data_dir)
    reader.load_manifest(data_dir)  # the reader's message for a directory that was never prepared
    wanted = {"test": per_domain,
              "train": TRAIN_PER_DOMAIN_FACTOR * per_domain if train_per_domain is None else train_per_domain,
              "val": per_domain if dev_per_domain is None else dev_per_domain}
    docs: dict[str, dict[str, list[tuple[str, str]]]] = {}
    for adapter in ADAPTER_DESCRIPTIONS:
        held_out = _domain_documents(data_dir, adapter, "val")
        train, dev = _group_split(held_out, random.Random(f"{seed}:groups:{adapter}"))
        docs[adapter] = {"test": _domain_documents(data_dir, adapter, "test"), "train": train, "val": dev}
    taken: set[str] = set()
    drawn: dict[str, dict[str, list[tuple[str, str]]]] = defaultdict(dict)
    for split in ("test", "train", "val"):  # the benchmark claims its snippets first
        for adapter in ADAPTER_DESCRIPTIONS:
            rng = random.Random(f"{seed}:snippets:{split}:{adapter}")
            drawn[split][adapter] = _sample_snippets(docs[adapter][split], ADAPTER_KINDS[adapter], wanted[split],
                                                     rng, taken)
        if split == "test" and not all(drawn["test"].values()):
            empty = [adapter for adapter, got in drawn["test"].items() if not got]
            raise RoutingDataError(f"no usable benchmark snippet in the test documents of {', '.join(empty)} "
                                   f"(kind {', '.join(ADAPTER_KINDS[a] for a in empty)}) in {data_dir}")
    if stats is not None:
        stats.update({split: {adapter: len(got) for adapter, got in by.items()} for split, by in drawn.items()})
    descriptions = list(ADAPTER_DESCRIPTIONS.values())
    items: list[dict[str, Any]] = []
    for split in ("train", "val", "test"):
        task = BENCHMARK_TASK if split == "test" else ADAPTER_TASK
        count = min(len(got) for got in drawn[split].values())
        rng = random.Random(f"{seed}:options:{split}")
        for i in range(count):
            for adapter in ADAPTER_DESCRIPTIONS:
                doc_id, query = drawn[split][adapter][i]
                options, answer = _shuffled_options(descriptions, ADAPTER_DESCRIPTIONS[adapter], rng)
                items.append({"id": f"{task}:{split}:{adapter}:{i:05d}", "task": task, "query": query,
                              "options": options, "answer": answer, "split": split, "label": adapter,
                              "doc": doc_id})
    return items


# ------------------------------------------------------------------------------------------------------ files


def _counts(items: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    counts: dict[str, Counter[str]] = defaultdict(Counter)
    for item in items:
        counts[item["task"]][item["split"]] += 1
    return {task: dict(sorted(by_split.items())) for task, by_split in sorted(counts.items())}


def write_routing_data(data_dir: str | Path, out_dir: str | Path, seed: int = DEFAULT_SEED,
                       per_domain: int = DEFAULT_PER_DOMAIN, *,
                       request_train_per_domain: int = requests.DEFAULT_REQUEST_TRAIN_PER_DOMAIN,
                       request_bench_per_domain: int = requests.DEFAULT_REQUEST_BENCH_PER_DOMAIN) -> dict[str, Any]:
    """Build the item sets and write `generic.jsonl`, `adapter.jsonl` (document windows), `requests.jsonl`
    (request-style items and the natural-request benchmark, see `requests`), `options.jsonl` (requests of domains that
    are no adapter, see `option_domains`) and `manifest.json`; return the manifest."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    data_manifest = reader.load_manifest(data_dir)
    generic = build_generic_items(data_dir, seed)
    drawn: dict[str, Any] = {}
    adapter = build_adapter_items(data_dir, seed, per_domain, stats=drawn)
    request_drawn: dict[str, Any] = {}
    request_items = requests.build_request_items(data_dir, ADAPTER_DESCRIPTIONS, ADAPTER_KINDS, seed,
                                                 request_train_per_domain, request_bench_per_domain,
                                                 stats=request_drawn)
    option_items = option_domains.build_option_items(data_dir, ADAPTER_DESCRIPTIONS, seed)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {name: write_jsonl(out_dir / f"{name}.jsonl", rows, out_dir)
             for name, rows in (("generic", generic), ("adapter", adapter), ("requests", request_items),
                                ("options", option_items))}
    manifest = {
        "format_version": FORMAT_VERSION,
        "generator": "python -m build_engines.routing.data",
        "seed": seed,
        "per_domain": per_domain,
        "data_manifest_sha256": hashlib.sha256(json.dumps(data_manifest, sort_keys=True).encode()).hexdigest(),
        "files": files,
        "counts": {"generic": _counts(generic), "adapter": _counts(adapter), "requests": _counts(request_items),
                   "options": _counts(option_items)},
        "adapter_snippets_drawn": drawn,
        "requests": requests.manifest_record(request_items, request_drawn, seed, request_train_per_domain,
                                             request_bench_per_domain),
        "options": option_domains.manifest_record(option_items, seed, option_domains.DEFAULT_OPTION_TRAIN_PER_DOMAIN,
                                                  option_domains.DEFAULT_OPTION_BENCH_PER_DOMAIN),
        "adapter_descriptions": ADAPTER_DESCRIPTIONS,
        "settings": {"max_query_chars": MAX_QUERY_CHARS, "max_snippet_lines": MAX_SNIPPET_LINES,
                     "train_fraction": TRAIN_FRACTION, "train_per_domain_factor": TRAIN_PER_DOMAIN_FACTOR,
                     "subset_tasks": sorted(SUBSET_TASKS)},
    }
    write_json(out_dir / MANIFEST, manifest)
    return manifest


def load_items(out_dir: str | Path, name: str) -> list[dict[str, Any]]:
    """The items of `generic`, `adapter`, `requests` or `options` (a trailing `.jsonl` is accepted)."""
    out_dir = Path(out_dir)
    name = name.removesuffix(".jsonl")
    if name not in FILES:
        raise ValueError(f"name must be one of {', '.join(FILES)}, got {name!r}")
    path = out_dir / f"{name}.jsonl"
    if not path.is_file():
        raise RoutingDataMissing(f"no routing data at {path}: run `python -m build_engines.routing.data --data "
                                 f"artifacts/data --out {out_dir}`")
    with open(path, encoding="utf-8") as handle:
        return [json.loads(line) for line in handle]


# ---------------------------------------------------------------------------------------------------- recipes


def _round_robin(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Items interleaved label by label (file order within a label), so every prefix is balanced and nested."""
    by_label: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for item in items:
        by_label[item["label"]].append(item)
    queues = [by_label[label] for label in sorted(by_label)]
    return [queue[i] for i in range(max(map(len, queues), default=0)) for queue in queues if i < len(queue)]


def recipe_sets(items: list[dict[str, Any]], recipe: str, n_adapter: int | None = None, *, split: str = "train",
                seed: int = DEFAULT_SEED) -> list[list[dict[str, Any]]]:
    """Training stages of one recipe, from any mix of generic and adapter items (only `split` items are used):

    - "A": one stage, the generic items;
    - "B": one stage, generic items and `n_adapter` adapter-routing items mixed (shuffled together);
    - "C": two stages, the generic items, then the `n_adapter` adapter-routing items.

    The adapter items taken are the first `n_adapter` of a domain-by-domain interleaving, so every size is balanced
    over the domains and a smaller sweep point is a subset of a larger one; None takes them all. Benchmark items
    are never used. Each stage is shuffled with `seed`.
    """
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {', '.join(RECIPES)}, got {recipe!r}")
    generic = [item for item in items if item["task"] not in ADAPTER_TASKS and item["split"] == split]
    adapter = _round_robin([item for item in items if item["task"] == ADAPTER_TASK and item["split"] == split])
    if n_adapter is None:
        n_adapter = len(adapter)
    if n_adapter < 0 or (recipe != "A" and n_adapter > len(adapter)):
        raise RoutingDataError(f"n_adapter={n_adapter} but {len(adapter)} adapter-routing {split} items are there")
    chosen = adapter[:n_adapter]
    stages = {"A": [generic], "B": [generic + chosen], "C": [generic, chosen]}[recipe]
    out = []
    for index, stage in enumerate(stages):
        stage = list(stage)
        random.Random(f"{seed}:recipe:{recipe}:{index}").shuffle(stage)
        out.append(stage)
    return out


# ------------------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m build_engines.routing.data",
                                     description="Build pick-one routing items (generic labelled tasks and adapter "
                                                 "domains) from the prepared data directory.")
    parser.add_argument("--data", type=Path, default=Path("artifacts/data"), help="prepared data (artifacts/data)")
    parser.add_argument("--out", type=Path, default=Path("artifacts/routing"), help="output (artifacts/routing)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help=f"seed ({DEFAULT_SEED})")
    parser.add_argument("--per-domain", type=int, default=DEFAULT_PER_DOMAIN,
                        help=f"adapter benchmark items per domain ({DEFAULT_PER_DOMAIN}); router train items are "
                             f"{TRAIN_PER_DOMAIN_FACTOR}x this, dev items 1x")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    start = time.perf_counter()
    try:
        manifest = write_routing_data(args.data, args.out, args.seed, args.per_domain)
    except CorporaError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for group, counts in manifest["counts"].items():
        for task, by_split in counts.items():
            print(f"{group:8s} {task:24s} " + " ".join(f"{split}={n}" for split, n in by_split.items()))
    for name, record in manifest["files"].items():
        print(f"wrote {args.out / record['path']} ({record['rows']} items, {record['bytes']} bytes, "
              f"sha256 {record['sha256'][:12]})")
    print(f"done in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
