"""Speculative decoding: the drafters, the auto mode's planner and per-sequence offers, what verify rows cost."""
