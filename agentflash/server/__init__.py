"""The OpenAI-compatible server (``agentflash serve``). Needs the ``server`` extra (starlette,
uvicorn); ``agentflash.server.app`` imports them, this package does not."""
