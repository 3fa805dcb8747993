"""Request-style routing items and the natural-request benchmark: facts read from each domain's structure, the
two phrasing banks kept apart, the benchmark drawn only from test documents with benchmark phrasings, balance,
determinism, the manifest record; checks on the real `artifacts/data` (prepared for them: tests/real_data.py)."""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import pytest

from build_engines.data.corpora import reader
from build_engines.routing import data as rd
from build_engines.routing import request_facts as rf
from build_engines.routing import requests as rq
from build_engines.routing.request_phrasings import BANKS, CLOSERS, OPENERS, SLOTS, TEMPLATES
from tests.build_engines.routing.test_routing_data import DOMAINS, PER_DOMAIN, make_data
from tests.tiny import PROJECT_ROOT

MAN = """NAME
    uniq - report or omit repeated lines

SYNOPSIS
    uniq [OPTION]... [INPUT [OUTPUT]]

DESCRIPTION
    -c, --count
        prefix lines by the number of occurrences

    -D
        print all duplicate lines

    -s, --skip-chars=N
        avoid comparing the first N characters
"""

CODE = '''class Tree:
    """A tree of nodes."""

    def walk(self, order="pre"):
        """Returns an iterator over the nodes. More text."""
        return iter(self)

    def _hidden(self):
        """Not public."""


def undocumented(x):
    return x
'''

CSS = """.btn-primary,
.btn-main {
  display: flex;
  justify-content: center;
  color: $brand;
  padding: 4px 8px;
}
@mixin thing {
  margin: 0;
}
"""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("data"))


@pytest.fixture(scope="module")
def items(data: Path) -> list[dict]:
    return rq.build_request_items(data, rd.ADAPTER_DESCRIPTIONS, rd.ADAPTER_KINDS, 0, 40, PER_DOMAIN)


def test_man_facts_read_name_usage_and_options() -> None:
    facts = rf.man_facts("coreutils/uniq.1", MAN)
    assert {f["option"] for f in facts} == {"-c", "-D", "-s"}
    assert all(f["cmd"] == "uniq" and f["summary"] == "report or omit repeated lines" for f in facts)
    assert facts[0]["usage"] == "uniq [OPTION]... [INPUT [OUTPUT]]"
    by_flag = {f["option"]: f for f in facts}
    assert by_flag["-D"]["option_desc"] == "print all duplicate lines"
    assert by_flag["-s"]["option_desc"] == "avoid comparing the first N characters"
    assert by_flag["-c"]["option2"] == "-D"
    git = rf.man_facts("git-man/git-log.1",
                       "NAME\n    git-log - Show commit logs\n\nSYNOPSIS\n    git log [<options>]\n")
    assert git == [{"cmd": "git log", "summary": "show commit logs", "usage": "git log [<options>]",
                    "doc": "git-man/git-log.1"}]


def test_code_facts_keep_public_documented_definitions() -> None:
    facts = rf.code_facts("email/header#p002", CODE)
    assert [(f["name"], f["kind"]) for f in facts] == [("Tree", "class"), ("walk", "function")]
    walk = facts[1]
    assert walk["module"] == "email.header" and walk["args"] == "order" and walk["method"] == "yes"
    assert walk["purpose"] == "return an iterator over the nodes"  # verb phrase from "Returns ..."
    assert facts[0]["purpose"] == ""  # a class docstring describes, it does not say what to do
    assert walk["snippet"].startswith("def walk(self")


def test_css_facts_take_literal_declarations_of_known_properties() -> None:
    facts = rf.css_facts("x.scss", CSS)
    assert [(f["property"], f["value"]) for f in facts] == [("display", "flex"), ("justify-content", "center"),
                                                           ("padding", "4px 8px")]  # $brand and @mixin skipped
    assert {f["selector"] for f in facts} == {".btn-main"}
    assert facts[1]["phrase"] == rf.CSS_PROPERTY_PHRASES["justify-content"]


def test_chat_facts_are_utterances_without_speakers() -> None:
    facts = rf.chat_facts("d1", "A: how are you doing today?\nB: ok.\n\nA: i can't believe you did that to me")
    assert [f["utterance"] for f in facts] == ["how are you doing today?", "i can't believe you did that to me"]


def test_verb_phrase() -> None:
    assert rf.as_verb_phrase("Returns the size") == "return the size"
    assert rf.as_verb_phrase("Matches the pattern") == "match the pattern"
    assert rf.as_verb_phrase("minimum contiguous free range") == ""
    assert rf.as_verb_phrase("The file to read") == ""


