"""Intent clusters: requests grouped by what their prompts ask for (request_intents rows), so paraphrases
align and look-alikes do not (`llmobs-agent query --by-intent`, compare's intent pairing).

Two requests' similarity mixes a weighted Jaccard over their slot features with their MinHash estimate of
the Jaccard of their word 3-gram shingles:

    similarity = (1 - SIGNATURE_WEIGHT) * J_w(slots) + SIGNATURE_WEIGHT * J_minhash

    J_w(A, B) = sum of weights(A & B) / sum of weights(A | B), over the features
        action:<id>          weight 4   (summarize, translate, ...: the request itself)
        format:<id>          weight 3   (json, yaml, list, ...)
        language=<code>      weight 4   (a target language changes the whole output)
        code_language=<id>   weight 1
        <kind>=<value>       weight 1   (any other constraint: a length limit, steps, tone)
    J_minhash = the fraction of the 36 MinHash values that are equal

A request joins the cluster whose leader it is most similar to when that similarity is at least
THRESHOLD (0.6), else it leads a new cluster (leaders in order of how many requests share their exact
fingerprint, then of first appearance; requests with one exact fingerprint are compared once).

What the weights buy (S: the weight both share): two wordings with the same slots always join
(>= 0.8); one with a length limit the other lacks joins at 0.8 * 7/8 = 0.7 and up. A different action
scores at most 0.8 * S/(S + 8) + 0.2: below 0.6 unless they share a weight of 8 or more (format and
language) *and* identical shingles. A different format with the same action scores at most
0.8 * 4/10 + 0.2 = 0.52; with the same target language too it needs 71% of the MinHash values equal.
A different target language with the same action and format: at most 0.8 * 7/15 + 0.2 = 0.57.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from llmobs.shm.intent_format import MINHASH_K, parse_minhash_hex

THRESHOLD = 0.6
SIGNATURE_WEIGHT = 0.2
WEIGHTS = {"action": 4.0, "format": 3.0, "language": 4.0, "code_language": 1.0}
CONSTRAINT_WEIGHT = 1.0  # any other constraint kind

INTENT_SQL = """
SELECT pid, request_seq, trace_id, template_id, minhash, action, output_format, constraints
FROM request_intents ORDER BY ts_ns, pid, request_seq
"""


@dataclass(frozen=True)
class Fingerprint:
    """A request's stored intent (one request_intents row)."""

    pid: int
    request_seq: int
    trace_id: str
    template_id: str
    action: str
    output_format: str
    constraints: str  # "kind=value,kind=value"
    minhash: tuple[int, ...]

    def exact(self) -> tuple:
        return (self.action, self.output_format, self.constraints, self.minhash)


@dataclass
class Cluster:
    """One intent: its leader's slots, its requests and the template ids among them."""

    cluster: int
    action: str
    output_format: str
    constraints: str
    members: list[Fingerprint] = field(default_factory=list)

    def templates(self) -> list[tuple[str, int]]:
        """(template id, requests) by count, most first."""
        return Counter(m.template_id for m in self.members).most_common()


def features(fp: Fingerprint) -> dict[str, float]:
    return _slot_features(fp.action, fp.output_format, fp.constraints)


def _slot_features(action: str, output_format: str, constraints: str) -> dict[str, float]:
    out = {f"action:{action}": WEIGHTS["action"], f"format:{output_format}": WEIGHTS["format"]}
    for pair in filter(None, constraints.split(",")):
        out[pair] = WEIGHTS.get(pair.partition("=")[0], CONSTRAINT_WEIGHT)
    return out


def weighted_jaccard(a: dict[str, float], b: dict[str, float]) -> float:
    union = sum(max(a.get(k, 0.0), b.get(k, 0.0)) for k in a.keys() | b.keys())
    both = sum(min(a[k], b[k]) for k in a.keys() & b.keys())
    return both / union if union else 1.0


def minhash_jaccard(a: tuple[int, ...], b: tuple[int, ...]) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / MINHASH_K


def similarity(a: Fingerprint, b: Fingerprint) -> float:
    slots = weighted_jaccard(features(a), features(b))
    return (1 - SIGNATURE_WEIGHT) * slots + SIGNATURE_WEIGHT * minhash_jaccard(a.minhash, b.minhash)


