"""One loaded model version answering rows, with no HTTP in sight.

Rows go the way they go in training: `sparse.records` checks them by the
parser's rules, `Encoder.encode_rows` hashes them (the ids a file row gets),
and the model is the version's own `ModelBundle`. `predict_many` answers
several requests with one model call.

    p = Predictor.load("models/ctr")             # CURRENT, warmed up
    p.predict([{"I1": 3, "C1": "68fd1e64"}])     # -> array([0.21...], dtype=float32)
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from mariana.serving.errors import ServeError, bad_request
from mariana.sparse.errors import ModelDirError
from mariana.sparse.records import FEW_ROWS, concat_chunks, parse_records
from mariana.trainer import checkpoint
from mariana.trainer.bundle import ModelBundle, table_memory
from mariana.trainer.models.registry import uses_torch

SHOWN_BAD = 5  # bad instances named in one error message
LONE_REQUESTS = 8  # LR: a call of up to this many requests scores its one-instance requests one by one
WARM_HOUR = "14102100"  # the warm-up instance's hour, for a schema that has one (Avazu's first)


@dataclass
class Prediction:
    """One request's answer: pCTR per instance, or the error that refuses it."""
    pctr: np.ndarray | list[float] | None  # a list from `predict_lone`
    error: ServeError | None
    unknown_fields: int
    unknown_creatives: int = 0  # instances whose creative id the version's image table lacks (fallback used)


