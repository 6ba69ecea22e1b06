"""The prompt intent fingerprint: what a prompt asks for, as ids and hashes (the text never leaves).

    fingerprint("Summarize this article in 3 bullet points:\\n\\n<article>")
      -> Intent(action='summarize', output_format='list', constraints=(('items', '3'),), template_id=...,
                simhash=..., minhash=(...36 values...))

A pure function of the text, in process (opt-in: llmobs.instrument(..., intent=True) or
llmobs.context(intent_text=...)). What it derives, in order:

1. The instruction: the prompt's short blocks (split at blank lines and at a colon ending a line; a block
   of at most 40 words can be instruction, a longer one is the text the instruction is about) that ask
   for something (an action, format or length word, a question; the first short block when none does),
   and in a block "<2+ words>: <4+ words>" the part after the colon is the text too. Only the instruction is
   fingerprinted: an article about JSON must not make a summary request a JSON one.
2. Variable parts masked: code spans, URLs, e-mail addresses, quoted strings, then numbers and number
   words, then runs of capitalised words that do not start a sentence (names). The template id hashes the
   masked, lower-cased instruction (plus `<text>` when there was a text part).
3. A 64-bit SimHash and a 36-value b-bit MinHash (b = 16) of its word 3-gram shingles.
4. Slots, each from the vocabulary in llmobs.shm.intent_format (docs/compare.md, "Intent fingerprints"):
   the action (the first verb or noun of a specific action; a generic verb such as "write" or "give"
   takes the action of the object it names - "a summary", "a Python function" - else "write"; without
   any, question cues: "is this ... or ..." classify, "how does / why" explain, other questions answer),
   the output format, and the constraints (length limits in words, sentences, tokens, characters,
   items, paragraphs or lines with a bucketed count; target language; code language; step count; tone).
"""

from __future__ import annotations

import hashlib
import re
import struct

from llmobs.shm import intent_format as fmt
from llmobs.shm.intent_format import Intent

MAX_INSTRUCTION_WORDS = 40

_NUMBER_WORDS = {
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "fifteen": 15,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "hundred": 100,
    "single": 1,
    "dozen": 12,
}
_NUM = r"(\d+|" + "|".join(_NUMBER_WORDS) + r")"

# --- masking -------------------------------------------------------------------------------------
_CONTENT = [  # (pattern, placeholder): what is content, not instruction, whatever its words say
    (re.compile(r"```.*?(```|$)", re.DOTALL), " <code> "),
    (re.compile(r"`[^`\n]+`"), " <code> "),
    (re.compile(r"\bhttps?://\S+|\bwww\.\S+", re.IGNORECASE), " <url> "),
    (re.compile(r"[\w.+-]+@[\w-]+\.[\w.-]+"), " <email> "),
    (re.compile(r"\"[^\"\n]{1,200}\"|“[^”\n]{1,200}”|(?<!\w)'[^'\n]{1,200}'(?!\w)"), " <str> "),
]
_NUMBERS = re.compile(r"\d+(?:[.,]\d+)*|\b(?:" + "|".join(_NUMBER_WORDS) + r")\b", re.IGNORECASE)
_WORD = re.compile(r"<\w+>|[A-Za-z0-9]+(?:['’][A-Za-z]+)*|[.!?;:\n]")
_SENTENCE_END = frozenset(".!?;:\n")
_BLOCKS = re.compile(r"\n\s*\n|:[ \t]*\n")
_INLINE_TEXT = re.compile(r"^(\W*\w+\W+\w+[^:]{0,120}?):\s+(\S+(?:\s+\S+){3,}.*)$", re.DOTALL)


