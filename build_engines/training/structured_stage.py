"""The structured-replies stage: token streams of `structured_data`, and the base's continued training on them.

Continued training updates the decoder only (layers from `n_encoder_layers` on, the final norm, the output head) and
keeps the embedding and the encoder frozen. Why: the router reads H19, the encoder's last output, and every cached
prefix and journaled session is encoder state; a frozen encoder keeps routing exactly as measured and lets the
adapters, which sit on the decoder, be retrained on the new decoder without touching the shared state. The mixture
keeps the pre-training sources beside the structured data, so the base's perplexity on text moves little.

Streams are cached under the work folder keyed by the tokenizer, the seed, the counts and the generator's version,
so a re-run reuses them; the training itself resumes from `train_state.pt` like every other stage (`train.py`).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from build_engines.data.token_data import Mixture
from build_engines.training.reply_weights import ReplyWeights
from build_engines.training.structured_data import KINDS, StructuredData, WordPools, conversations
from build_engines.training.train import TrainSettings, lm_loss, run_training
from ced.model.network import CEDNetwork
from ced.text.chat_format import ChatFormat
from ced.text.tokenizer import ChatTokenizer

GENERATOR_VERSION = 1
STREAM_PREFIX = "structured_"

# What each domain adapter sees of the structured data, besides its domain text (shares within the structured part)
ADAPTER_KINDS = {
    "chat": {"json": 1.0},
    "agent": {"tools": 0.5, "chit_chat": 0.25, "json": 0.25},
    "code": {"json": 0.5, "code": 0.5},
    "design": {"json": 0.5, "css": 0.5},
}
BASE_KINDS = {"json": 0.4, "tools": 0.3, "chit_chat": 0.1, "code": 0.1, "css": 0.1}
AGENT_EXTRA_SHARE = 0.1  # the agent adapter learns tool use besides its domain: a larger structured share


OFF_VALUES = {"object_style_share": 0.0, "reply_weight": 1.0, "first_token_weight": 1.0}  # what the recipe had before


@dataclass(frozen=True)
class StructuredSettings:
    """How much structured data is made, and how the base's continued training mixes it in."""

    counts: dict[str, int] = field(default_factory=lambda: {"json": 20000, "tools": 6000, "chit_chat": 4000,
                                                            "code": 3000, "css": 3000})
    seed: int = 1050
    steps: int = 600
    share: float = 0.5  # of each base batch row drawn from the structured streams
    adapter_share: float = 0.5  # of each adapter batch row (0.6 for the agent adapter, which learns tool use)
    lr: float = 1e-3
    warmup: int = 20
    object_style_share: float = 0.0  # of the JSON replies written as json_object's grammar writes them
    reply_weight: float = 1.0  # loss weight of reply tokens in chat-formatted streams (reply_weights.py; 1: plain)
    first_token_weight: float = 1.0  # and, times reply_weight, of each reply's first token (call or answer)

    def record(self) -> dict:
        """What the base's continued training ran with (the adapters' share is recorded with the adapters: changing
        it retrains them, not the base). Knobs at their off value are left out, so a recipe that does not use them
        keeps the record it had before they existed (the committed default's manifest)."""
        return {k: v for k, v in asdict(self).items() if k != "adapter_share" and not self._off(k, v)} \
            | {"generator_version": GENERATOR_VERSION, "base_kinds": BASE_KINDS}

    def adapter_record(self) -> dict:
        return {"share": self.adapter_share, "agent_share": self.adapter_share + AGENT_EXTRA_SHARE,
                "kinds": ADAPTER_KINDS} | self._loss_weights()

    def _loss_weights(self) -> dict[str, float]:
        """The reply-weight knobs this recipe turns on (empty: plain next-token loss)."""
        knobs = {k: getattr(self, k) for k in ("reply_weight", "first_token_weight")}
        return {k: v for k, v in knobs.items() if not self._off(k, v)}

    @staticmethod
    def _off(key: str, value: object) -> bool:
        return key in OFF_VALUES and value == OFF_VALUES[key]

    def reply_weights(self, special_ids: dict[str, int]) -> ReplyWeights | None:
        """The loss weights of replies for this recipe (None: plain next-token loss)."""
        if not self._loss_weights():
            return None
        return ReplyWeights.from_special_ids(special_ids, self.reply_weight, self.first_token_weight)

    def stream_key(self) -> list:
        """What the structured streams are made from (the style share only where used: the streams of a recipe
        without it keep their cached name)."""
        key: list = [self.seed, self.counts, GENERATOR_VERSION]
        return key + [self.object_style_share] if self.object_style_share else key

    def work_key(self) -> str:
        """Names the stage's resumable state after its record: a changed recipe starts afresh rather than resuming
        (or finding finished) the previous recipe's optimizer state."""
        return _short_digest(self.record())


