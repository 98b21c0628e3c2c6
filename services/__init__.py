"""Long-running processes and their wire protocol (asyncio, pyzmq, redis),
and the `mariana` command line."""

__version__ = "0.1.0"
