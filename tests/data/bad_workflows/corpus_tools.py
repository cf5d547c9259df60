"""A typed tool for the bad-workflow corpus (imported by files that name ``corpus_tools:...``)."""


def get_weather(city: str) -> dict:
    """Get the weather for a city."""
    return {"status": "ok", "city": city}
