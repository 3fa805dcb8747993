"""Request -> answer pairs: reproducible, held-out keys and documents never trained on, the served chat format, and
the key-fact check. On a tiny prepared data directory written here in the reader's format."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from build_engines.data.corpora import reader
from build_engines.data.corpora.output import write_json, write_jsonl
from build_engines.routing.request_facts import CSS_PROPERTY_PHRASES
from build_engines.training import answer_facts as af
from build_engines.training import answer_pairs as ap
from build_engines.training.answer_tuning import encode_pair
from ced.text.tokenizer import Message, train_tokenizer

PROPS = sorted(CSS_PROPERTY_PHRASES)[:24]
WORDS = ["weather", "dinner", "money", "horse", "letter", "garden", "train", "music", "doctor", "party"]


def _chat(split: str, d: int) -> str:
    return "\n\n".join(f"A: did you see the {split} {WORDS[k]} number {d} yesterday?\n"
                       f"B: the {WORDS[k]} was lovely, {split} friend {d}." for k in range(len(WORDS)))


def _man(split: str, d: int) -> str:
    options = "\n\n".join(f"    -{chr(97 + k)}, --{split}-opt{d}-{k}\n"
                          f"        print the {split} value {d} {k} for the tool"
                          for k in range(12))
    return (f"NAME\n    {split}tool{d} - does {split} things\n\nSYNOPSIS\n    {split}tool{d} [OPTION]... FILE\n\n"
            f"OPTIONS\n{options}\n")


def _code(split: str, d: int) -> str:
    return "\n".join(f"def {split}_func_{d}_{k}(value, other):\n    \"\"\"Return the value times {k} plus {d}.\"\"\"\n"
                     f"    return value * {k} + {d}\n" for k in range(10))


def _design(split: str, d: int) -> str:
    return "\n".join(f".{split}-box-{d}-{k} {{\n  {prop}: {k + 1}px;\n}}\n" for k, prop in enumerate(PROPS))


SOURCES = {"movie_dialog": ("chat", _chat), "man_pages": ("agent", _man), "stdlib_code": ("code", _code),
           "web_design": ("design", _design)}


def make_data(root: Path) -> Path:
    manifest: dict = {"format_version": reader.FORMAT_VERSION, "sources": {}, "labelled": {}}
    for name, (kind, make) in SOURCES.items():
        files = {split: write_jsonl(root / "corpus" / name / f"{split}.jsonl",
                                    [{"doc_id": f"{split}doc{d:02d}", "text": make(split, d)} for d in range(8)], root)
                 for split in ("train", "val", "test")}
        manifest["sources"][name] = {"kind": kind, "files": files}
    write_json(root / "manifest.json", manifest)
    return root


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("answers-data"))


@pytest.fixture(scope="module")
def built(data_dir: Path) -> dict:
    return ap.build_answer_data(data_dir, seed=0, train_per_domain=60, eval_per_domain=12)


def test_every_domain_has_pairs_and_heldout_requests(built: dict) -> None:
    for kind, name in ap.ADAPTERS.items():
        assert sum(p["adapter"] == name for p in built["train"]) == 60, kind
        assert sum(e["adapter"] == name for e in built["eval"]) == 12, kind
        assert all(p["answer"] and p["request"] for p in built["train"])


def test_heldout_facts_are_never_trained_on(built: dict) -> None:
    eval_keys = {(e["domain"], e["key"]) for e in built["eval"]}
    for pair, fact in zip(built["train"], built["train_facts"]):
        kind = pair["domain"]
        if kind == "chat":
            continue
        identity = {fact.get(f) for f in af.IDENTITY_FIELDS[kind]} - {None, ""}
        assert not {(kind, value) for value in identity} & eval_keys, (pair, fact)
        assert not any(af.is_heldout(value, 0, kind) for value in identity)
    for e in built["eval"]:
        if e["domain"] != "chat":
            assert af.is_heldout(e["key"], 0, e["domain"])
    # the diagnostic "seen" requests are about keys training pairs do contain, from test documents
    trained = {(p["domain"], p["key"]) for p in built["train"]}
    assert built["seen"] and all((e["domain"], e["key"]) in trained for e in built["seen"])
    assert all(e["doc"].split("/")[1].startswith("test") for e in built["seen"])
    # held-out requests come from test documents, pairs from train documents, and nothing is shared
    assert all(e["doc"].split("/")[1].startswith("test") for e in built["eval"])
    assert all(p["doc"].split("/")[1].startswith("train") for p in built["train"])
    assert built["manifest"]["shared_documents"] == 0 and built["manifest"]["eval_keys_in_training_keys"] == 0
    # chat: no training utterance or reply is a held-out utterance
    heldout = {af.normalised(e["key"]) for e in built["eval"] if e["domain"] == "chat"}
    chat = [f for p, f in zip(built["train"], built["train_facts"]) if p["domain"] == "chat"]
    assert chat and not {af.normalised(f["utterance"]) for f in chat} & heldout


def test_seeded_and_reproducible(data_dir: Path, tmp_path: Path) -> None:
    first = ap.write_answer_data(data_dir, tmp_path / "a", seed=0, train_per_domain=60, eval_per_domain=12)
    second = ap.write_answer_data(data_dir, tmp_path / "b", seed=0, train_per_domain=60, eval_per_domain=12)
    for name in (ap.PAIRS_FILE, ap.EVAL_FILE, ap.SEEN_FILE):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert first["manifest"]["files_sha256"] == second["manifest"]["files_sha256"]
    again = ap.write_answer_data(data_dir, tmp_path / "a", seed=0, train_per_domain=60, eval_per_domain=12)
    assert again["train"] == first["train"]  # read back, not rebuilt
    other = ap.build_answer_data(data_dir, seed=1, train_per_domain=60, eval_per_domain=12)
    assert [p["request"] for p in other["train"]] != [p["request"] for p in first["train"]]
    digest = hashlib.sha256((tmp_path / "a" / ap.PAIRS_FILE).read_bytes()).hexdigest()
    assert first["manifest"]["files_sha256"][ap.PAIRS_FILE] == digest


def test_answers_lead_with_the_fact(built: dict) -> None:
    for pair in built["train"]:
        if pair["domain"] != "chat":
            assert af.key_hit(pair["domain"], pair["key"], pair["answer"]), pair


def test_pairs_are_tokenized_as_the_server_feeds_the_decoder(tmp_path: Path) -> None:
    from tritonserver_backend.core.text_service import TextService

    texts = ["what does the -r option of grep do? it searches recursively", "hello there, how are you"] * 20
    tok = train_tokenizer(texts, 300, tmp_path / "tokenizer.json")
    ids, mask = encode_pair(tok, "what does -r do?", "it searches recursively", 512)
    turn, prefix, _ = TextService(tmp_path).preprocess("what does -r do?", True, None)
    served = [*prefix.tolist(), *turn.tolist()]
    assert ids[:len(served)] == served and sum(mask[:len(served)]) == 0
    answer = ids[len(served):]
    assert answer[-1] == tok.end_of_turn_id and all(mask[len(served):])
    assert tok.decode(answer) == "it searches recursively"
    assert served == tok.chat([Message("user", "what does -r do?")])
    short_ids, short_mask = encode_pair(tok, "what does -r do?", "it searches recursively", 8)
    assert len(short_ids) == len(short_mask) == 8


def test_key_hit_is_a_whole_token() -> None:
    assert af.key_hit("agent", "-s", "use grep -s here")
    assert not af.key_hit("agent", "-s", "use grep --size here")
    assert not af.key_hit("design", "top", "a top-level rule")
    assert af.key_hit("design", "top", "set top: 0;")
    assert af.key_hit("code", "walk", "`walk(order)` returns")
    assert not af.key_hit("code", "walk", "walker and sidewalk")
    assert af.key_hit("chat", "did you feed the horse yesterday?", "The horse ate already.")
    assert not af.key_hit("chat", "did you feed the horse yesterday?", "what did you say?")


def test_dialogue_pairs_keep_replies_that_relate() -> None:
    text = "A: did you see the horse today?\nB: the horse was lovely.\n\nA: where is my letter now?\nB: no idea at all."
    pairs = af.dialogue_pairs("d", text)
    assert [(p["utterance"], p["reply"]) for p in pairs] == [("did you see the horse today?", "the horse was lovely.")]
