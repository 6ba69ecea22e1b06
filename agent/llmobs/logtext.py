"""One event, one line: text that came from a process (its command line, its comm) made safe to log.

A command line may hold any byte but NUL (`python -c` with a multi-line program has newlines), and a comm
any 15 of them: logged as is, a newline splits one event into two lines and lets a process forge lines
such as "llmobs-agent: detach pid ..."; an ESC starts a terminal escape sequence. Control characters,
Unicode line/paragraph separators and bidirectional overrides are written as Python escapes instead.
"""

from __future__ import annotations

import re

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0 and C1 controls and DEL; U+2028/U+2029 (line/paragraph separators); the bidi embeddings, overrides
# and isolates, which reorder what a reader sees on the line
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def _escape(match: re.Match) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def one_line(text: str) -> str:
    """`text` with every character that could break or disguise a log line escaped (\\n, \\x1b, \\u2028)."""
    return _UNSAFE.sub(_escape, text)