class Predictor:
    audio = False  # answers instances; a speech version (serving/speech.py) answers wav bodies

    def __init__(self, bundle: ModelBundle, model_dir: str, version: str):
        self.bundle, self.model_dir, self.version = bundle, os.path.abspath(model_dir), version
        self.schema = bundle.schema  # with its label column: a row that carries one is not "unknown"
        self.loaded_at = time.time()
        self.served_creatives: dict[bytes, bytes] = {}  # id -> features (bytes) of creatives added since loading
        self._lone = bundle.lone_scorer()  # one instance scored with few numpy calls, or none (`predict_lone`)
        # the most requests of one call scored one by one: LR's lone path makes no numpy call, so
        # each of a few requests costs what a lone one does; the DNN's make matrix products,
        # which a call of several shares in `predict_many`
        self.lone_requests = 0 if self._lone is None else 1 if uses_torch(bundle.model) else LONE_REQUESTS

    @classmethod
    def load(cls, model_dir: str, version: str | None = None, torch_threads: int | None = None,
             tables: str = "auto") -> "Predictor":
        """The version (default: CURRENT), with one prediction made so that the first
        client does not pay a lazy set-up. A torch model (the DNN) imports torch here, not
        in its first request of many rows, and sets its intra-op threads to
        `torch_threads` when given (a server: one per worker process); an LR version
        never imports torch. `tables`: `ModelBundle.load`'s (frozen, so memory follows the rows
        saved, when that pays). ModelDirError when it cannot be read."""
        version = version or checkpoint.current_version(model_dir)
        p = cls(ModelBundle.load(model_dir, version, tables=tables), model_dir, version)
        if uses_torch(p.bundle.model):
            import torch

            if torch_threads:
                torch.set_num_threads(torch_threads)
        hour = p.bundle.schema.hour  # a row must have its hour (YYMMDDHH): an Avazu version never loaded
        warm = p.predict([{hour: WARM_HOUR} if hour else {}])
        if not np.isfinite(warm).all():  # finite weights can still overflow (a huge bias or dense weight)
            raise ModelDirError(f"{model_dir}/{version}: its prediction for an empty instance is {warm[0]}, "
                                "not a probability: a corrupt or diverged version, not loaded")
        return p

    def share_ids(self, other) -> bool:
        """Take over the id cache of `other` (the version this one replaces) when the two hash
        alike: the values it met are lookups from the first request on (`Encoder.share_ids`).
        False when they hash differently, or `other` is no click model (a speech version)."""
        bundle = getattr(other, "bundle", None)
        return bundle is not None and self.bundle.encoder.share_ids(bundle.encoder)

    def predict(self, instances: list) -> np.ndarray:
        """(n,) float32 pCTR of one request's instances; ServeError 400 names bad ones."""
        (answer,) = self.predict_many([instances])
        if answer.error is not None:
            raise answer.error
        return answer.pctr

    def predict_many(self, requests: list[list]) -> list[Prediction]:
        """Each request checked on its own (a bad instance refuses its request only),
        the good ones scored together.

        Requests of up to `FEW_ROWS` instances go in groups of up to `FEW_ROWS` rows, each
        group's plain values checked and looked up in one pass (`Encoder.encode_instances`)
        and scored in numpy: 17 lone requests cost what 16 do a request, not 3.5x. A larger
        request, and a group with a value that is not plain or too many new ones, take
        `parse_records` and `encode_rows`, whose vector steps pay from a few dozen rows on."""
        if not hasattr(self.bundle.encoder, "encode_instances"):
            return self._answer_parsed(requests)
        answers: list[Prediction | None] = [None] * len(requests)
        rest: list[int] = []  # the requests left to the general path, by position
        group: list[int] = []
        rows = 0
        for k, instances in enumerate(requests):
            n = len(instances)
            if not 0 < n <= FEW_ROWS:
                rest.append(k)
                continue
            if rows + n > FEW_ROWS:
                self._answer_group(requests, group, answers, rest)
                group, rows = [], 0
            group.append(k)
            rows += n
        self._answer_group(requests, group, answers, rest)
        if rest:
            for k, a in zip(rest, self._answer_parsed([requests[k] for k in rest])):
                answers[k] = a
        return answers

    def _answer_group(self, requests: list[list], group: list[int], answers: list, rest: list[int]) -> None:
        """The plain path's answers of the requests at `group` into `answers`; where it
        declines the group, their positions go to `rest`."""
        if not group:
            return
        plain = self.bundle.encoder.encode_instances([i for k in group for i in requests[k]])
        if plain is None:
            rest.extend(group)
            return
        for k, a in zip(group, self._answer_plain([requests[k] for k in group], *plain)):
            answers[k] = a

    def _answer_parsed(self, requests: list[list]) -> list[Prediction]:
        answers, chunks = [], []
        for instances in requests:
            chunk, bad, unknown = parse_records(self.schema, instances)
            if bad:
                answers.append(Prediction(None, bad_request(describe_bad(bad)), unknown))
            else:
                answers.append(Prediction(None, None, unknown))
                chunks.append(chunk)
        if chunks:
            batch = self.bundle.encoder.encode_rows(concat_chunks(chunks))
            pctr = self.bundle.predict(batch)
            # an image model's dense block ends with the unknown-creative flag (training's lookup, same table)
            flags = batch.dense[:, -1] if self.bundle.images is not None else None
            start, ok = 0, (a for a in answers if a.error is None)
            for chunk, answer in zip(chunks, ok):
                answer.pctr = pctr[start:start + chunk.num_rows]
                if flags is not None:
                    answer.unknown_creatives = int(flags[start:start + chunk.num_rows].sum())
                start += chunk.num_rows
        return answers

    def predict_lone(self, instance) -> Prediction | None:
        """One instance of plain values scored with few numpy calls or none (pCTR as a list of
        one float), where the model has such a path (`ModelBundle.lone_scorer`: LR, the DNN's
        "dot"); None otherwise, or when the instance is not plain: `predict_many` takes it and
        says what is wrong."""
        if self._lone is None:
            return None
        found = self.bundle.encoder.instance_ids([instance])
        if found is None:
            return None
        ids, unknown = found
        return Prediction([self._lone(ids)], None, unknown[0])

    def _answer_plain(self, requests: list[list], ids: np.ndarray, unknown: list[int]) -> list[Prediction]:
        pctr = self.bundle.predict_rows(ids)
        if len(requests) == 1:
            return [Prediction(pctr, None, sum(unknown))]
        answers, start = [], 0
        for instances in requests:
            end = start + len(instances)
            answers.append(Prediction(pctr[start:end], None, sum(unknown[start:end])))
            start = end
        return answers

    def creative_key(self) -> tuple[str, int] | None:
        """(featurizer sha256, feature dim) of an image model, else None: which cached
        creative features fit this version (services/creative_cache.py keys them so)."""
        img = self.bundle.manifest.get("images") or {}
        if self.bundle.images is None or not img.get("featurizer_sha256"):
            return None
        return img["featurizer_sha256"], int(self.bundle.images.dim)

    def add_creatives(self, ids: list[bytes], features) -> tuple[int, int]:
        """Extend the image table with creatives the version was not trained with (new ads,
        featurized since by the same featurizer), and give those added so far the features
        the cache holds now (an image replaced, featurized again); ids it was trained with
        are left as trained. Returns (added, changed). The table is replaced, not changed:
        a request being encoded keeps the one it started with."""
        from mariana.featurizer.creatives import CreativeFeatures

        table, features = self.bundle.images, np.asarray(features, np.float32)  # (n, d)
        have, served = set(table.ids), self.served_creatives
        last = {cid: i for i, cid in enumerate(ids)}  # an HSCAN may name an id twice
        new = [i for cid, i in last.items() if cid not in have]
        changed = [i for cid, i in last.items() if cid in served and served[cid] != features[i].tobytes()]
        if not new and not changed:
            return 0, 0
        rows = np.concatenate([table.features, features[new]])
        if changed:
            rows[table.index([ids[i] for i in changed])] = features[changed]
        served.update((ids[i], features[i].tobytes()) for i in new + changed)
        self.bundle.images = self.bundle.encoder.table = CreativeFeatures(table.ids + [ids[i] for i in new], rows)
        return len(new), len(changed)

    def info(self) -> dict:
        """What /v1/model says: the version, when and on what it was trained, its metrics."""
        m = self.bundle.manifest
        train = m.get("train") or {}
        return {
            "model_dir": self.model_dir, "model_version": self.version, "kind": self.bundle.config.model.kind,
            "trained_at": m.get("created_at"), "loaded_at": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                           time.gmtime(self.loaded_at)),
            "trained_on": {"data": train.get("data"), "rows": checkpoint.rows_learned(m),
                           "mode": train.get("mode", "local"), "seconds": train.get("seconds")},
            "metrics": m.get("metrics") or {},
            "schema": self.schema.name, "fields": list(self.schema.numeric + self.schema.categorical)
            + ([self.schema.hour] if self.schema.hour else []),
            "hash_bits": self.bundle.config.hashing.bits,
            "tables": table_memory(self.bundle),
        }


def describe_bad(bad: list[tuple[int, str]]) -> str:
    """'instances[3]: I1 is not a number; instances[7]: ... (and 4 more)'."""
    text = "; ".join(f"instances[{i}]: {why}" for i, why in bad[:SHOWN_BAD])
    return text + (f" (and {len(bad) - SHOWN_BAD} more)" if len(bad) > SHOWN_BAD else "")
