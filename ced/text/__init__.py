"""The text layer: tokenizer, chat formats, tool-call syntaxes, turn markers, DeepSeek's template."""
