"""Routing items: schema, answers, determinism, TREC-fine candidate sizes, the adapter benchmark's isolation and
balance, recipe stages, and errors. All on a tiny prepared data directory written here in the reader's format;
one smoke test uses the real `artifacts/data`, prepared for it (tests/real_data.py)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from build_engines.data.corpora import reader
from build_engines.data.corpora.errors import DataNotPrepared
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.routing import data as rd

PER_DOMAIN = 8
LONG_TEXT = "Markets rally\n\n" + " ".join(f"word{i}" for i in range(200))


def _labelled_rows() -> dict[str, list[dict[str, str]]]:
    rows: dict[str, list[dict[str, str]]] = {}
    splits = ("train", "train", "val", "test")
    rows["trec_fine"] = [{"text": f"What is question {n} about {label} ?", "label": label, "split": split}
                         for label in sorted(rd.LABEL_DESCRIPTIONS["trec_fine"]) for n, split in enumerate(splits)]
    rows["bbc_topic"] = [{"text": f"{label} story {n}\n\nSomething happened in {label} today.", "label": label,
                          "split": split} for label in sorted(rd.LABEL_DESCRIPTIONS["bbc_topic"])
                         for n, split in enumerate(splits)]
    rows["bbc_topic"][0]["text"] = LONG_TEXT
    rows["sms_spam"] = [{"text": f"message {n} of kind {label}", "label": label, "split": split}
                        for label in ("ham", "spam") for n, split in enumerate(splits)]
    return rows


def _chat(split: str, d: int) -> str:
    return "\n\n".join(f"A: {split} speaker asks question number {d} {k} about the weather?\n"
                       f"B: {split} friend answers reply number {d} {k} with some feeling." for k in range(6))


def _man(split: str, d: int) -> str:
    options = "\n\n".join(f"    -{chr(97 + k)}, --{split}-opt{d}-{k}=VALUE\n        set the {split} value {d} {k} "
                          f"for the tool\n        and keep going with care" for k in range(8))
    return (f"NAME\n    tool{split}{d} - does things\n\nSYNOPSIS\n    tool{split}{d} [OPTION]... FILE {d}\n"
            f"    tool{split}{d} --help\n\nOPTIONS\n{options}\n")


def _code(split: str, d: int) -> str:
    return "\n".join(f"def {split}_func_{d}_{k}(value):\n    \"\"\"Return the value times {k} plus {d}.\"\"\"\n"
                     f"    result = value * {k} + {d}\n    return result\n" for k in range(10))


def _design(split: str, d: int) -> str:
    return "\n".join(f".{split}-btn-{d}-{k} {{\n  color: #{d:02x}{k:02x}aa;\n  padding: {k}px {d}px;\n}}\n"
                     for k in range(10))


DOMAINS = {"movie_dialog": ("chat", _chat), "man_pages": ("agent", _man), "stdlib_code": ("code", _code),
           "web_design": ("design", _design)}


def make_data(root: Path, *, empty: str | None = None, drop_kind: str | None = None) -> Path:
    """A prepared data directory in the reader's format: 4 adapter-domain sources, one base source, 3 labelled sets."""
    manifest: dict = {"format_version": reader.FORMAT_VERSION, "sources": {}, "labelled": {}}
    sources = dict(DOMAINS, novels=("base", lambda split, d: f"Chapter {d} of the {split} book."))
    for name, (kind, make) in sources.items():
        if kind == drop_kind:
            continue
        files = {}
        for split in ("train", "val", "test"):
            docs = [] if name == empty else [{"doc_id": f"{split}doc{d:02d}", "text": make(split, d)}
                                             for d in range(10)]
            if name == "man_pages" and docs:  # a long page split into parts: parts must stay on one side
                docs.append({"doc_id": f"{split}long#p001", "text": make(split, 90)})
                docs.append({"doc_id": f"{split}long#p002", "text": make(split, 91)})
            files[split] = write_jsonl(root / "corpus" / name / f"{split}.jsonl", docs, root)
        manifest["sources"][name] = {"kind": kind, "files": files}
    for name, rows in _labelled_rows().items():
        manifest["labelled"][name] = {"file": write_jsonl(root / "labelled" / f"{name}.jsonl", rows, root)}
    write_json(root / "manifest.json", manifest)
    return root


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def built(data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("routing")
    return out, rd.write_routing_data(data, out, seed=0, per_domain=PER_DOMAIN)


def _docs(data: Path, source: str, split: str) -> set[str]:
    return {f"{source}/{record['doc_id']}" for record in reader.iter_records(data, source, split)}


def test_schema_and_answers(data: Path, built: tuple[Path, dict]) -> None:
    out, manifest = built
    generic, adapter = rd.load_items(out, "generic"), rd.load_items(out, "adapter.jsonl")
    assert generic and adapter
    for item in generic + adapter:
        assert {"id", "task", "query", "options", "answer", "split", "label"} <= set(item)
        assert isinstance(item["query"], str) and 0 < len(item["query"]) <= rd.MAX_QUERY_CHARS
        assert item["split"] in ("train", "val", "test")
        assert len(item["options"]) >= 2 and len(set(item["options"])) == len(item["options"])
        assert 0 <= item["answer"] < len(item["options"])
        if item["task"] in rd.ADAPTER_TASKS:
            assert item["options"][item["answer"]] == rd.ADAPTER_DESCRIPTIONS[item["label"]]
            assert sorted(item["options"]) == sorted(rd.ADAPTER_DESCRIPTIONS.values())
        else:
            assert item["options"][item["answer"]] == rd.LABEL_DESCRIPTIONS[item["task"]][item["label"]]
    assert len({item["id"] for item in generic + adapter}) == len(generic) + len(adapter)
    # every labelled row became one item, in its own split
    for task, rows in _labelled_rows().items():
        got = Counter(item["split"] for item in generic if item["task"] == task)
        assert got == Counter(row["split"] for row in rows)
        assert manifest["counts"]["generic"][task] == dict(sorted(got.items()))
    # a long text is cut at a word boundary
    long_item = next(item for item in generic if item["id"] == "bbc_topic:000000")
    assert len(long_item["query"]) <= rd.MAX_QUERY_CHARS and LONG_TEXT.startswith(long_item["query"])
    assert LONG_TEXT[len(long_item["query"])].isspace()
    # the manifest's hashes are those of the files
    for record in manifest["files"].values():
        assert hashlib.sha256((out / record["path"]).read_bytes()).hexdigest() == record["sha256"]
    assert json.loads((out / "manifest.json").read_text()) == manifest


def test_adapter_descriptions() -> None:
    assert list(rd.ADAPTER_DESCRIPTIONS) == ["L0_chat", "L1_agent", "L2_code", "L3_design"]
    assert len(set(rd.ADAPTER_DESCRIPTIONS.values())) == 4
    for task, described in rd.LABEL_DESCRIPTIONS.items():
        assert len(set(described.values())) == len(described), task
    assert len(rd.LABEL_DESCRIPTIONS["trec_fine"]) == 50


def test_deterministic(data: Path, built: tuple[Path, dict], tmp_path: Path) -> None:
    out, _ = built
    names = ("generic.jsonl", "adapter.jsonl", "manifest.json")
    rd.write_routing_data(data, tmp_path / "same", seed=0, per_domain=PER_DOMAIN)
    assert all((out / n).read_bytes() == (tmp_path / "same" / n).read_bytes() for n in names)
    rd.write_routing_data(data, tmp_path / "same", seed=0, per_domain=PER_DOMAIN)  # rewriting in place: same bytes
    assert all((out / n).read_bytes() == (tmp_path / "same" / n).read_bytes() for n in names)
    rd.write_routing_data(data, tmp_path / "other", seed=1, per_domain=PER_DOMAIN)
    first = {item["id"]: item for item in rd.load_items(out, "generic")}
    second = {item["id"]: item for item in rd.load_items(tmp_path / "other", "generic")}
    assert first.keys() == second.keys()
    assert any(first[i]["options"] != second[i]["options"] for i in first)
    assert all(first[i]["query"] == second[i]["query"] for i in first)
    assert rd.load_items(out, "adapter") != rd.load_items(tmp_path / "other", "adapter")


def test_trec_fine_candidate_sizes(built: tuple[Path, dict]) -> None:
    items = [item for item in rd.load_items(built[0], "generic") if item["task"] == "trec_fine"]
    sizes = Counter(len(item["options"]) for item in items)
    assert min(sizes) >= 2 and max(sizes) <= 50 and len(sizes) >= 10
    for item in rd.load_items(built[0], "generic"):
        if item["task"] != "trec_fine":
            assert len(item["options"]) == len(rd.LABEL_DESCRIPTIONS[item["task"]])


def test_adapter_benchmark_isolated_and_balanced(data: Path, built: tuple[Path, dict]) -> None:
    out, manifest = built
    items = rd.load_items(out, "adapter")
    test_docs = set().union(*(_docs(data, source, "test") for source in DOMAINS))
    val_docs = set().union(*(_docs(data, source, "val") for source in DOMAINS))
    bench = [item for item in items if item["split"] == "test"]
    assert {item["task"] for item in bench} == {rd.BENCHMARK_TASK}
    assert all(item["doc"] in test_docs for item in bench)
    assert Counter(item["label"] for item in bench) == {adapter: PER_DOMAIN for adapter in rd.ADAPTER_DESCRIPTIONS}
    routing = [item for item in items if item["split"] != "test"]
    assert {item["task"] for item in routing} == {rd.ADAPTER_TASK} and all(item["doc"] in val_docs for item in routing)
    by_split = {split: [item for item in routing if item["split"] == split] for split in ("train", "val")}
    for split, got in by_split.items():
        counts = Counter(item["label"] for item in got)
        assert set(counts) == set(rd.ADAPTER_DESCRIPTIONS) and len(set(counts.values())) == 1, (split, counts)
    assert len(by_split["train"]) == 4 * rd.TRAIN_PER_DOMAIN_FACTOR * PER_DOMAIN
    # router train and dev come from different document groups; no query text is used twice anywhere
    groups = {split: {reader.group_of(item["doc"]) for item in got} for split, got in by_split.items()}
    assert not groups["train"] & groups["val"]
    keys = [" ".join(item["query"].split()) for item in items]
    assert len(keys) == len(set(keys))
    assert manifest["counts"]["adapter"] == {rd.ADAPTER_TASK: {"train": len(by_split["train"]),
                                                               "val": len(by_split["val"])},
                                             rd.BENCHMARK_TASK: {"test": 4 * PER_DOMAIN}}


def test_adapter_snippet_shapes(data: Path, built: tuple[Path, dict]) -> None:
    texts = {f"{source}/{record['doc_id']}": record["text"] for source in DOMAINS for split in ("val", "test")
             for record in reader.iter_records(data, source, split)}
    for item in rd.load_items(built[0], "adapter"):
        query, label = item["query"], item["label"]
        assert 1 <= len(query.splitlines()) <= rd.MAX_SNIPPET_LINES
        assert query == query.strip()
        if label == "L0_chat":
            assert "\n" not in query and not query.startswith(("A:", "B:")) and query in texts[item["doc"]]
        elif label == "L1_agent":
            assert query.startswith(("-", "tool"))  # an option entry or a usage line
        else:  # a contiguous run of the document's lines
            source = [line.strip() for line in texts[item["doc"]].splitlines()]
            lines = [line.strip() for line in query.splitlines()]
            assert any(source[i: i + len(lines)] == lines for i in range(len(source)))


def test_recipe_sets(built: tuple[Path, dict]) -> None:
    out, _ = built
    items = rd.load_items(out, "generic") + rd.load_items(out, "adapter")
    generic_train = {item["id"] for item in items if item["task"] not in rd.ADAPTER_TASKS and item["split"] == "train"}
    adapter_train = [item for item in items if item["task"] == rd.ADAPTER_TASK and item["split"] == "train"]

    (a,) = rd.recipe_sets(items, "A", 5)
    assert {item["id"] for item in a} == generic_train
    (b,) = rd.recipe_sets(items, "B", 8)
    assert len(b) == len(generic_train) + 8
    b_adapter = [item for item in b if item["task"] == rd.ADAPTER_TASK]
    assert Counter(item["label"] for item in b_adapter) == {adapter: 2 for adapter in rd.ADAPTER_DESCRIPTIONS}
    stage1, stage2 = rd.recipe_sets(items, "C", 8)
    assert {item["id"] for item in stage1} == generic_train
    assert {item["id"] for item in stage2} == {item["id"] for item in b_adapter}
    # a sweep: smaller sizes are subsets of larger ones; None takes all; the benchmark is never used
    small = {item["id"] for item in rd.recipe_sets(items, "C", 4)[1]}
    assert small < {item["id"] for item in stage2}
    assert len(rd.recipe_sets(items, "C", None)[1]) == len(adapter_train)
    assert all(item["split"] == "train" for stage in rd.recipe_sets(items, "B") for item in stage)
    assert rd.recipe_sets(items, "B", 8) == [b]  # deterministic
    with pytest.raises(rd.RoutingDataError, match="n_adapter"):
        rd.recipe_sets(items, "B", len(adapter_train) + 1)
    with pytest.raises(ValueError, match="recipe"):
        rd.recipe_sets(items, "D")


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(DataNotPrepared, match="manifest.json is missing"):
        rd.write_routing_data(tmp_path / "nowhere", tmp_path / "out")
    with pytest.raises(DataNotPrepared, match="manifest.json is missing"):
        rd.build_adapter_items(tmp_path / "nowhere", 0, 4)
    empty = make_data(tmp_path / "empty", empty="web_design")
    with pytest.raises(rd.RoutingDataError, match="design.*L3_design.*web_design"):
        rd.build_adapter_items(empty, 0, 4)
    missing = make_data(tmp_path / "missing", drop_kind="agent")
    with pytest.raises(rd.RoutingDataError, match="'agent' .*L1_agent"):
        rd.build_adapter_items(missing, 0, 4)
    with pytest.raises(rd.RoutingDataMissing, match=r"python -m build_engines\.routing\.data"):
        rd.load_items(tmp_path / "out", "generic")
    assert not (tmp_path / "out").exists()


def test_cli(data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert rd.main(["--data", str(data), "--out", str(tmp_path / "r"), "--per-domain", "4"]) == 0
    assert "adapter_benchmark" in capsys.readouterr().out
    assert (tmp_path / "r" / "manifest.json").is_file()
    assert rd.main(["--data", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r2")]) == 1
    assert "manifest.json is missing" in capsys.readouterr().err


def test_real_adapter_benchmark(real_data: Path) -> None:
    items = rd.build_adapter_items(real_data, 0, rd.DEFAULT_PER_DOMAIN)
    bench = Counter(item["label"] for item in items if item["task"] == rd.BENCHMARK_TASK)
    assert bench == {adapter: rd.DEFAULT_PER_DOMAIN for adapter in rd.ADAPTER_DESCRIPTIONS}
    names = [source for kind in ("chat", "agent", "code", "design") for source in reader.sources(real_data, kind)]
    test_docs = set().union(*(_docs(real_data, source, "test") for source in names))
    assert all(item["doc"] in test_docs for item in items if item["split"] == "test")
