"""Request -> answer pairs for fine-tuning the domain adapters, and the held-out requests that judge them.

The adapters were trained on raw domain text, so a routed question gets a continuation of a man page or a
stylesheet, not an answer. These pairs come from the same structured facts the routing requests use
(`build_engines.routing.request_facts`): the flag and what it does, the function and its signature and docstring,
the property and its values, and for chat a dialogue line answered by the next line of the movie. Requests are
phrased with the routing phrasing banks (`request_phrasings`): training pairs with the **train** bank, evaluation
requests with the **benchmark** bank; facts are split by `answer_facts` (train vs test documents, and held-out key
strings never trained on). Everything is seeded: the same prepared data and seed give the same pairs byte for byte.

Answers start with the key fact (the option, command, function name or property, as the request names it) and
then say what it does, in a handful of seeded answer shapes per domain: the adapter learns to pick up what the
request is about and answer about it, rather than to recite one sentence.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from pathlib import Path
from typing import Any, Callable

from build_engines.data.corpora import reader
from build_engines.routing.request_facts import EXTRACTORS, Fact
from build_engines.routing.request_phrasings import TEMPLATES
from build_engines.routing.requests import render, template_fields
from build_engines.training.answer_facts import (
    HELDOUT_SHARE,
    dialogue_pairs,
    is_heldout,
    key_field,
    key_hit,
    normalised,
    trainable,
)

FORMAT_VERSION = 4  # bump when the pairs change for the same data and seed (written files are then rebuilt)
ADAPTERS = {"chat": "L0_chat", "agent": "L1_agent", "code": "L2_code", "design": "L3_design"}
DEFAULT_TRAIN_PER_DOMAIN = 1500
DEFAULT_EVAL_PER_DOMAIN = 48
ATTEMPTS_PER_ITEM = 40
PAIRS_FILE, EVAL_FILE, SEEN_FILE, MANIFEST_FILE = "pairs.jsonl", "eval.jsonl", "eval_seen.jsonl", "manifest.json"
# Fact fields a template may name; a template that names none of them (e.g. "center a {element}") says nothing
# about the fact, so it is skipped here.
FACT_FIELDS = frozenset({"cmd", "summary", "usage", "option", "option_desc", "option2", "module", "name", "kind",
                         "args", "purpose", "snippet", "property", "value", "selector", "phrase", "utterance"})


# ------------------------------------------------------------------------------------------------------ answers
def _agent_answer(fact: Fact, fields: set[str], rng: random.Random) -> str:
    cmd, summary, usage = fact["cmd"], fact["summary"], fact["usage"]
    if key_field("agent", fields) == "cmd" or not fact.get("option"):
        shapes = [f"{cmd}: it is used to {summary}. Usage: {usage}",
                  f"{cmd} - {summary}. Usage:\n{usage}",
                  f"{cmd} is the command: it is used to {summary}; for example: {usage}"]
        return rng.choice(shapes)
    option = fact["option"]
    does = (f"it will {fact['option_desc']}" if fact.get("option_desc")
            else f"it is an option of {cmd}, which is used to {summary}")
    shapes = [f"{option}: {does}. For example: {cmd} {option}",
              f"{option} ({cmd}) - {does}.",
              f"{option} is an option of {cmd}: {does}. Usage: {usage}"]
    answer = rng.choice(shapes)
    if "option2" in fields and fact.get("option2"):
        answer += f" {fact['option2']} is another option of {cmd}."
    return answer


def _code_answer(fact: Fact, fields: set[str], rng: random.Random) -> str:
    module, name, kind, args = fact["module"], fact["name"], fact["kind"], fact["args"]
    does = f"it will {fact['purpose']}" if fact.get("purpose") else f"it is a {kind} of the {module} module"
    where = f"a method defined in {module}" if fact.get("method") else f"a {kind} of the {module} module"
    shapes = [f"{name}({args}) is {where}: {does}.",
              f"{name} from {module}: `{name}({args})`; {does}.",
              f"{name}({args}) in {module} - {does}. Its definition:\n{fact['snippet']}"]
    if not fact.get("method"):
        shapes.append(f"{name}: `{module}.{name}({args})`, {does}.\n```python\nfrom {module} import {name}\n```")
    return rng.choice(shapes)


def _design_answer(fact: Fact, fields: set[str], rng: random.Random) -> str:
    prop, value, selector, phrase = fact["property"], fact["value"], fact["selector"], fact["phrase"]
    shapes = [f"{prop}: it sets {phrase}. For example:\n{selector} {{\n  {prop}: {value};\n}}",
              f"{prop}: {value} sets {phrase} on {selector}.",
              f"{prop} controls {phrase}; {value} is one of its values:\n{selector} {{ {prop}: {value}; }}"]
    return rng.choice(shapes)


def _chat_answer(fact: Fact, fields: set[str], rng: random.Random) -> str:
    return fact["reply"]


ANSWERS: dict[str, Callable[[Fact, set[str], random.Random], str]] = {
    "agent": _agent_answer, "code": _code_answer, "design": _design_answer, "chat": _chat_answer}


# -------------------------------------------------------------------------------------------------------- facts
def split_facts(data_dir: Path, kind: str, split: str) -> list[tuple[str, list[Fact]]]:
    """(doc_id, facts) per document of the kind's sources in `split`; chat training facts are dialogue pairs
    (utterance + next line), every other set uses the routing extractors."""
    extract = dialogue_pairs if kind == "chat" and split == "train" else EXTRACTORS[kind]
    out = []
    for source in reader.sources(data_dir, kind):
        for record in reader.iter_records(data_dir, source, split):
            doc_id = f"{source}/{record['doc_id']}"
            facts = [{**f, "doc": doc_id} for f in extract(record["doc_id"], record["text"])]
            if facts:
                out.append((doc_id, facts))
    return out


def _usable_templates(bank: str, kind: str) -> list[tuple[int, str]]:
    """(index, template) of the bank's templates for `kind` that name a fact field (chat: the utterance)."""
    need = {"utterance"} if kind == "chat" else FACT_FIELDS
    return [(i, t) for i, t in enumerate(TEMPLATES[bank][kind]) if set(template_fields(t)) & need]


