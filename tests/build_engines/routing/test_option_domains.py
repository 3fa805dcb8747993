"""Option-domain items and varied option sets: answers, splits, determinism, what a missing source does, and that
the zero-shot test domain (Shakespeare's plays) appears nowhere. On a tiny prepared data directory written here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from build_engines.data.corpora import reader
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.routing import option_domains as od
from build_engines.routing.data import ADAPTER_DESCRIPTIONS

CHAPTER = ("Elinor looked at Marianne. \"I cannot think why Willoughby stays away so long from us all,\" said Marianne "
           "to her sister. Elinor smiled and said nothing to Marianne about it at all that evening. Willoughby came "
           "the next day with news from town, and everybody was glad to see him.")


def make_data(root: Path, *, labelled: tuple[str, ...] = ("bbc_topic", "vader_domain")) -> Path:
    manifest: dict = {"format_version": reader.FORMAT_VERSION, "sources": {}, "labelled": {}}
    files = {}
    for split in ("train", "val", "test"):
        docs = [{"doc_id": f"austen-sensesensibility/ch{d:03d}", "text": f"{split.upper()} {d}. " + CHAPTER}
                for d in range(3)]
        docs.append({"doc_id": "unknown-book/ch001", "text": CHAPTER})  # not a book the builder names: skipped
        files[split] = write_jsonl(root / "corpus" / "novels" / f"{split}.jsonl", docs, root)
    manifest["sources"]["novels"] = {"kind": "base", "files": files}
    rows = {
        "bbc_topic": [{"text": f"{split.upper()} headline {n}\n\nbody", "label": "business", "split": split}
                      for split in ("train", "test") for n in range(6)],
        "vader_domain": [{"text": f"{label} {split.upper()} snippet {n}", "label": label, "split": split}
                         for label in ("movie", "amazon", "tweet", "nyt") for split in ("train", "test")
                         for n in range(6)],
    }
    for name in labelled:
        manifest["labelled"][name] = {"file": write_jsonl(root / "labelled" / f"{name}.jsonl", rows[name], root)}
    write_json(root / "manifest.json", manifest)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


def test_items_answer_their_domain_and_keep_the_adapters(data: Path) -> None:
    items = od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=0, train_per_domain=5, bench_per_domain=3)
    assert {i["label"] for i in items} == set(od.OPTION_DOMAINS)
    for item in items:
        options = item["options"]
        assert len(set(options)) == len(options)
        assert set(ADAPTER_DESCRIPTIONS.values()) <= set(options), "the four adapters are always there"
        assert options[item["answer"]] in od.OPTION_DOMAINS[item["label"]]
        extra = [o for o in options if o not in ADAPTER_DESCRIPTIONS.values()]
        assert all(any(o in d for d in od.OPTION_DOMAINS.values()) for o in extra)
        assert item["task"] == {"train": od.OPTION_TASK, "test": od.OPTION_BENCHMARK_TASK}[item["split"]]
    for domain in od.OPTION_DOMAINS:
        assert sum(i["label"] == domain and i["split"] == "train" for i in items) == 5
        assert sum(i["label"] == domain and i["split"] == "test" for i in items) == 3


def test_each_split_reads_its_own_rows(data: Path) -> None:
    items = od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=0, train_per_domain=5, bench_per_domain=3)
    for item in items:
        other = "TEST" if item["split"] == "train" else "TRAIN"
        if item["label"] in ("news", "films", "products"):
            assert item["split"].upper() in item["query"] and other not in item["query"]
        if item["label"] == "products":
            assert "amazon" in item["query"] and "movie" not in item["query"]


def test_novel_requests_name_the_book_and_its_people(data: Path) -> None:
    queries = od.domain_requests(data, "novels", "train", 40, seed=3)
    assert queries and all("TEST" not in q for q in queries)
    assert any("Sense and Sensibility" in q for q in queries)
    named = {w for q in queries for w in ("Elinor", "Marianne", "Willoughby") if w in q}
    assert named, "characters are the chapter's capitalised names"


def test_deterministic_and_seeded(data: Path) -> None:
    one = od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=0, train_per_domain=5, bench_per_domain=3)
    assert one == od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=0, train_per_domain=5, bench_per_domain=3)
    assert one != od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=1, train_per_domain=5, bench_per_domain=3)


def test_a_missing_source_leaves_its_domain_out(tmp_path: Path) -> None:
    data = make_data(tmp_path, labelled=("bbc_topic",))
    assert od.prepared_domains(data) == ["novels", "news"]
    items = od.build_option_items(data, ADAPTER_DESCRIPTIONS, seed=0, train_per_domain=2, bench_per_domain=2)
    assert {i["label"] for i in items} == {"novels", "news"}


def test_vary_options_adds_descriptions_and_keeps_the_answer() -> None:
    adapters = list(ADAPTER_DESCRIPTIONS.values())
    items = [{"id": f"request_routing:{n}", "task": "request_routing", "query": "q", "options": adapters,
              "answer": n % 4, "split": "train", "label": list(ADAPTER_DESCRIPTIONS)[n % 4]} for n in range(200)]
    other = {"id": "bbc_topic:0", "task": "bbc_topic", "query": "q", "options": ["a", "b"], "answer": 1,
             "split": "train", "label": "x"}
    varied = od.vary_options(items + [other], seed=0)
    assert varied[-1] == other, "generic tasks are not touched"
    sizes = set()
    for before, after in zip(items, varied):
        assert after["options"][after["answer"]] == before["options"][before["answer"]]
        assert set(adapters) <= set(after["options"]) and len(set(after["options"])) == len(after["options"])
        extra = [o for o in after["options"] if o not in adapters]
        domains = [d for d, wordings in od.OPTION_DOMAINS.items() if any(o in wordings for o in extra)]
        assert len(domains) == len(extra), "at most one wording per domain"
        sizes.add(len(extra))
    assert sizes == set(od.EXTRA_OPTIONS)
    assert varied == od.vary_options(items + [other], seed=0)


def test_the_zero_shot_domain_is_nowhere() -> None:
    text = " ".join(d for wordings in od.OPTION_DOMAINS.values() for d in wordings).lower()
    text += " ".join(p for phrasings in od._PHRASINGS.values() for p in phrasings).lower()
    for word in ("shakespeare", "drama", "verse", "sonnets?", "scenes?", "plays?", "playwright"):
        assert not re.search(rf"\b{word}\b", text), word
    assert all(name != "shakespeare" for _, name, _ in od._SOURCES.values())
