"""Python tools for the example workflows (``python: weather_tools:get_weather``).

Results follow the demo model's training format: a JSON object with ``status`` and ``id``.
"""

from __future__ import annotations

import zlib

from agentflash.runtime import tool

SKIES = ("sunny", "cloudy", "rainy", "windy", "snowy")


def _id(*parts: object) -> int:
    return zlib.crc32(" ".join(map(str, parts)).encode()) % 10000


@tool
def get_weather(city: str, days: int = 1) -> dict:
    """Get the weather forecast for a city.

    Args:
        city: The city to look up.
        days: How many days of forecast, from today.
    """
    if not 1 <= days <= 14:
        raise ValueError(f"days must be between 1 and 14, got {days}")
    forecast = [SKIES[(_id(city, day)) % len(SKIES)] for day in range(days)]
    return {"status": "ok", "id": _id(city, days), "forecast": " ".join(forecast)}


@tool
def book_hotel(city: str, guests: int, breakfast: bool = False) -> dict:
    """Book a hotel room.

    Args:
        city: Where to book.
        guests: How many people stay in the room.
        breakfast: Whether breakfast is included.
    """
    return {"status": "ok", "id": _id(city, guests, breakfast)}
