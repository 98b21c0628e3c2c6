"""Models, training strategies, checkpoints and evaluation (torch; no sockets)."""