def cluster(fingerprints: list[Fingerprint], threshold: float = THRESHOLD) -> list[Cluster]:
    """Leader clustering (module doc). Requests with the same exact fingerprint are compared once; a
    request is compared with every leader at once (their MinHash rows in one array, the slot Jaccard of
    each pair of distinct slot sets computed once), so 100k requests take seconds, not hours."""
    groups: dict[tuple, list[Fingerprint]] = {}
    for fp in fingerprints:
        groups.setdefault(fp.exact(), []).append(fp)
    order = sorted(groups.values(), key=lambda g: -len(g))  # stable: first appearance breaks ties
    clusters: list[Cluster] = []
    mins = np.empty((max(16, len(order)), MINHASH_K), np.uint16)  # row i: leader i's MinHash
    slot_sets: list[tuple[str, str, str]] = []  # the distinct slot sets among the leaders
    slot_of: list[int] = []  # leader i's index in slot_sets
    jaccard: dict[tuple[tuple, tuple], float] = {}
    for group in order:
        head = group[0]
        slots = (head.action, head.output_format, head.constraints)
        row = np.asarray(head.minhash, np.uint16)
        found = None
        if clusters:
            per_set = np.array([_slot_jaccard(jaccard, slots, other) for other in slot_sets])
            sims = (1 - SIGNATURE_WEIGHT) * per_set[slot_of] + SIGNATURE_WEIGHT * (
                mins[: len(clusters)] == row
            ).mean(axis=1)
            best = int(np.argmax(sims))  # the first of equals: the earlier leader
            if sims[best] >= threshold:
                found = clusters[best]
        if found is None:
            found = Cluster(len(clusters) + 1, *slots)
            mins[len(clusters)] = row
            if slots not in slot_sets:
                slot_sets.append(slots)
            slot_of.append(slot_sets.index(slots))
            clusters.append(found)
        found.members.extend(group)
    return clusters


def _slot_jaccard(cache: dict, a: tuple, b: tuple) -> float:
    got = cache.get((a, b))
    if got is None:
        got = cache[(a, b)] = weighted_jaccard(_slot_features(*a), _slot_features(*b))
    return got


def load(connection) -> list[Fingerprint]:
    """Every stored request intent, oldest first; a row whose signature is not MINHASH_K u16s in hex (a
    store written by hand, or damaged) is left out and counted in `malformed` (the CLI says so)."""
    global malformed
    rows = connection.execute(INTENT_SQL).fetchall()
    out = []
    for pid, seq, trace, template, mh, action, fmt, constraints in rows:
        if not _valid_minhash(mh):
            malformed += 1
            continue
        out.append(Fingerprint(int(pid), int(seq), trace or "", template, action, fmt, constraints,
                               parse_minhash_hex(mh)))  # fmt: skip
    return out


malformed = 0  # stored intents left out by load(): their MinHash signature is not MINHASH_K x 4 hex digits


def _valid_minhash(text) -> bool:
    if not isinstance(text, str) or len(text) != 4 * MINHASH_K:
        return False
    try:
        int(text, 16)
    except ValueError:
        return False
    return True


def assignments(clusters: list[Cluster]) -> dict[tuple[int, int], int]:
    """(pid, request_seq) -> cluster number (what compare pairs paraphrased requests by)."""
    return {(m.pid, m.request_seq): c.cluster for c in clusters for m in c.members}


CLUSTER_COLUMNS = ["cluster", "requests", "action", "output_format", "constraints", "templates", "members"]


def rows(clusters: list[Cluster], *, full: bool) -> list[list]:
    """CLUSTER_COLUMNS rows. `full` (json): every template id and member ("pid:request_seq"); else the
    first three of each and how many more."""

    def short(items: list[str]) -> str:
        more = len(items) - 3
        return ",".join(items[:3]) + (f",+{more}" if more > 0 else "")

    out = []
    for c in clusters:
        templates = [t for t, _ in c.templates()]
        members = [f"{m.pid}:{m.request_seq}" for m in c.members]
        out.append([
            c.cluster, len(c.members), c.action, c.output_format, c.constraints,
            templates if full else short(templates), members if full else short(members),
        ])  # fmt: skip
    return out