def _short_digest(value: object) -> str:
    """12 hex digits naming a JSON-able value (key order ignored): the names of cached streams and work folders."""
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:12]


def structured_streams(model_dir: Path, data_dir: Path, cache_dir: Path, settings: StructuredSettings,
                       tokenizer_digest: str) -> dict[str, np.ndarray]:
    """One int32 stream per kind: conversations rendered by the model's chat format (tools where offered),
    documents as <|bos|> text <|eos|>; cached."""
    key = _short_digest([tokenizer_digest, *settings.stream_key()])
    paths = {kind: cache_dir / f"{STREAM_PREFIX}{kind}.{key}.npy" for kind in KINDS}
    if all(p.exists() for p in paths.values()):
        return {f"{STREAM_PREFIX}{k}": np.load(p) for k, p in paths.items()}
    tok = ChatTokenizer.load(model_dir)
    fmt = ChatFormat.load(model_dir)
    pools = WordPools.from_corpora(data_dir, "train")
    cache_dir.mkdir(parents=True, exist_ok=True)
    out = {}
    for i, kind in enumerate(KINDS):
        data = StructuredData(pools, settings.seed * 100 + i, object_style_share=settings.object_style_share)
        ids: list[int] = []
        for tools, item in tqdm(conversations(data, kind, settings.counts[kind]), total=settings.counts[kind],
                                desc=f"structured {kind}", leave=False):
            if isinstance(item, str):
                ids += [tok.bos_id, *tok.encode(item), tok.eos_id]
            else:
                ids += fmt.encode(item, add_generation_prompt=False, tools=tools)
        arr = np.asarray(ids, dtype=np.int32)
        tmp = paths[kind].with_suffix(".tmp.npy")
        np.save(tmp, arr)
        tmp.replace(paths[kind])
        out[f"{STREAM_PREFIX}{kind}"] = arr
    return out


def weighted(streams: dict[str, np.ndarray], kinds: dict[str, float], share: float) -> dict[str, float]:
    """Mixture weights of the structured streams: `share` split by `kinds`."""
    total = sum(kinds.values())
    return {f"{STREAM_PREFIX}{k}": share * w / total for k, w in kinds.items() if f"{STREAM_PREFIX}{k}" in streams}


def adapter_mixture(domain: str, domain_streams: dict[str, np.ndarray], domain_weights: dict[str, float],
                    structured: dict[str, np.ndarray], share: float) -> Mixture:
    """An adapter's data: its domain text, and the structured kinds that belong to its domain."""
    share = share + AGENT_EXTRA_SHARE if domain == "agent" else share
    total = sum(domain_weights.values())
    weights = {s: (1 - share) * w / total for s, w in domain_weights.items()}
    weights |= weighted(structured, ADAPTER_KINDS[domain], share)
    return Mixture({s: (domain_streams | structured)[s] for s in weights}, weights)


def decoder_parameters(net: CEDNetwork) -> list[torch.nn.Parameter]:
    """The decoder's weights (layers from n_encoder_layers on, the final norm, the head); everything else frozen."""
    first = net.cfg.n_encoder_layers
    chosen = []
    for name, p in net.named_parameters():
        trainable = (name.startswith("layers.") and int(name.split(".")[1]) >= first) \
            or name.startswith(("norm.", "head."))
        p.requires_grad_(trainable)
        if trainable:
            chosen.append(p)
    return chosen


def continue_base(net: CEDNetwork, text_mixture: Mixture, structured: dict[str, np.ndarray],
                  settings: StructuredSettings, batch: int, seq_len: int, work_dir: Path, seed: int,
                  reply_weights: ReplyWeights | None = None) -> list[dict]:
    """Continued training of the base's decoder on text and structured data (encoder and embedding frozen);
    `reply_weights`: the recipe's (`StructuredSettings.reply_weights`), None for plain next-token loss."""
    weights = {s: (1 - settings.share) * float(p) for s, p in zip(text_mixture.names, text_mixture.probs)}
    weights |= weighted(structured, BASE_KINDS, settings.share)
    mixture = Mixture(text_mixture.streams | structured, weights)
    params = decoder_parameters(net)
    train = TrainSettings(steps=settings.steps, batch=batch, seq_len=seq_len, lr=settings.lr, warmup=settings.warmup,
                          weight_decay=0.1, seed=seed + 50)
    history = run_training(net, params, mixture, train, work_dir, "base: structured replies",
                           loss_fn=None if reply_weights is None else lambda batch: lm_loss(net, batch, reply_weights))
    for p in net.parameters():
        p.requires_grad_(True)
    return history