def _instruction(text: str) -> tuple[str, bool]:
    """The instruction part of a prompt and whether it had a text part (step 1 of the module doc)."""
    blocks = [b for b in _BLOCKS.split(text) if b.strip()]
    short = [b for b in blocks if len(b.split()) <= MAX_INSTRUCTION_WORDS]
    if not short:
        return " ".join(blocks[0].split()[:MAX_INSTRUCTION_WORDS]) if blocks else "", bool(blocks)
    # of several short blocks, those that ask for something (an action, format or length word; a
    # question): a short review or e-mail after the instruction is text too
    asking = [b for b in short if _asks(b.lower())] if len(blocks) > 1 else short
    keep = asking or short[:1]
    payload = len(keep) < len(blocks)
    out = []
    for block in keep:
        inline = _INLINE_TEXT.match(block.strip())
        if inline is not None:
            block, payload = inline.group(1), True
        out.append(block)
    return "\n".join(out), payload


def _asks(lowered: str) -> bool:
    return bool(
        _SPECIFIC.search(lowered)
        or _GENERIC.search(lowered)
        or _FORMATS.search(lowered)
        or _LENGTH.search(lowered)
        or _CLASSIFY_QUESTION.search(lowered)
        or "?" in lowered
    )


def _strip_content(text: str) -> str:
    for pattern, placeholder in _CONTENT:
        text = pattern.sub(placeholder, text)
    return text


def _template_tokens(stripped: str) -> list[str]:
    """Lower-cased words with numbers and names masked (sentence punctuation dropped)."""
    words = _WORD.findall(_NUMBERS.sub(" <num> ", stripped))
    out: list[str] = []
    start = True  # the next word begins a sentence: its capital is not a name's
    for w in words:
        if w in _SENTENCE_END:
            start = True
            continue
        name = w[0].isupper() and not start and w != "I" and not w.startswith("<")
        start = False
        if name:
            if not out or out[-1] != "<name>":
                out.append("<name>")
            continue
        out.append(w.lower())
    return out


# --- hashing -------------------------------------------------------------------------------------
def _h64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def shingles(tokens: list[str]) -> list[str]:
    """Word 3-grams (one shingle of all the words when there are fewer than 3)."""
    if len(tokens) < 3:
        return [" ".join(tokens)] if tokens else []
    return [" ".join(tokens[i : i + 3]) for i in range(len(tokens) - 2)]


_DIGEST = struct.Struct(f"<{fmt.MINHASH_K}HQ")  # a shingle's MinHash values, then its 64-bit hash


def _signatures(grams: list[str]) -> tuple[int, tuple[int, ...]]:
    """SimHash and MinHash of the shingles. One SHAKE-128 digest per shingle gives its MINHASH_K 16-bit
    hash values (36 independent hash functions: a slot's minimum over the shingles) and its 64-bit hash
    for the SimHash (bit j set where most shingles' bit j is). Plain Python: for the few shingles of an
    instruction it is faster than numpy's per-call overhead."""
    if not grams:
        return 0, (fmt.EMPTY_MIN,) * fmt.MINHASH_K
    k = fmt.MINHASH_K
    rows = [_DIGEST.unpack(hashlib.shake_128(g.encode("utf-8")).digest(_DIGEST.size)) for g in set(grams)]
    mins = tuple(map(min, zip(*(r[:k] for r in rows), strict=True)))
    n = len(rows)
    columns = zip(*(format(r[k], "064b") for r in rows), strict=True)  # the first column is bit 63
    simhash = int("".join("1" if c.count("1") * 2 > n else "0" for c in columns), 2)
    return simhash, mins


# --- slots ---------------------------------------------------------------------------------------
def _words(*names: str) -> str:
    return r"\b(?:" + "|".join(names) + r")\b"


def _alternatives(items) -> re.Pattern:
    """One pattern of named alternatives ((name, pattern) pairs): one scan finds the leftmost of them."""
    return re.compile("|".join(f"(?P<{name}>{pattern})" for name, pattern in items))


