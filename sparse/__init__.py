"""Sparse CTR data and its math: schemas, parsers, feature hashing, the
`SparseBatch`, hashed parameter tables, sparse optimizers and metrics.

Pure compute (numpy, scipy, pyarrow, torch); no sockets, no Redis.
"""
