"""MoL2 pointer score: a request's query against the cached option side, one logit per option."""

from .op import pointer_score

__all__ = ["pointer_score"]
