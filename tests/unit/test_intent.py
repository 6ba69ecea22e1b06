"""The prompt intent fingerprint (llmobs.publisher.intent) and its clusters (diagnostics.intent_cluster):
paraphrases land in one cluster, look-alikes (the same words, another intent) do not, and the record
holds ids and hashes only."""

from __future__ import annotations

import json

import pytest
from llmobs.diagnostics import intent_cluster
from llmobs.publisher.intent import fingerprint, user_text
from llmobs.shm import intent_format

ARTICLE = (
    "\n\nThe city council met on Tuesday to discuss the new budget for Springfield. Members argued about "
    "parks, roads and a JSON export of the minutes for hours, and they translated nothing into French. "
    "In the end the budget passed with seven votes to two, after a long debate about the library."
)
REVIEW = "\n\nI bought these headphones last month and they broke after two days. Terrible sound."

# (expected slots, paraphrases): each group must be one cluster of its own
PARAPHRASES = {
    ("summarize", "list", "items=3"): [
        "Summarize this article in 3 bullet points." + ARTICLE,
        "Give me a three-bullet summary of the following text." + ARTICLE,
        "Condense the passage below into three bullet points." + ARTICLE,
        "TL;DR in 3 bullets, please:" + ARTICLE,
        "Can you sum up this article as 3 key bullet points?" + ARTICLE,
    ],
    ("translate", "none", "language=fr"): [
        "Translate this into French." + ARTICLE,
        "Please render the following text in French." + ARTICLE,
        "How do you say this in French?" + ARTICLE,
        "Convert this paragraph to French." + ARTICLE,
    ],
    ("extract", "json", ""): [
        "Extract all names and dates from this email and return them as JSON." + ARTICLE,
        "Pull out every person and date mentioned below; output JSON." + ARTICLE,
        "Identify the names and dates in the following message. Respond in JSON format." + ARTICLE,
        "Find all the people and dates in this text and give me a JSON object." + ARTICLE,
    ],
    ("classify", "none", ""): [
        "Classify the sentiment of this review as positive or negative." + REVIEW,
        "Is this review positive or negative?" + REVIEW,
        "Label the following review's sentiment: positive or negative." + REVIEW,
        "Determine whether the sentiment of this review is positive or negative." + REVIEW,
    ],
    ("explain", "none", "tone=simple"): [
        "Explain how photosynthesis works in simple terms.",
        "Can you describe how photosynthesis works, simply?",
        "What is photosynthesis and how does it work? Keep it simple.",
        "Help me understand photosynthesis in plain language.",
        "ELI5: photosynthesis",
    ],
    ("code", "code", "code_language=python"): [
        "Write a Python function that reverses a string.",
        "Implement a string-reversal function in Python.",
        "Give me Python code to reverse a string.",
    ],
}

# the same words, another intent: never one cluster
LOOK_ALIKES = [
    ("Translate this to French.", "Summarize this in French."),
    ("Write JSON describing a user profile.", "Write YAML describing a user profile."),
    ("Summarize this article in 3 bullet points.", "Summarize this article in 3 sentences."),
    ("Translate this to French.", "Translate this to German."),
    ("Explain this Python code.", "Write this Python code."),
]


def _stored(text: str, seq: int) -> intent_cluster.Fingerprint:
    """What the store gives back for a request of this prompt (the packed record, unpacked by the reader)."""
    intent = intent_format.unpack(fingerprint(text).pack())
    return intent_cluster.Fingerprint(
        1, seq, "", f"{intent.template_id:016x}", intent.action, intent.output_format,
        intent.constraints_text(), intent.minhash,
    )  # fmt: skip


@pytest.mark.parametrize("slots", list(PARAPHRASES), ids=lambda s: s[0])
def test_each_paraphrase_gets_its_groups_slots(slots):
    for text in PARAPHRASES[slots]:
        got = fingerprint(text)
        assert (got.action, got.output_format, got.constraints_text()) == slots, text


def test_paraphrase_groups_are_one_cluster_each():
    fps, truth, seq = [], {}, 0
    for slots, texts in PARAPHRASES.items():
        for text in texts:
            seq += 1
            fps.append(_stored(text, seq))
            truth[seq] = slots
    clusters = intent_cluster.cluster(fps)
    assert len(clusters) == len(PARAPHRASES)
    for c in clusters:
        groups = {truth[m.request_seq] for m in c.members}
        assert groups == {(c.action, c.output_format, c.constraints)}
        assert len(c.members) == len(PARAPHRASES[next(iter(groups))])
        assert len(c.templates()) == len(c.members)  # paraphrases: a template each, one intent


