"""The core library under building and serving: network, formats, LoRA, parallel layout, step modules, text."""
