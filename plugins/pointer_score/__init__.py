"""MoL2 pointer score: a request's query against the cached option side, one logit per option."""

from plugins.pointer_score.op import pointer_score

__all__ = ["pointer_score"]
