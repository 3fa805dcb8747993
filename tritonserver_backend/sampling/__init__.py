"""Sampling: parameters, sampler, grammar masks, speculative acceptance."""
