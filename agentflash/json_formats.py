"""Patterns to hold beside JSON Schema's date and time formats, and of what pydantic reads as a
decimal or a URL: the grammar's formats allow values that are not dates (February 29 of any
year, year 0000), and a backend that reads a string's pattern and not its format
(outlines-core) writes what the pattern allows, so each pattern is whole on its own.
Torch-free, so that a tool's schema is made without loading the grammar layer."""

import datetime
import decimal
import functools
import numbers
import re
from typing import Any

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001 to 9999
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
# a day of the calendar
DATE = (f"(?:{_YEAR}-(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        f"|{_YEAR}-(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
        f"|{_YEAR}-02-(?:0[1-9]|1[0-9]|2[0-8])|{_LEAP_YEAR}-02-29)")
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# seconds to 59: RFC 3339's leap second is refused by Python's and pydantic's times
_CLOCK = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
DATE_PATTERNS = {"date": f"^{DATE}$", "date-time": f"^{DATE}[Tt]{_CLOCK}{_OFFSET}$",
                 "time": f"^{_CLOCK}{_OFFSET}$"}  # RFC 3339's full-time: with its offset

# pydantic's date, time, datetime and timedelta (``GrammarJsonSchema``): what it reads, a time
# or datetime with or without its offset (``temporal_pattern`` binds it where the type does), a
# duration's numbers of at most 6 digits (its largest is 999,999,999 days)
_NUMBER = "[0-9]{1,6}"
_SECONDS = f"{_NUMBER}(?:\\.[0-9]{{1,6}})?S"
_TIME_PART = (f"T(?:{_NUMBER}H(?:{_NUMBER}M)?(?:{_SECONDS})?|{_NUMBER}M(?:{_SECONDS})?"
              f"|{_SECONDS})")
PYDANTIC_PATTERNS = {
    "date": DATE_PATTERNS["date"],
    "date-time": f"^{DATE}[Tt]{_CLOCK}{_OFFSET}?$",
    "time": f"^{_CLOCK}{_OFFSET}?$",
    "duration": f"^P(?:{_NUMBER}D(?:{_TIME_PART})?|{_TIME_PART})$",
}


def temporal_pattern(format: str, tz_constraint: str | int | None = None) -> str | None:
    """What pydantic reads of a ``format`` ("date", "date-time", "time" or "duration"; None for
    another): a time or datetime of pydantic's ``tz_constraint`` ("naive": without an offset,
    "aware": with one, seconds east of UTC: that offset) or either (None)."""
    pattern = PYDANTIC_PATTERNS.get(format)
    if pattern is None or format not in ("date-time", "time") or tz_constraint is None:
        return pattern
    if tz_constraint == "naive":
        offset = ""
    elif tz_constraint == "aware":
        offset = _OFFSET
    elif tz_constraint == 0:  # one offset, in seconds east of UTC
        offset = "(?:[Zz]|[+-]00:00)"
    else:
        hours, minutes = divmod(abs(int(tz_constraint)) // 60, 60)
        offset = f"{'-' if tz_constraint < 0 else '[+]'}{hours:02d}:{minutes:02d}"
    return pattern.replace(f"{_OFFSET}?$", f"{offset}$")


def date_bounds(low: datetime.date | None, high: datetime.date | None) -> list[str]:
    """Patterns of the ``YYYY-MM-DD`` strings from ``low`` to ``high`` (inclusive; None: no
    bound), one a bound: such strings order as their days do, so each is the strings at or
    after (before) its bound's, letter by letter. Beside ``DATE``, in an ``allOf``."""
    patterns = []
    for bound, later in ((low, True), (high, False)):
        if bound is None:
            continue
        text = f"{bound.year:04d}-{bound.month:02d}-{bound.day:02d}"
        branches = [text]  # digits and hyphens: no character to escape
        for i, char in enumerate(text):
            beyond = (range(int(char) + 1, 10) if later else range(int(char))
                      ) if char.isdigit() else ()
            if beyond:
                rest = len(text) - i - 1
                branches.append(f"{text[:i]}[{beyond[0]}-{beyond[-1]}]"
                                + (f"[0-9-]{{{rest}}}" if rest else ""))
        patterns.append("^(?:" + "|".join(branches) + ")$")
    return patterns


def decimal_pattern(max_digits: int | None, decimal_places: int | None) -> str:
    """A decimal number written out (no exponent: pydantic does not bound an exponent's digits)
    with at most ``max_digits`` digits, ``decimal_places`` of them after the point."""
    if max_digits is not None and max_digits < 1:
        raise ValueError(f"a decimal of max_digits={max_digits} has no value to write")
    if max_digits is None:
        whole = "(?:0|[1-9][0-9]*)"
        fraction = "[0-9]+" if decimal_places is None else f"[0-9]{{1,{decimal_places}}}"
        number = f"{whole}(?:\\.{fraction})?" if decimal_places != 0 else whole
    elif decimal_places is not None:
        wholes = max_digits - decimal_places  # digits before the point
        places = min(decimal_places, max_digits)
        if wholes <= 0:  # pydantic counts a 0 before the point where nothing follows it
            number = f"0\\.[0-9]{{1,{places}}}"
        else:
            whole = f"(?:0|[1-9][0-9]{{0,{wholes - 1}}})"
            number = f"{whole}(?:\\.[0-9]{{1,{places}}})?" if places else whole
    else:  # the digits shared between the two sides: one branch per length of the whole part
        branches = [f"0(?:\\.[0-9]{{1,{max_digits}}})?"] if max_digits else ["0"]
        for wholes in range(1, max_digits + 1):
            rest = max_digits - wholes
            tail = f"(?:\\.[0-9]{{1,{rest}}})?" if rest else ""
            branches.append(f"[1-9][0-9]{{{wholes - 1}}}{tail}")
        number = "(?:" + "|".join(branches) + ")"
    return f"^-?{number}$"


_OCTET = "(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_IPV4 = f"{_OCTET}(?:\\.{_OCTET}){{3}}"


def _ipv6() -> str:
    """RFC 3986's IPv6address: eight groups, or fewer around one ``::``, the last two of them
    an IPv4 address or not."""
    h16 = "[0-9A-Fa-f]{1,4}"
    ls32 = f"(?:{h16}:{h16}|{_IPV4})"

    def groups(n: int) -> str:  # n groups, each followed by a colon
        return f"(?:{h16}:){{{n}}}" if n else ""

    forms = [f"{groups(6)}{ls32}", f"::{groups(5)}{ls32}"]
    # [ *before( h16 ":" ) h16 ] "::" then what is left of the eight groups
    tails = [f"{groups(4)}{ls32}", f"{groups(3)}{ls32}", f"{groups(2)}{ls32}",
             f"{groups(1)}{ls32}", ls32, h16, ""]
    for before, tail in enumerate(tails):
        head = f"(?:(?:{h16}:){{0,{before}}}{h16})?" if before else f"(?:{h16})?"
        forms.append(f"{head}::{tail}")
    return "(?:" + "|".join(forms) + ")"


def uuid_pattern(version: int | None = None) -> str:
    """A UUID in its hyphenated form; of one ``version`` (and RFC 4122's variant, without which
    Python's ``UUID.version`` is None) where one is given."""
    hex = "[0-9a-fA-F]"
    if version is None:
        return f"^{hex}{{8}}-{hex}{{4}}-{hex}{{4}}-{hex}{{4}}-{hex}{{12}}$"
    return f"^{hex}{{8}}-{hex}{{4}}-{int(version)}{hex}{{3}}-[89abAB]{hex}{{3}}-{hex}{{12}}$"


def ip_address_pattern() -> str:
    """An IPv4 or an IPv6 address."""
    return f"^(?:{_IPV4}|{_ipv6()})$"


_PORT = "(?:[0-9]{1,4}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"


def url_pattern(schemes: list[str]) -> str:
    """A URL of one of ``schemes`` (pydantic's ``allowed_schemes``) that pydantic reads: a host
    (an IPv4 address, an IPv6 address in brackets, or a name of letters, digits and hyphens whose
    last label begins with a letter -- one of digits reads as an IPv4 address -- and none of
    them with ``xn--``, punycode, which is checked), a port up to 65535, then a path, query or
    fragment of printable characters (no blank). A ``file`` URL has no port and may leave the
    host out (``file:///etc/hosts``). Not written: a ``user:password@``, which overlaps a host
    name so much that llguidance's lexer gives up on a tool's grammar holding it beside other
    patterns ("too many expressions constructed")."""
    rest = "[A-Za-z0-9-]*"
    not_punycode = (f"[Xx](?:[A-MO-Za-mo-z0-9-]{rest})?|[Xx][Nn](?:[A-Za-z0-9]{rest})?"
                    f"|[Xx][Nn]-(?:[A-Za-z0-9]{rest})?")
    label = f"(?:[A-WYZa-wyz0-9-]{rest}|{not_punycode})"
    last = f"(?:[A-WYZa-wyz]{rest}|{not_punycode})"
    host = f"(?:(?:{label}\\.)*{last}|{_IPV4}|\\[{_ipv6()}\\])"
    others = "|".join(re.escape(s) for s in schemes if s != "file")
    starts = [f"(?:{others})://{host}(?::{_PORT})?"] if others else []
    if "file" in schemes:  # a host or none, without user or port
        starts.append(f"file://{host}?")
    return f"^(?:{'|'.join(starts)})(?:[/?#][!-~]*)?$"


def _times(low: int, high: int | None) -> str:
    return "*" if (low, high) == (0, None) else f"{{{low},{'' if high is None else high}}}"


# the symbol that ends base64 of a group's last 1 or 2 bytes: its bits past them 0
_BASE64_LAST = {1: "[AQgw]", 2: "[AEIMQUYcgkosw048]"}


def bytes_pattern(encoding: str, min_bytes: int | None, max_bytes: int | None) -> str | None:
    """A string pydantic reads as bytes (a model's ``val_json_bytes``: "base64" or "hex") of
    ``min_bytes`` to ``max_bytes`` bytes once decoded; None where there are none. Base64 in the
    standard alphabet or the URL-safe one (not both in one string), the last symbol's unused
    bits 0, its padding given, in part (``YQ=``) or not at all, as pydantic reads it."""
    low = min_bytes or 0
    if encoding == "hex":
        return f"^(?:[0-9A-Fa-f]{{2}}){_times(low, max_bytes)}$"
    branches = []
    for alphabet in ("[A-Za-z0-9+/]", "[A-Za-z0-9_-]"):
        for rest, tail in ((0, ""), (1, f"{alphabet}{_BASE64_LAST[1]}(?:==?)?"),
                           (2, f"{alphabet}{{2}}{_BASE64_LAST[2]}=?")):
            groups = max(0, -(-(low - rest) // 3))  # of 3 bytes, 4 symbols each
            most = None if max_bytes is None else (max_bytes - rest) // 3
            if most is not None and most < groups:
                continue
            whole = "" if most == 0 else f"(?:{alphabet}{{4}}){_times(groups, most)}"
            branches.append(whole + tail)
    return "^(?:" + "|".join(branches) + ")$" if branches else None


def format_checker() -> "jsonschema.FormatChecker":  # type: ignore[name-defined]  # noqa: F821
    """jsonschema's format checks of a value written without the grammar (a remote server's,
    a scripted one's), but its date, date-time and time: those are ``DATE_PATTERNS``'s, held
    beside the format (``exact_dates``), as the grammar writes them; jsonschema's time check
    refused the offset RFC 3339's full-time has ("12:30:00Z"), which the grammar writes."""
    from jsonschema import FormatChecker

    checker = FormatChecker()
    for fmt in DATE_PATTERNS:
        checker.checkers.pop(fmt, None)
    return checker


def value_validator(schema: Any) -> Any:
    """jsonschema's Draft 2020-12 check of a value against ``schema`` (exact_dates' already:
    a workflow's input, an agent's answer, an HTTP tool's arguments), formats by
    ``format_checker`` and patterns' ``$`` as JSON Schema reads it (``ecma_pattern``)."""
    return ecma_validator_class()(schema, format_checker=format_checker())


@functools.cache
def ecma_validator_class() -> Any:
    """Draft 2020-12's validator, its regexes' ``$`` read as ECMA-262's (``_ecma_regex``): of
    ``pattern``, and of ``patternProperties`` where that keyword, ``additionalProperties``
    and ``unevaluatedProperties`` match a key (jsonschema's ``re.search``: "abc\\n" passed
    ``^[a-z]+$``); ``multipleOf`` exact in decimal (``decimal_multiple_of``)."""
    from jsonschema import Draft202012Validator, validators

    return validators.extend(Draft202012Validator, {
        "pattern": ecma_pattern, "patternProperties": _pattern_properties,
        "additionalProperties": _additional_properties,
        "unevaluatedProperties": _unevaluated_properties,
        "multipleOf": decimal_multiple_of})


def decimal_multiple_of(validator: Any, step: Any, instance: Any, schema: Any) -> Any:
    """``multipleOf`` on the numbers as JSON writes them (the shortest text of a float), as the
    grammar checks what it writes: jsonschema divides floats, and refused 0.07 under
    ``multipleOf: 0.01`` (0.07 / 0.01 is 7.000000000000001), a value the grammar wrote."""
    from fractions import Fraction

    from jsonschema.exceptions import ValidationError

    def exact(x: Any) -> Fraction:  # an int as it is (its text may pass Python's 4,300 digits),
        # a Decimal as it is, another number (a float, numpy's) by its float's shortest text
        if isinstance(x, numbers.Integral):
            return Fraction(int(x))
        if isinstance(x, decimal.Decimal):
            return Fraction(x)
        return Fraction(repr(float(x)))

    def shown(x: Any) -> str:
        if isinstance(x, numbers.Integral) and int(x).bit_length() > 4000:
            return f"an integer of about {int(int(x).bit_length() * 0.30103)} digits"
        return repr(x)

    def too_fine(x: Any, denominator: int) -> bool:  # a Decimal's 10^-k, k past the step's:
        # its denominator in lowest terms is over 10^(k - digits), so not the step's divisor
        # (Fraction would build 10^k: 1E-10000000 took 8 s)
        sign, digits, exponent = x.as_tuple()
        return isinstance(exponent, int) and -exponent - len(digits) > len(str(denominator))

    if not validator.is_type(instance, "number"):
        return
    try:
        if isinstance(instance, decimal.Decimal) and instance and too_fine(
                instance, exact(step).denominator):
            multiple = False
        else:
            multiple = exact(instance) % exact(step) == 0
    except (ValueError, OverflowError, ZeroDivisionError):  # inf and nan are no multiple
        multiple = False
    if not multiple:
        yield ValidationError(f"{shown(instance)} is not a multiple of {shown(step)}")


def ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Any:
    """``pattern`` with its ``$`` as JSON Schema reads it (ECMA-262): the end of the text.
    Python's ``$`` (jsonschema's ``re.search``) also matches before a last newline:
    "2024-02-29\\n" passed as a date, "writer\\n" as an agent's name. (``\\d``, ``\\w`` and
    ``.`` are still Python's: a "٢" is a digit.)"""
    from jsonschema.exceptions import ValidationError

    if validator.is_type(instance, "string") and not _ecma_regex(pattern).search(instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _matched(patterns: Any, key: str) -> bool:
    return any(_ecma_regex(pattern).search(key) for pattern in patterns)


def _pattern_properties(validator: Any, patterns: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's ``patternProperties``, its keys matched by ``_ecma_regex``."""
    if validator.is_type(instance, "object"):
        for pattern, subschema in patterns.items():
            for key, value in instance.items():
                if _ecma_regex(pattern).search(key):
                    yield from validator.descend(value, subschema, path=key,
                                                 schema_path=pattern)


def _additional_properties(validator: Any, extra: Any, instance: Any, schema: Any) -> Any:
    """jsonschema's ``additionalProperties``, the keys no ``patternProperties`` takes found
    by ``_ecma_regex``."""
    from jsonschema._utils import extras_msg
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    named, patterns = schema.get("properties", {}), schema.get("patternProperties", {})
    extras = {key for key in instance if key not in named and not _matched(patterns, key)}
    if validator.is_type(extra, "object"):
        for key in extras:
            yield from validator.descend(instance[key], extra, path=key)
    elif not extra and extras:
        if "patternProperties" in schema:
            verb = "does" if len(extras) == 1 else "do"
            yield ValidationError(f"{', '.join(map(repr, sorted(extras)))} {verb} not match "
                                  f"any of the regexes: {', '.join(map(repr, sorted(patterns)))}")
        else:
            said, verb = extras_msg(sorted(extras, key=str))
            yield ValidationError(f"Additional properties are not allowed ({said} {verb} "
                                  f"unexpected)")


def _unevaluated_properties(validator: Any, unevaluated: Any, instance: Any,
                            schema: Any) -> Any:
    """jsonschema's ``unevaluatedProperties``, the keys evaluated found by ``_evaluated``."""
    from jsonschema._utils import extras_msg
    from jsonschema.exceptions import ValidationError

    if not validator.is_type(instance, "object"):
        return
    evaluated = _evaluated(validator, instance, schema)
    bad = [key for key in instance if key not in evaluated
           and next(validator.descend(instance[key], unevaluated, path=key,
                                      schema_path=key), None) is not None]
    if bad and unevaluated is False:
        said, verb = extras_msg(sorted(bad, key=str))
        yield ValidationError(f"Unevaluated properties are not allowed ({said} {verb} "
                              f"unexpected)")
    elif bad:
        said, verb = extras_msg(bad)
        yield ValidationError(f"Unevaluated properties are not valid under the given schema "
                              f"({said} {verb} unevaluated and invalid)")


def _evaluated(validator: Any, instance: Any, schema: Any) -> set[str]:
    """jsonschema's ``find_evaluated_property_keys_by_schema`` (4.26), ``patternProperties``
    matched by ``_ecma_regex``."""
    if validator.is_type(schema, "boolean"):
        return set()
    keys: set[str] = set()
    for ref in (schema.get("$ref"), schema.get("$dynamicRef")):
        if ref is not None:
            resolved = validator._resolver.lookup(ref)
            keys |= _evaluated(validator.evolve(schema=resolved.contents,
                                                _resolver=resolved.resolver),
                               instance, resolved.contents)
    named = schema.get("properties")
    if validator.is_type(named, "object"):
        keys |= named.keys() & instance.keys()
    for keyword in ("additionalProperties", "unevaluatedProperties"):
        if (sub := schema.get(keyword)) is not None:
            keys |= {key for key, value in instance.items()
                     if next(validator.descend(value, sub), None) is None}
    keys |= {key for key in instance if _matched(schema.get("patternProperties", {}), key)}
    for key, sub in schema.get("dependentSchemas", {}).items():
        if key in instance:
            keys |= _evaluated(validator, instance, sub)
    for keyword in ("allOf", "oneOf", "anyOf"):
        for sub in schema.get(keyword, []):
            if next(validator.descend(instance, sub), None) is None:
                keys |= _evaluated(validator, instance, sub)
    if "if" in schema:
        if validator.evolve(schema=schema["if"]).is_valid(instance):
            keys |= _evaluated(validator, instance, schema["if"])
            if "then" in schema:
                keys |= _evaluated(validator, instance, schema["then"])
        elif "else" in schema:
            keys |= _evaluated(validator, instance, schema["else"])
    return keys


@functools.lru_cache(maxsize=512)
def _ecma_regex(pattern: str) -> re.Pattern[str]:
    """``pattern`` compiled with each ``$`` that is an anchor (not escaped, not in a class)
    as ``\\Z``, the end of the text."""
    out, i, n = [], 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[":  # a class: to its end (a ']' first in it is one of its characters)
            j = i + 1 + (pattern[i + 1:i + 2] == "^")
            j += pattern[j:j + 1] == "]"
            while j < n and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            out.append(pattern[i:j + 1])
            i = j + 1
            continue
        out.append("\\Z" if c == "$" else c)
        i += 1
    return re.compile("".join(out))


_DATE_FORMATS = {pattern: fmt for fmt, pattern in DATE_PATTERNS.items()}


def error_message(error: "jsonschema.ValidationError") -> str:  # type: ignore[name-defined]  # noqa: F821
    """jsonschema's message for ``error``; a ``DATE_PATTERNS`` pattern that ``exact_dates`` put
    beside a format is named as the format, not spelled out."""
    fmt = _DATE_FORMATS.get(error.validator_value) if error.validator == "pattern" else None
    return error.message if fmt is None else f"{error.instance!r} is not a {fmt!r}"