# tier 1: the verbs and nouns that name an action (the first of any of them in the instruction wins)
_SPECIFIC = _alternatives(
    (
        (
            "summarize",
            _words(
                r"summari[sz]\w*",
                "summary",
                "summaries",
                r"tl;?dr",
                "condense",
                "recap",
                "synopsis",
                r"sum(?:s|med|ming)? up",
                r"boil\w* down",
                "gist",
            ),
        ),
        ("translate", _words(r"translat\w*", r"how (?:do|would|can) (?:you|i) say")),
        (
            "explain",
            _words(
                r"explain\w*",
                "explanation",
                r"describ\w*",
                "clarify",
                r"walk me through",
                r"help me understand",
                "eli5",
                r"what does .{1,40} mean",
            ),
        ),
        (
            "rewrite",
            _words(
                r"rewrit\w*",
                r"rephras\w*",
                r"paraphras\w*",
                r"reword\w*",
                "proofread",
                "polish",
                r"edit(?:ing)?",
                r"simplif\w*",
                "shorten",
                r"fix the (?:grammar|spelling|wording)",
                r"convert\w*",
                r"render\w*",
                r"turn (?:this|it|the \w+) into",
            ),
        ),
        (
            "classify",
            _words(
                r"classif\w*",
                r"categori[sz]\w*",
                "sentiment",
                r"label\w*",
                r"determine whether",
                r"decide whether",
                r"which category",
            ),
        ),
        (
            "extract",
            _words(r"extract\w*", r"pull(?:s|ing)? out", "identify", r"find (?:all|every|each)", "parse"),
        ),
        ("compare", _words(r"compar\w*", "contrast", r"differences? between", "versus", "vs")),
        (
            "code",
            _words("implement", "implementation", "debug", "refactor", r"code(?: up)?(?= a| an| the| some)"),
        ),
    )
)
# tier 2: a generic verb, in the imperative only (a clause's first word, or after please / can you / to):
# "the output of", "a list of" and "the name" are not requests
_GENERIC = re.compile(
    r"(?:^|[.!?;:,\n]\s*|\b(?:please|you|to|and|then|also|just|me)\s+)("
    + _words(
        "write",
        "draft",
        "compose",
        "create",
        "generate",
        "produce",
        "craft",
        "prepare",
        "give",
        "provide",
        "return",
        "output",
        "tell",
        "show",
        "make",
        "suggest",
        "list",
        "name",
        "enumerate",
    )
    + ")"
)
_LIST_VERBS = frozenset({"list", "name", "enumerate"})
_OBJECTS = _alternatives(
    (  # what a generic verb's object names
        ("summarize", _words("summary", "summaries", r"tl;?dr", "synopsis", "recap", "overview")),
        ("translate", _words("translation")),
        ("explain", _words("explanation", "description")),
        ("compare", _words("comparison", r"differences?")),
        ("classify", _words("classification")),
        ("rewrite", _words("rewrite", "paraphrase")),
        (
            "code",
            _words(
                "function",
                "script",
                "program",
                "code",
                "snippet",
                "class",
                "method",
                "regex",
                "query",
                "algorithm",
                r"unit tests?",
                "python",
                "javascript",
                "typescript",
                "java",
                "golang",
                "rust",
                "sql",
                "bash",
                "ruby",
                "php",
            ),
        ),
    )
)
# tier 3: question cues
_CLASSIFY_QUESTION = re.compile(r"\b(?:is|are|was|does|do) (?:this|it|these|the)\b.{1,80}\bor\b")
_EXPLAIN_QUESTION = re.compile(r"\b(?:how (?:does|do|did|is|are)|why)\b")
_ANSWER_QUESTION = re.compile(r"\?|^\W*(?:who|what|when|where|which|how many|how much)\b|\banswer\w*\b")

_FORMAT_ORDER = ("json", "yaml", "csv", "table", "list", "code", "markdown")  # priority: a markdown table
_FORMATS = _alternatives(
    (
        ("json", _words("json")),
        ("yaml", _words("yaml", "yml")),
        ("csv", _words("csv", r"comma[- ]separated")),
        ("table", _words("table", "tabular")),
        ("list", _words(r"bullet\w*", r"numbered list", r"(?:as|in|into) a list", r"list of", "checklist")),
        ("code", _words(r"code block")),
        ("markdown", _words("markdown")),
    )
)

