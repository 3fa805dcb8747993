"""SWA attention: each query reads the rows of its sliding window (ring + this chunk) plus a sink; replay shapes too."""

from plugins.swa_replay_attention.op import swa_replay_attention

__all__ = ["swa_replay_attention"]