def draw(docs: list[tuple[str, list[Fact]]], kind: str, bank: str, n: int, rng: random.Random,
         accept: Callable[[Fact, set[str]], bool]) -> list[tuple[Fact, str, int]]:
    """Up to `n` distinct (fact, request, template index): a document (weight sqrt of its facts), a fact, a
    template; kept when the template renders and `accept(fact, template fields)` holds."""
    templates = _usable_templates(bank, kind)
    if not docs or not templates:
        return []
    cumulative, total = [], 0.0
    for _, facts in docs:
        total += math.sqrt(len(facts))
        cumulative.append(total)
    out: list[tuple[Fact, str, int]] = []
    taken: set[str] = set()
    for _ in range(n * ATTEMPTS_PER_ITEM):
        _, facts = docs[min(bisect.bisect_left(cumulative, rng.random() * total), len(docs) - 1)]
        fact = facts[rng.randrange(len(facts))]
        index, template = templates[rng.randrange(len(templates))]
        fields = set(template_fields(template))
        if not accept(fact, fields):
            continue
        request = render(template, fact, bank, rng)
        if request is None or normalised(request) in taken:
            continue
        taken.add(normalised(request))
        out.append((fact, request, index))
        if len(out) == n:
            break
    return out


# ------------------------------------------------------------------------------------------------------- build
def build_answer_data(data_dir: str | Path, seed: int = 0, train_per_domain: int = DEFAULT_TRAIN_PER_DOMAIN,
                      eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN) -> dict[str, Any]:
    """{"train": pairs, "eval": held-out requests, "seen": test-document requests whose key was trained on (a
    diagnostic, not the goal; no chat), "manifest": how they were made and kept apart, "train_facts": the fact
    behind each pair (in memory only: what the tests check the split on)}."""
    data_dir = Path(data_dir)
    reader.load_manifest(data_dir)
    train: list[dict[str, Any]] = []
    train_facts: list[Fact] = []
    evaluation: list[dict[str, Any]] = []
    seen: list[dict[str, Any]] = []
    record: dict[str, Any] = {"domains": {}}
    for kind, adapter in ADAPTERS.items():
        test_docs = split_facts(data_dir, kind, "test")

        def eval_ok(fact: Fact, fields: set[str], kind: str = kind) -> bool:
            key = fact.get(key_field(kind, fields), "")
            return bool(key) and (kind == "chat" or is_heldout(key, seed, kind))

        rng = random.Random(f"{seed}:answers:eval:{kind}")
        for i, (fact, request, index) in enumerate(draw(test_docs, kind, "benchmark", eval_per_domain, rng, eval_ok)):
            fields = set(template_fields(TEMPLATES["benchmark"][kind][index]))
            key = fact[key_field(kind, fields)]
            evaluation.append({"id": f"answers:eval:{adapter}:{i:04d}", "domain": kind, "adapter": adapter,
                               "request": request, "key": key, "key_field": key_field(kind, fields),
                               "named": key_hit(kind, key, request), "doc": fact["doc"],
                               "template": f"benchmark/{kind}/{index}"})
        test_utterances = {normalised(f["utterance"]) for _, facts in test_docs for f in facts if "utterance" in f}
        train_docs = split_facts(data_dir, kind, "train")

        def train_ok(fact: Fact, fields: set[str], kind: str = kind) -> bool:
            if kind == "chat":
                return not {normalised(fact["utterance"]), normalised(fact["reply"])} & test_utterances
            return trainable(kind, fact, seed)

        rng = random.Random(f"{seed}:answers:train:{kind}")
        drawn = draw(train_docs, kind, "train", train_per_domain, rng, train_ok)
        for i, (fact, request, index) in enumerate(drawn):
            fields = set(template_fields(TEMPLATES["train"][kind][index]))
            train.append({"id": f"answers:train:{adapter}:{i:05d}", "domain": kind, "adapter": adapter,
                          "request": request, "answer": ANSWERS[kind](fact, fields, rng),
                          "key": fact[key_field(kind, fields)], "doc": fact["doc"],
                          "template": f"train/{kind}/{index}"})
            train_facts.append(fact)
        if kind != "chat":  # a diagnostic beside the goal: test-document requests whose key *was* trained on
            trained = {p["key"] for p in train if p["domain"] == kind}

            def seen_ok(fact: Fact, fields: set[str], kind: str = kind, trained: set[str] = trained) -> bool:
                return fact.get(key_field(kind, fields), "") in trained

            rng = random.Random(f"{seed}:answers:seen:{kind}")
            for i, (fact, request, index) in enumerate(draw(test_docs, kind, "benchmark", eval_per_domain, rng,
                                                            seen_ok)):
                fields = set(template_fields(TEMPLATES["benchmark"][kind][index]))
                key = fact[key_field(kind, fields)]
                seen.append({"id": f"answers:seen:{adapter}:{i:04d}", "domain": kind, "adapter": adapter,
                             "request": request, "key": key, "key_field": key_field(kind, fields),
                             "named": key_hit(kind, key, request), "doc": fact["doc"],
                             "template": f"benchmark/{kind}/{index}"})
        record["domains"][kind] = {
            "adapter": adapter,
            "train_pairs": len(drawn),
            "eval_requests": sum(e["domain"] == kind for e in evaluation),
            "eval_key_named_in_request": sum(e["domain"] == kind and e["named"] for e in evaluation),
            "train_documents": len({f["doc"] for f, _, _ in drawn}),
            "eval_documents": len({e["doc"] for e in evaluation if e["domain"] == kind}),
        }
    record.update(_separation(train, evaluation, seed))
    record.update({
        "generator": "build_engines.training.answer_pairs (facts: routing.request_facts + answer_facts.dialogue_pairs)",
        "seed": seed, "heldout_share": HELDOUT_SHARE, "train_per_domain": train_per_domain,
        "eval_per_domain": eval_per_domain,
        "split": "train pairs: train documents, phrasing bank 'train', facts with no held-out key (hash of seed, "
                 "domain and key < heldout_share); eval requests: test documents, phrasing bank 'benchmark', facts "
                 "whose key is held out (chat: utterances of test dialogues; training pairs equal to one are dropped)",
        "key": "agent: the option when the request names one, else the command; code: the function or class name; "
               "design: the property; chat: any content word of the utterance",
        "answers_sha256": hashlib.sha256(json.dumps([p["answer"] for p in train]).encode()).hexdigest(),
    })
    record["seen_requests"] = {kind: sum(e["domain"] == kind for e in seen) for kind in ADAPTERS if kind != "chat"}
    return {"train": train, "eval": evaluation, "seen": seen, "manifest": record, "train_facts": train_facts}


