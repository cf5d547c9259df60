"""Patterns for JSON Schema's date and time formats, to hold beside the format: the grammar's
formats allow values that are not dates (February 29 of any year, year 0000), and a backend
that reads a string's pattern and not its format (outlines-core) writes what the pattern
allows, so each pattern is whole on its own. Torch-free, so that a tool's schema is made
without loading the grammar layer."""

_YEAR = "(?:[0-9]{3}[1-9]|[0-9]{2}[1-9]0|[0-9][1-9]00|[1-9]000)"  # 0001 to 9999
_LEAP_YEAR = "(?:[0-9]{2}(?:0[48]|[2468][048]|[13579][26])|(?:0[48]|[2468][048]|[13579][26])00)"
# a day of the calendar
DATE = (f"(?:{_YEAR}-(?:0[13578]|1[02])-(?:0[1-9]|[12][0-9]|3[01])"
        f"|{_YEAR}-(?:0[469]|11)-(?:0[1-9]|[12][0-9]|30)"
        f"|{_YEAR}-02-(?:0[1-9]|1[0-9]|2[0-8])|{_LEAP_YEAR}-02-29)")
_OFFSET = "(?:[Zz]|[+-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
# seconds to 59: RFC 3339's leap second is refused by Python's and pydantic's times
_CLOCK = "(?:[01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](?:\\.[0-9]{1,9})?"
DATE_PATTERNS = {"date": f"^{DATE}$", "date-time": f"^{DATE}[Tt]{_CLOCK}{_OFFSET}$"}

# pydantic's date, time, datetime and timedelta (``GrammarJsonSchema``): what it reads, a time
# with or without its offset, a duration's numbers of at most 6 digits (its largest is
# 999,999,999 days)
_NUMBER = "[0-9]{1,6}"
_SECONDS = f"{_NUMBER}(?:\\.[0-9]{{1,6}})?S"
_TIME_PART = (f"T(?:{_NUMBER}H(?:{_NUMBER}M)?(?:{_SECONDS})?|{_NUMBER}M(?:{_SECONDS})?"
              f"|{_SECONDS})")
PYDANTIC_PATTERNS = {
    **DATE_PATTERNS,
    "time": f"^{_CLOCK}{_OFFSET}?$",
    "duration": f"^P(?:{_NUMBER}D(?:{_TIME_PART})?|{_TIME_PART})$",
}
