"""Request-style routing items: what a user would ask each adapter, generated from the corpora's structure.

The document-window items (`data.build_adapter_items`) show the router excerpts of man pages, Python files and
stylesheets; users send requests ("what does the -r flag of grep do?", "how do I centre a div?"). These items
put domain facts (`request_facts`) into user phrasings (`request_phrasings`), seeded, so the same prepared data
and seed give the same items byte for byte.

Two tasks, kept apart three ways (documented in docs/routing.md and checked by the tests):
- `request_routing` (split "train"): facts from the domains' **train** documents, `train` phrasing bank;
- `request_benchmark` (split "test"), the natural-request benchmark: facts from the domains' **test** documents
  (other man pages, modules, stylesheets and dialogues; the document-window benchmark draws from the same test
  documents, and neither the adapters nor the router train on them), `benchmark` phrasing bank (no template,
  opener, closer or chat slot word in common with the train bank), and no query text equal to a training query.

Facts are drawn document first (weight sqrt(facts in the document), so one huge page does not dominate), then a
fact, then a template among those whose fields the fact fills. Each split is balanced over the four domains.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import string
from collections import defaultdict
from pathlib import Path
from typing import Any

from build_engines.data.corpora import reader
from build_engines.data.corpora.errors import CorporaError
from build_engines.routing.request_facts import EXTRACTORS, Fact
from build_engines.routing.request_phrasings import CLOSERS, OPENERS, SLOTS, TEMPLATES, ZERO_SHOT_TEMPLATES

REQUEST_TASK = "request_routing"
REQUEST_BENCHMARK_TASK = "request_benchmark"
REQUEST_TASKS = (REQUEST_TASK, REQUEST_BENCHMARK_TASK)
DEFAULT_REQUEST_TRAIN_PER_DOMAIN = 1000
DEFAULT_REQUEST_BENCH_PER_DOMAIN = 75
MAX_REQUEST_CHARS = 400
ATTEMPTS_PER_ITEM = 40
# (task, bank, corpus split) per item split
PLAN: dict[str, tuple[str, str, str]] = {"train": (REQUEST_TASK, "train", "train"),
                                         "test": (REQUEST_BENCHMARK_TASK, "benchmark", "test")}


class RequestDataError(CorporaError):
    """A domain yields no fact to ask about, so its requests (or its benchmark requests) cannot be built."""


def template_fields(template: str) -> list[str]:
    """The `{field}` names a template uses, in order of first appearance: `render` draws a slot value per field in
    this order, so it must not depend on set iteration (string hashing is randomised per process, and a set here
    made the request files differ from run to run)."""
    return list(dict.fromkeys(name for _, name, _, _ in string.Formatter().parse(template) if name))


def render(template: str, fact: Fact, bank: str, rng: random.Random) -> str | None:
    """The template filled from `fact` and the bank's chat slots, with an opener and closer; None if a field the
    template needs is missing or empty."""
    values: dict[str, str] = {}
    for name in template_fields(template):
        if name in SLOTS[bank]:
            values[name] = rng.choice(SLOTS[bank][name])
        elif fact.get(name):
            values[name] = fact[name]
        else:
            return None
    body, opener = template.format(**values), rng.choice(OPENERS[bank])
    if opener and body[:1].isupper() and body[1:2].islower():  # "Excuse me, so what's..."
        body = body[0].lower() + body[1:]
    text = opener + body + rng.choice(CLOSERS[bank])
    return text.strip()[:MAX_REQUEST_CHARS].rstrip()


def domain_facts(data_dir: Path, kind: str, split: str) -> list[tuple[str, list[Fact]]]:
    """(doc_id, facts) of every document of the kind's sources in `split` that yields at least one fact."""
    extract = EXTRACTORS[kind]
    out = []
    for source in reader.sources(data_dir, kind):
        for record in reader.iter_records(data_dir, source, split):
            doc_id = f"{source}/{record['doc_id']}"
            facts = [{**fact, "doc": doc_id} for fact in extract(record["doc_id"], record["text"])]
            if facts:
                out.append((doc_id, facts))
    return out


def _draw(docs: list[tuple[str, list[Fact]]], kind: str, bank: str, n: int, rng: random.Random,
          taken: set[str], templates: list[str] | None = None) -> list[tuple[str, str, int]]:
    """Up to `n` (doc_id, query, template index) with queries not in `taken` (which grows); `templates` defaults
    to the bank's templates for `kind`."""
    if not docs:
        return []
    templates = TEMPLATES[bank][kind] if templates is None else templates
    cumulative, total = [], 0.0
    for _, facts in docs:
        total += math.sqrt(len(facts))
        cumulative.append(total)
    out: list[tuple[str, str, int]] = []
    for _ in range(n * ATTEMPTS_PER_ITEM):
        pick = rng.random() * total
        doc_id, facts = docs[min(bisect.bisect_left(cumulative, pick), len(docs) - 1)]
        fact = facts[rng.randrange(len(facts))]
        index = rng.randrange(len(templates))
        query = render(templates[index], fact, bank, rng)
        if query is None:
            continue
        key = " ".join(query.lower().split())
        if key in taken:
            continue
        taken.add(key)
        out.append((doc_id, query, index))
        if len(out) == n:
            break
    return out