def test_phrasing_banks_are_disjoint() -> None:
    assert BANKS == ("train", "benchmark")
    for kind in TEMPLATES["train"]:
        assert not set(TEMPLATES["train"][kind]) & set(TEMPLATES["benchmark"][kind]), kind
        normalise = {" ".join(t.lower().split()) for t in TEMPLATES["train"][kind]}
        assert not normalise & {" ".join(t.lower().split()) for t in TEMPLATES["benchmark"][kind]}, kind
    for table in (OPENERS, CLOSERS):
        assert not (set(table["train"]) - {""}) & (set(table["benchmark"]) - {""})
    for slot in SLOTS["train"]:
        assert not set(SLOTS["train"][slot]) & set(SLOTS["benchmark"][slot]), slot
    # every field a template names is one a fact or a slot provides
    provided = {"cmd", "summary", "usage", "option", "option_desc", "option2", "module", "name", "kind", "args",
                "purpose", "snippet", "property", "value", "selector", "phrase", "utterance"}
    for bank in BANKS:
        for kind, templates in TEMPLATES[bank].items():
            for template in templates:
                assert set(rq.template_fields(template)) <= provided | set(SLOTS[bank]), (bank, kind, template)


def test_render_needs_every_field() -> None:
    rng = random.Random(0)
    assert rq.render("what does {option} of {cmd} do?", {"cmd": "ls", "option": ""}, "train", rng) is None
    text = rq.render("what does {option} of {cmd} do?", {"cmd": "ls", "option": "-l"}, "train", rng)
    assert text is not None and "what does -l of ls do?" in text.lower()


def test_items_balanced_isolated_and_phrased_by_their_bank(data: Path, items: list[dict]) -> None:
    train = [i for i in items if i["task"] == rq.REQUEST_TASK]
    bench = [i for i in items if i["task"] == rq.REQUEST_BENCHMARK_TASK]
    assert Counter(i["label"] for i in bench) == {a: PER_DOMAIN for a in rd.ADAPTER_DESCRIPTIONS}
    counts = Counter(i["label"] for i in train)
    assert set(counts) == set(rd.ADAPTER_DESCRIPTIONS) and len(set(counts.values())) == 1
    train_docs = set().union(*(_docs(data, source, "train") for source in DOMAINS))
    test_docs = set().union(*(_docs(data, source, "test") for source in DOMAINS))
    assert all(i["doc"] in train_docs and i["split"] == "train" for i in train)
    assert all(i["doc"] in test_docs and i["split"] == "test" for i in bench)
    assert all(i["template"].startswith("train/") for i in train)
    assert all(i["template"].startswith("benchmark/") for i in bench)
    keys = [" ".join(i["query"].lower().split()) for i in items]
    assert len(keys) == len(set(keys))
    for item in items:
        assert item["options"][item["answer"]] == rd.ADAPTER_DESCRIPTIONS[item["label"]]
        assert 0 < len(item["query"]) <= rq.MAX_REQUEST_CHARS
    # the template index recorded is the phrasing used (its fixed words are in the query)
    for item in bench[:20]:
        bank, kind, index = item["template"].split("/")
        template = TEMPLATES[bank][kind][int(index)]
        fixed = [part for part, *_ in __import__("string").Formatter().parse(template) if part.strip()]
        assert all(part.strip().lower() in item["query"].lower() for part in fixed), (template, item["query"])


def test_written_with_the_routing_data_and_recorded(data: Path, tmp_path: Path) -> None:
    manifest = rd.write_routing_data(data, tmp_path / "a", 0, PER_DOMAIN, request_train_per_domain=40,
                                     request_bench_per_domain=PER_DOMAIN)
    rows = rd.load_items(tmp_path / "a", "requests")
    assert manifest["counts"]["requests"][rq.REQUEST_BENCHMARK_TASK] == {"test": 4 * PER_DOMAIN}
    record = manifest["requests"]
    assert record["phrasings_sha256"] == rq.phrasing_digest() and record["documents"]["shared"] == 0
    assert record["templates"]["benchmark"]["agent"] == len(TEMPLATES["benchmark"]["agent"])
    rd.write_routing_data(data, tmp_path / "b", 0, PER_DOMAIN, request_train_per_domain=40,
                          request_bench_per_domain=PER_DOMAIN)
    assert (tmp_path / "a" / "requests.jsonl").read_bytes() == (tmp_path / "b" / "requests.jsonl").read_bytes()
    other = rq.build_request_items(data, rd.ADAPTER_DESCRIPTIONS, rd.ADAPTER_KINDS, 1, 40, PER_DOMAIN)
    assert [i["query"] for i in other] != [i["query"] for i in rows]