def _separation(train: list[dict[str, Any]], evaluation: list[dict[str, Any]], seed: int) -> dict[str, Any]:
    """Counts that show the split holds: documents and keys shared by training pairs and evaluation requests."""
    shared_docs = {p["doc"] for p in train} & {e["doc"] for e in evaluation}
    keys = {(e["domain"], e["key"]) for e in evaluation if e["domain"] != "chat"}
    trained_keys = {(p["domain"], p["key"]) for p in train if p["domain"] != "chat"}
    return {"shared_documents": len(shared_docs), "eval_keys_in_training_keys": len(keys & trained_keys),
            "eval_keys": len(keys)}


def write_answer_data(data_dir: str | Path, out_dir: str | Path, seed: int = 0,
                      train_per_domain: int = DEFAULT_TRAIN_PER_DOMAIN,
                      eval_per_domain: int = DEFAULT_EVAL_PER_DOMAIN) -> dict[str, Any]:
    """Build the pairs once into `out_dir` (pairs.jsonl, eval.jsonl, manifest.json); a re-run with the same
    settings and data reads them back instead of rebuilding."""
    out_dir = Path(out_dir)
    settings = {"format_version": FORMAT_VERSION, "seed": seed, "train_per_domain": train_per_domain,
                "eval_per_domain": eval_per_domain,
                "data_manifest_sha256": hashlib.sha256((Path(data_dir) / "manifest.json").read_bytes()).hexdigest()}
    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.exists() and json.loads(manifest_path.read_text()).get("settings") == settings:
        return load_answer_data(out_dir)
    data = build_answer_data(data_dir, seed, train_per_domain, eval_per_domain)
    data.pop("train_facts")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, rows in ((PAIRS_FILE, data["train"]), (EVAL_FILE, data["eval"]), (SEEN_FILE, data["seen"])):
        (out_dir / name).write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    files = {name: hashlib.sha256((out_dir / name).read_bytes()).hexdigest()
             for name in (PAIRS_FILE, EVAL_FILE, SEEN_FILE)}
    manifest = {"settings": settings, **data["manifest"], "files_sha256": files}
    manifest_path.write_text(json.dumps(manifest, indent=1) + "\n")
    return {**data, "manifest": manifest}


def load_answer_data(out_dir: str | Path) -> dict[str, Any]:
    """The pairs, evaluation requests and manifest written by `write_answer_data`."""
    out_dir = Path(out_dir)

    def rows(name: str) -> list[dict[str, Any]]:
        return [json.loads(line) for line in (out_dir / name).read_text().splitlines() if line]

    return {"train": rows(PAIRS_FILE), "eval": rows(EVAL_FILE), "seen": rows(SEEN_FILE),
            "manifest": json.loads((out_dir / MANIFEST_FILE).read_text())}
