"""Constrained decoding: grammars on llguidance, their bounds, and the threads they are compiled on."""
