"""The engine's limits, checked without torch (a workflow's ``model:`` section is checked by
``agentflash validate``, which loads no model)."""

from __future__ import annotations

import math
from typing import Any

from agentflash.errors import is_int, is_number

# the most requests one engine may decode together (each holds a slot of the KV pool)
MAX_RUNNING = 1 << 20


def limit_problems(max_running: Any, max_len: Any, prefix_cache_mb: Any,
                   kv_budget_mb: Any) -> list[tuple[str, str]]:
    """(setting, what is wrong with it) for each of the engine's limits that it cannot take."""
    problems = []
    if kv_budget_mb is not None and not (is_number(kv_budget_mb)
                                         and 0 < kv_budget_mb < math.inf):  # NaN too
        problems.append(("kv_budget_mb", f"kv_budget_mb must be a positive number, got "
                                         f"{kv_budget_mb!r}"))
    if not is_int(max_running) or max_running < 1:
        problems.append(("max_running", f"max_running must be an integer of at least 1, "
                                        f"got {max_running!r}"))
    elif max_running > MAX_RUNNING:  # (2**63 overflowed torch's sizes: a traceback)
        problems.append(("max_running", f"max_running must be at most {MAX_RUNNING}, got "
                                        f"{max_running}"))
    if not is_int(max_len) or max_len < 2:
        problems.append(("max_len", f"max_len must be an integer of at least 2, got {max_len!r}"))
    if not (is_number(prefix_cache_mb) and 0 <= prefix_cache_mb < math.inf):  # NaN too
        problems.append(("prefix_cache_mb", f"prefix_cache_mb must be 0 or more, got "
                                            f"{prefix_cache_mb!r}"))
    return problems
