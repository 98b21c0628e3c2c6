"""Mariana: CTR training and serving (sparse LR/DNN click models, parameter servers, online pCTR)."""
