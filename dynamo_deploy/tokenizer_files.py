"""The model folder Dynamo's OpenAI frontend reads (tokenizer.json, tokenizer_config.json, config.json), generated
from ours so the frontend's chat template yields exactly the ids `ChatTokenizer.chat` yields.

The frontend tokenizes the rendered template with the HF tokenizer: the role markers are added tokens there, and
text between them is byte-level BPE as in `ChatTokenizer.encode`, so both give the same ids for ordinary text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from build_engines.data.tokenizer import ASSISTANT, BOS, END_OF_TURN, EOS, PAD, ChatTokenizer

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}" + END_OF_TURN + "{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def write_model_folder(model_dir: str | Path, out: str | Path, served_name: str, max_context: int) -> Path:
    """Write the frontend's model folder for `model_dir` into `out` (overwritten); returns `out`."""
    model_dir, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    tok = ChatTokenizer.load(model_dir)
    cfg = json.loads((model_dir / "config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": END_OF_TURN, "pad_token": PAD,
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": max_context, "chat_template": CHAT_TEMPLATE,
        "additional_special_tokens": [EOS],
    }, indent=1))
    (out / "config.json").write_text(json.dumps({
        "model_type": "mol2-ced", "architectures": ["CEDNetwork"], "_name_or_path": served_name,
        "vocab_size": tok.vocab_size, "hidden_size": int(cfg["dim"]), "num_hidden_layers": int(cfg["n_layers"]),
        "max_position_embeddings": max_context,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.end_of_turn_id, "pad_token_id": tok.pad_id,
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.end_of_turn_id}))
    return out
