"""agentflash: an agent / tool-calling runtime whose own inference engine makes structured
output fast."""

__version__ = "0.1.0"