_LENGTH_UNITS = {
    "word": "words",
    "sentence": "sentences",
    "token": "tokens",
    "character": "characters",
    "char": "characters",
    "bullet point": "items",
    "bullet": "items",
    "point": "items",
    "item": "items",
    "paragraph": "paragraphs",
    "line": "lines",
}
_ADJECTIVE = r"(?:(?:key|main|short|brief|concise|clear|simple|numbered|important)\s+)?"
_LENGTH = re.compile(r"\b" + _NUM + r"[\s-]+" + _ADJECTIVE + "(" + "|".join(_LENGTH_UNITS) + r")s?\b")
_ONE = re.compile(r"\b(?:in|as) (?:a|one|a single) (sentence|line|paragraph|word)\b")
_LANGUAGES = {
    "english": "en",
    "french": "fr",
    "german": "de",
    "spanish": "es",
    "italian": "it",
    "portuguese": "pt",
    "dutch": "nl",
    "russian": "ru",
    "chinese": "zh",
    "mandarin": "zh",
    "japanese": "ja",
    "korean": "ko",
    "arabic": "ar",
    "hindi": "hi",
    "turkish": "tr",
    "polish": "pl",
    "swedish": "sv",
}
_LANGUAGE = re.compile(r"\b(in|into|to)\s+(" + "|".join(_LANGUAGES) + r")\b")
_CODE_LANGUAGES = _alternatives(
    (
        ("python", _words("python")),
        ("javascript", _words("javascript", "js", "node")),
        ("typescript", _words("typescript")),
        ("java", _words("java")),
        ("cpp", r"\bc\+\+"),
        ("csharp", r"\bc#"),
        ("go", _words("golang", r"in go")),
        ("rust", _words("rust")),
        ("sql", _words("sql")),
        ("bash", _words("bash", "shell script")),
        ("ruby", _words("ruby")),
        ("php", _words("php")),
    )
)
_STEPS = re.compile(r"\b" + _NUM + r"\s+steps\b|\bstep[- ]by[- ]step\b")
_TONES = _alternatives(
    (
        (
            "simple",
            _words(
                r"simple terms",
                "simply",
                r"plain (?:language|english|words)",
                "eli5",
                r"like i'?m five",
                r"like i am five",
                r"for a (?:child|kid|beginner|layman)",
                r"layman'?s terms",
                r"keep it simple",
                r"simple words",
                r"easy to understand",
            ),
        ),
        ("formal", _words("formal", "formally")),
        ("casual", _words("casual", "informal", "conversational")),
        ("friendly", _words("friendly", "warm")),
        ("professional", _words("professional", "professionally")),
        ("concise", _words("concise", "concisely", "brief", "briefly", "succinct")),
        ("detailed", _words("detailed", r"in detail", "thorough", r"in depth", "comprehensive")),
        ("humorous", _words("funny", "humorous", "witty")),
    )
)