def test_a_domain_without_facts_is_an_error(tmp_path: Path) -> None:
    empty = make_data(tmp_path / "empty", empty="web_design")
    with pytest.raises(rq.RequestDataError, match="L3_design"):
        rq.build_request_items(empty, rd.ADAPTER_DESCRIPTIONS, rd.ADAPTER_KINDS, 0, 4, 4)


def _docs(data: Path, source: str, split: str) -> set[str]:
    return {f"{source}/{record['doc_id']}" for record in reader.iter_records(data, source, split)}


def test_real_natural_request_benchmark(real_data: Path) -> None:
    """The shipped settings give >= 200 balanced benchmark requests, all from test documents, none equal to a
    training request, and training requests only from train documents."""
    got = rq.build_request_items(real_data, rd.ADAPTER_DESCRIPTIONS, rd.ADAPTER_KINDS, 0, 200,
                                 rq.DEFAULT_REQUEST_BENCH_PER_DOMAIN)
    bench = [i for i in got if i["task"] == rq.REQUEST_BENCHMARK_TASK]
    assert len(bench) >= 200
    assert Counter(i["label"] for i in bench) == {a: rq.DEFAULT_REQUEST_BENCH_PER_DOMAIN
                                                  for a in rd.ADAPTER_DESCRIPTIONS}
    names = [source for kind in rd.ADAPTER_KINDS.values() for source in reader.sources(real_data, kind)]
    test_docs = set().union(*(_docs(real_data, name, "test") for name in names))
    train_docs = set().union(*(_docs(real_data, name, "train") for name in names))
    assert all(i["doc"] in test_docs for i in bench)
    assert all(i["doc"] in train_docs for i in got if i["task"] == rq.REQUEST_TASK)
    train_keys = {" ".join(i["query"].lower().split()) for i in got if i["task"] == rq.REQUEST_TASK}
    assert not any(" ".join(i["query"].lower().split()) in train_keys for i in bench)
    assert json.dumps(bench[0])  # plain JSON


def test_play_facts_for_the_zero_shot_domain() -> None:
    text = ("ORLANDO.\nI am no villain: I am the youngest son of Sir Rowland.\n\nADAM.\n"
            "[Coming forward] Sweet masters, be patient for your father's sake.\n\nOLIVER.\nLet go.\n")
    facts = rf.play_facts("as_you_like_it#p001", text)
    assert [(f["play"], f["character"]) for f in facts] == [("As You Like It", "Orlando"), ("As You Like It", "Adam")]
    assert facts[1]["line"].startswith("Sweet masters")  # stage direction dropped; "Let go." is too short


def test_real_zero_shot_requests(real_data: Path) -> None:
    got = rq.zero_shot_requests(real_data, "shakespeare", "drama", "L4_drama", 50)
    test_docs = _docs(real_data, "shakespeare", "test")
    assert len(got) == 50 and all(i["doc"] in test_docs and i["label"] == "L4_drama" for i in got)
    assert len({i["query"] for i in got}) == 50


_RENDER_ALL = """
import random
from build_engines.routing import requests as rq
from build_engines.routing.request_phrasings import TEMPLATES
fields = {f for bank in TEMPLATES.values() for ts in bank.values() for t in ts for f in rq.template_fields(t)}
fact = {f: f.upper() for f in fields}
rng = random.Random(0)
for bank, kinds in sorted(TEMPLATES.items()):
    for kind, templates in sorted(kinds.items()):
        for template in templates:
            print(rq.render(template, fact, bank, rng))
"""


def test_rendering_does_not_depend_on_the_process_hash_seed() -> None:
    """A template's slots are drawn in a fixed order: the request files were once different on every run, because
    the fields came from a set (string hashes are randomised per process)."""
    import os
    import subprocess
    import sys

    outputs = [subprocess.run([sys.executable, "-c", _RENDER_ALL], capture_output=True, text=True, check=True,
                              cwd=PROJECT_ROOT,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")]
    assert outputs[0] and outputs[0] == outputs[1] == outputs[2]
