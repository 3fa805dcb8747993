"""The model folder Dynamo's OpenAI frontend reads (tokenizer.json, tokenizer_config.json, config.json), generated
from the model directory's own files, so the frontend's chat template yields exactly the ids `ChatFormat.encode` yields.

The chat template is the model directory's (its tokenizer_config.json, `ced.text.chat_format`), copied, not
written here: the frontend renders it and tokenizes the text with the HF tokenizer, where the role markers are added
tokens and text between them is byte-level BPE as in `ChatTokenizer.encode`, so both give the same ids for ordinary
text. A directory whose format is our built-in DeepSeek-V4.1 renderer (the release ships Python rules, no template)
gets `DEEPSEEK_V41_CHAT_TEMPLATE`, the same rules as a template for chat without tools and with thinking off (it
refuses the rest with a message; a test checks it equals the renderer). Another built-in format without a template
would be refused rather than given another format.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ced.text.chat_format import DEEPSEEK_V41, ChatFormatError, read_tokenizer_config
from ced.text.deepseek_template import DEEPSEEK_V41_CHAT_TEMPLATE
from ced.text.tokenizer import ChatTokenizer

# what a template-only frontend gets for a built-in format
BUILTIN_AS_TEMPLATE = {DEEPSEEK_V41: DEEPSEEK_V41_CHAT_TEMPLATE}


def write_model_folder(model_dir: str | Path, out: str | Path, served_name: str, max_context: int) -> Path:
    """Write the frontend's model folder for `model_dir` into `out` (overwritten); returns `out`."""
    model_dir, out = Path(model_dir), Path(out)
    tok = ChatTokenizer.load(model_dir)
    fmt = tok.chat_format
    template = fmt.template if fmt.template is not None else BUILTIN_AS_TEMPLATE.get(fmt.name)
    if template is None:
        raise ChatFormatError(f"{model_dir}: its chat format is the built-in {fmt.name!r}, not a Jinja chat template; "
                              "Dynamo's frontend renders templates only")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_dir / "tokenizer.json", out / "tokenizer.json")
    cfg = json.loads((model_dir / "config.json").read_text())
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": False, "add_eos_token": False,
                        "clean_up_tokenization_spaces": False, **read_tokenizer_config(model_dir),
                        "model_max_length": max_context, "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=1, ensure_ascii=False))
    (out / "config.json").write_text(json.dumps({
        "model_type": "mol2-ced", "architectures": ["CEDNetwork"], "_name_or_path": served_name,
        "vocab_size": tok.vocab_size, "hidden_size": int(cfg["dim"]), "num_hidden_layers": int(cfg["n_layers"]),
        "max_position_embeddings": max_context,
        "bos_token_id": tok.bos_id, "eos_token_id": tok.end_of_turn_id, "pad_token_id": tok.pad_id,
    }, indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": tok.end_of_turn_id}))
    return out