def _count(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBER_WORDS[word]


def action_of(text: str, language: str | None = None) -> str:
    """The action slot of a lower-cased instruction (the tiers of the module doc)."""
    specific = _SPECIFIC.search(text)
    generic = _GENERIC.search(text)
    if specific is not None and (generic is None or specific.start() < generic.start(1)):
        # converting or rendering into another natural language is translating
        action = specific.lastgroup
        return "translate" if action == "rewrite" and language not in (None, "en") else action
    if generic is not None:
        named = _OBJECTS.search(text, generic.end())
        if named is not None:
            return named.lastgroup
        # after a generic verb a describing or rendering word qualifies its object ("write JSON describing
        # a user"); the other actions still name the request ("give me the sentiment of ...")
        later = _SPECIFIC.search(text, generic.end())
        if later is not None and later.lastgroup not in ("explain", "rewrite"):
            return later.lastgroup
        return "list" if generic.group(1) in _LIST_VERBS else "write"
    if _CLASSIFY_QUESTION.search(text):
        return "classify"
    if _EXPLAIN_QUESTION.search(text):
        return "explain"
    if _ANSWER_QUESTION.search(text):
        return "answer"
    return "other"


# substrings one of which every match of the pattern they gate contains (a substring test is cheap)
_CODE_WORDS = (
    "python",
    "js",
    "node",
    "typescript",
    "java",
    "c++",
    "c#",
    "go",
    "rust",
    "sql",
    "bash",
    "shell",
    "ruby",
    "php",
)
_TONE_WORDS = (
    "simpl",
    "plain",
    "eli5",
    "five",
    "child",
    "kid",
    "beginner",
    "layman",
    "easy",
    "formal",
    "casual",
    "conversational",
    "friendly",
    "warm",
    "professional",
    "concise",
    "brief",
    "succinct",
    "detail",
    "thorough",
    "depth",
    "comprehensive",
    "funny",
    "humorous",
    "witty",
)
_UNIT_WORDS = ("word", "sentence", "token", "char", "bullet", "point", "item", "paragraph", "line")


def _constraints(text: str) -> dict[str, str]:
    found: dict[str, str] = {}
    if any(unit in text for unit in _UNIT_WORDS):  # a substring test is ~20x cheaper than the scans
        for m in _LENGTH.finditer(text):
            found.setdefault(_LENGTH_UNITS[m.group(2)], fmt.bucket(_count(m.group(1))))
        for m in _ONE.finditer(text):
            found.setdefault(_LENGTH_UNITS[m.group(1)], "1")
    languages = []
    if any(name in text for name in _LANGUAGES):
        languages = [(m.group(1), _LANGUAGES[m.group(2)]) for m in _LANGUAGE.finditer(text)]
    if languages:  # "from English to French": the target (a to/into one) over an "in" one
        targets = [code for prep, code in languages if prep != "in"]
        found["language"] = (targets or [code for _, code in languages])[-1]
    m = _CODE_LANGUAGES.search(text) if any(w in text for w in _CODE_WORDS) else None
    if m is not None:
        found["code_language"] = m.lastgroup
    m = _STEPS.search(text) if "step" in text else None
    if m is not None:
        found["steps"] = fmt.bucket(_count(m.group(1))) if m.group(1) else "any"
    tones = {m.lastgroup for m in _TONES.finditer(text)} if any(w in text for w in _TONE_WORDS) else ()
    for name in fmt.TONES:  # the vocabulary's order decides between two tones
        if name in tones:
            found["tone"] = name
            break
    return found


def _format_of(text: str, action: str) -> str:
    named = {m.lastgroup for m in _FORMATS.finditer(text)}
    for name in _FORMAT_ORDER:
        if name in named:
            return name
    return {"code": "code", "list": "list"}.get(action, "none")


def fingerprint(text: str) -> Intent:
    """The intent fingerprint of a prompt's text (pure; ids and hashes only)."""
    instruction, has_text = _instruction(text or "")
    stripped = _strip_content(instruction)
    tokens = _template_tokens(stripped)
    template = " ".join(tokens) + (" <text>" if has_text else "")
    simhash, minhash = _signatures(shingles(tokens))
    lowered = " ".join(stripped.lower().split())
    constraints = _constraints(lowered)
    action = action_of(lowered, constraints.get("language"))
    if action != "code":
        constraints.pop("code_language", None)  # "explain this Python code" names the code's language
    ordered = tuple(sorted(constraints.items(), key=lambda kv: fmt.KIND_IDS[kv[0]]))[: fmt.MAX_CONSTRAINTS]
    return Intent(_h64(template), simhash, minhash, action, _format_of(lowered, action), ordered)


def user_text(decoded: str, special_tokens=()) -> str:
    """The user's text of a decoded prompt: with a chat template, the last user turn (a segment between
    special tokens that is or starts with the role `user`; ChatML, Llama 3 and similar), else the text
    without its special tokens. The system prompt a template adds is not what the user asked."""
    specials = sorted((t for t in special_tokens if t), key=len, reverse=True)
    if not specials:
        return decoded
    segments = re.split("|".join(re.escape(t) for t in specials), decoded)
    found = None
    for i, seg in enumerate(segments):
        head = seg.strip()
        if head == "user" and i + 1 < len(segments):
            found = segments[i + 1]
        elif seg.lstrip().startswith("user\n"):
            found = seg.lstrip()[len("user\n") :]
    return (found if found is not None else "".join(segments)).strip()
