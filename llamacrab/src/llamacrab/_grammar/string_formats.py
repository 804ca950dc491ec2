"""GBNF for the string formats JSON Schema names that a grammar can hold at a bounded size
(OpenAI's Structured Outputs list, and what pydantic writes for its types); another format is
a plain string, as llama-server reads it."""

from __future__ import annotations

FORMATS = {
    "date": '[0-9]{4} "-" ( "0" [1-9] | "1" [0-2] ) "-" ( "0" [1-9] | [12] [0-9] | "3" [01] )',
    "time": (
        '( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] ":" [0-5] [0-9] ( "." [0-9]{1,6} )? '
        '( "Z" | [+-] ( [01] [0-9] | "2" [0-3] ) ":" [0-5] [0-9] )'
    ),
    "uuid": '[0-9a-f]{8} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{4} "-" [0-9a-f]{12}',
    "email": '[a-zA-Z0-9._+-]{1,32} "@" [a-zA-Z0-9-]{1,32} ( "." [a-zA-Z]{2,8} ){1,3}',
    "uri": '[a-zA-Z] [a-zA-Z0-9+.-]{0,9} "://" [a-zA-Z0-9._~:/?#@!$&()*+,;=%-]{1,200}',
}
FORMATS["date-time"] = f'{FORMATS["date"]} "T" {FORMATS["time"]}'
_OCTET = '( "25" [0-5] | "2" [0-4] [0-9] | "1" [0-9] [0-9] | [1-9]? [0-9] )'
FORMATS["ipv4"] = " ".join([_OCTET] + [f'"." {_OCTET}'] * 3)
# RFC 4291 text: eight groups, or fewer around one "::" (the IPv4-in-IPv6 forms left out).
_H16, _GROUPS = "[0-9a-fA-F]{1,4}", 8


def _groups(low: int, high: int) -> str:
    """``low`` to ``high`` colon-separated IPv6 groups."""
    if high == 0:
        return ""
    groups = f'{_H16} ( ":" {_H16} ){{{max(low - 1, 0)},{high - 1}}}' if high > 1 else _H16
    return groups if low else f"( {groups} )?"


FORMATS["ipv6"] = " | ".join(
    [f"( {_groups(_GROUPS, _GROUPS)} )"]
    + [f'( {_groups(left, left)} "::" {_groups(0, _GROUPS - 1 - left)} )'
       for left in range(_GROUPS)]
)  # fmt: skip
# RFC 1123 names: labels of up to 32 characters (of RFC's 63), at most 7, so at most 230 in all
# (RFC's limit is 253).
_LABEL = "[a-zA-Z0-9] ( [a-zA-Z0-9-]{0,30} [a-zA-Z0-9] )?"
FORMATS["hostname"] = f'{_LABEL} ( "." {_LABEL} ){{0,6}}'


def _some_of(parts: list[str]) -> str:
    """One or more of ``parts``, in their order."""
    return " | ".join(
        f"( {part} " + " ".join(f"( {later} )?" for later in parts[i + 1 :]) + " )"
        for i, part in enumerate(parts)
    )


# ISO 8601 durations as pydantic writes a timedelta: P1DT2H3M4.5S, PT0S, P2W.
_TIME_PARTS = ['[0-9]{1,6} "H"', '[0-9]{1,6} "M"', '[0-9]{1,6} ( "." [0-9]{1,6} )? "S"']
_DATE_PARTS = ['[0-9]{1,4} "Y"', '[0-9]{1,4} "M"', '[0-9]{1,6} "D"']
_TIME = f'"T" ( {_some_of(_TIME_PARTS)} )'
FORMATS["duration"] = (
    f'"P" ( ( {_some_of(_DATE_PARTS)} ) ( {_TIME} )? | {_TIME} | [0-9]{{1,4}} "W" )'
)