@pytest.mark.parametrize("a,b", LOOK_ALIKES)
def test_look_alikes_are_not_one_cluster(a, b):
    x, y = _stored(a, 1), _stored(b, 2)
    assert intent_cluster.similarity(x, y) < intent_cluster.THRESHOLD
    assert len(intent_cluster.cluster([x, y])) == 2


def test_a_paraphrase_lacking_a_constraint_still_joins_and_the_bounds_hold():
    full = _stored("Summarize this article in 3 bullet points." + ARTICLE, 1)
    loose = _stored("Summarize this article in bullet points." + ARTICLE, 2)
    assert loose.constraints == "" and intent_cluster.similarity(full, loose) >= intent_cluster.THRESHOLD
    # the module doc's bounds, from the weights (identical shingles: the most a look-alike can score)
    w = intent_cluster.WEIGHTS
    action_differs = (
        (1 - 0.2) * (w["format"] + w["language"]) / (w["format"] + w["language"] + 2 * w["action"])
    )
    assert action_differs + 0.2 < intent_cluster.THRESHOLD
    format_differs = (1 - 0.2) * w["action"] / (w["action"] + 2 * w["format"]) + 0.2
    assert format_differs == pytest.approx(0.52)


def test_masking_gives_one_template_to_one_template_with_other_values():
    a = fingerprint('Summarize "Q3 report" by Alice Smith in 5 sentences: https://x.example/a ' + ARTICLE)
    b = fingerprint("Summarize 'Budget memo' by Bob Jones in 12 sentences: https://y.example/b " + REVIEW)
    assert a.template_id == b.template_id and a.minhash == b.minhash and a.simhash == b.simhash
    assert (a.constraints_text(), b.constraints_text()) == ("sentences=4-5", "sentences=11-20")
    c = fingerprint("Summarize the report by Alice Smith in 5 sentences." + ARTICLE)
    assert c.template_id != a.template_id  # the quoted title was a variable part; here there is none


def test_the_text_part_decides_nothing():
    # the article talks of JSON and French; the instruction asks for neither
    got = fingerprint("Summarize the following article in two sentences:" + ARTICLE)
    assert (got.action, got.output_format, got.constraints_text()) == ("summarize", "none", "sentences=2")


def test_the_record_is_104_bytes_of_ids_and_hashes_only():
    text = "Translate the following into Portuguese, formally, in at most 50 words: Zyzzyva quokka"
    intent = fingerprint(text)
    record = intent.pack()
    assert len(record) == intent_format.RECORD_SIZE == 104
    assert intent_format.unpack(record) == intent
    assert intent.constraints_text() == "words=21-50,language=pt,tone=formal"
    for word in ("Translate", "Portuguese", "formally", "Zyzzyva", "quokka", "zyzz", "quok"):
        assert word.encode() not in record and word.lower().encode() not in record
    assert intent_format.unpack(record[:-1]) is None and intent_format.unpack(b"\x02" + record[1:]) is None


def test_the_user_turn_of_a_chat_template():
    chatml = "<|im_start|>system\nYou are a helpful assistant. Write JSON.<|im_end|>\n<|im_start|>user\n"
    chatml += "Summarize this in 3 bullets.<|im_end|>\n<|im_start|>assistant\n"
    assert user_text(chatml, ["<|im_start|>", "<|im_end|>"]) == "Summarize this in 3 bullets."
    llama = "<|start_header_id|>user<|end_header_id|>\n\nTranslate this to French.<|eot_id|>"
    assert user_text(llama, ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]) == (
        "Translate this to French."
    )
    assert user_text("plain <s>text", ["<s>"]) == "plain text"


def test_a_stored_intent_with_a_malformed_signature_is_left_out_and_counted(tmp_path, capsys):
    """A request_intents row whose MinHash is not MINHASH_K u16s in hex (a damaged or hand-written store)
    is left out of the clusters and counted; the command says so on stderr and clusters the rest."""
    from llmobs.cli import main
    from llmobs.store.sink import DuckDBStore

    good = intent_format.minhash_hex(fingerprint("Summarize this article in 3 bullet points.").minhash)
    path = tmp_path / "s.duckdb"
    with DuckDBStore(path) as store:
        for seq, signature in ((1, good), (2, good[:-4]), (3, "zz" + good[2:])):
            store.connection.execute(
                "INSERT INTO request_intents VALUES (7, ?, 't', 'tpl', 1, ?, 'summarize', 'list', '', ?)",
                [seq, signature, seq],
            )
    before = intent_cluster.malformed
    assert main(["query", "--db", str(path), "--by-intent", "--format", "json"]) == 0
    out, err = capsys.readouterr()
    assert intent_cluster.malformed - before == 2
    assert "2 stored intent(s) with a malformed MinHash signature left out" in err
    assert [c["members"] for c in json.loads(out)] == [["7:1"]]
