"""``python -m agentflash``: the ``agentflash`` command."""

from agentflash.cli import main

main()