def build_request_items(data_dir: str | Path, descriptions: dict[str, str], kinds: dict[str, str], seed: int = 0,
                        train_per_domain: int = DEFAULT_REQUEST_TRAIN_PER_DOMAIN,
                        bench_per_domain: int = DEFAULT_REQUEST_BENCH_PER_DOMAIN,
                        stats: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Request items for the adapters in `descriptions` (adapter -> description; `kinds`: adapter -> corpus kind):
    `train_per_domain` training requests and `bench_per_domain` benchmark requests per adapter, balanced (cut to
    the smallest domain) and interleaved domain by domain. `stats` receives the counts drawn before balancing."""
    data_dir = Path(data_dir)
    reader.load_manifest(data_dir)
    wanted = {"train": train_per_domain, "test": bench_per_domain}
    taken: set[str] = set()
    drawn: dict[str, dict[str, list[tuple[str, str, int]]]] = defaultdict(dict)
    for split in ("train", "test"):  # train first: a benchmark query equal to a training one is skipped
        _, bank, corpus_split = PLAN[split]
        for adapter in descriptions:
            docs = domain_facts(data_dir, kinds[adapter], corpus_split)
            rng = random.Random(f"{seed}:requests:{split}:{adapter}")
            drawn[split][adapter] = _draw(docs, kinds[adapter], bank, wanted[split], rng, taken)
            if wanted[split] > 0 and not drawn[split][adapter]:
                raise RequestDataError(f"no request could be built for {adapter} (kind {kinds[adapter]!r}) from the "
                                       f"{corpus_split} documents in {data_dir}: no fact to ask about")
    if stats is not None:
        stats.update({split: {adapter: len(got) for adapter, got in by.items()} for split, by in drawn.items()})
    options_all = list(descriptions.values())
    items: list[dict[str, Any]] = []
    for split in ("train", "test"):
        task, bank, _ = PLAN[split]
        count = min(len(got) for got in drawn[split].values())
        rng = random.Random(f"{seed}:request-options:{split}")
        for i in range(count):
            for adapter in descriptions:
                doc_id, query, template = drawn[split][adapter][i]
                options = list(options_all)
                rng.shuffle(options)
                items.append({"id": f"{task}:{adapter}:{i:05d}", "task": task, "query": query, "options": options,
                              "answer": options.index(descriptions[adapter]), "split": split, "label": adapter,
                              "doc": doc_id, "template": f"{bank}/{kinds[adapter]}/{template}"})
    return items


def phrasing_digest() -> str:
    """sha256 of both phrasing banks (templates, openers, closers, slots): recorded in the routing manifest."""
    blob = json.dumps({"templates": TEMPLATES, "openers": OPENERS, "closers": CLOSERS, "slots": SLOTS},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def manifest_record(items: list[dict[str, Any]], drawn: dict[str, Any], seed: int, train_per_domain: int,
                    bench_per_domain: int) -> dict[str, Any]:
    """How the request items were made, for the routing data manifest."""
    templates = {bank: {kind: len(t) for kind, t in by.items()} for bank, by in TEMPLATES.items()}
    train_docs = {item["doc"] for item in items if item["task"] == REQUEST_TASK}
    bench_docs = {item["doc"] for item in items if item["task"] == REQUEST_BENCHMARK_TASK}
    return {
        "generator": "build_engines.routing.requests (facts: request_facts, phrasings: request_phrasings)",
        "seed": seed,
        "train_per_domain": train_per_domain,
        "benchmark_per_domain": bench_per_domain,
        "drawn": drawn,
        "sources": {"request_routing": "facts of the domains' train documents, phrasing bank 'train'",
                    "request_benchmark": "facts of the domains' test documents, phrasing bank 'benchmark'"},
        "templates": templates,
        "phrasings_sha256": phrasing_digest(),
        "documents": {"train": len(train_docs), "benchmark": len(bench_docs),
                      "shared": len(train_docs & bench_docs)},
    }


# The zero-shot fifth domain: an adapter on Shakespeare's plays registered after the head was trained, with this
# description only (`benchmarks/zero_shot_adapter.py`); no router training item is drawn from it (`option_domains`).
ZERO_SHOT_ADAPTER, ZERO_SHOT_SOURCE, ZERO_SHOT_KIND = "L4_drama", "shakespeare", "drama"
ZERO_SHOT_DESCRIPTION = ("recites and explains Shakespeare's plays: characters, acts and scenes, speeches, sonnets, "
                         "blank verse and Early Modern English")
ZERO_SHOT_REQUESTS = 100


def zero_shot_requests(data_dir: str | Path, source: str, kind: str, label: str, n: int, seed: int = 0,
                       split: str = "test") -> list[dict[str, Any]]:
    """`n` requests for a domain no head was trained on: facts of one source's `split` documents (extractor
    `kind`), `ZERO_SHOT_TEMPLATES[kind]` with the benchmark bank's openers and closers. Items carry `label` and no
    options (the options are whatever the registry holds when they are routed)."""
    data_dir = Path(data_dir)
    docs = []
    for record in reader.iter_records(data_dir, source, split):
        doc_id = f"{source}/{record['doc_id']}"
        facts = [{**fact, "doc": doc_id} for fact in EXTRACTORS[kind](record["doc_id"], record["text"])]
        if facts:
            docs.append((doc_id, facts))
    got = _draw(docs, kind, "benchmark", n, random.Random(f"{seed}:zero-shot:{source}"), set(),
                ZERO_SHOT_TEMPLATES[kind])
    if not got:
        raise RequestDataError(f"no request could be built from the {split} documents of {source} in {data_dir}")
    return [{"id": f"zero_shot:{label}:{i:05d}", "query": query, "label": label, "doc": doc_id,
             "template": f"zero_shot/{kind}/{index}"} for i, (doc_id, query, index) in enumerate(got)]
